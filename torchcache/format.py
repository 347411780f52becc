"""Cache format v1: block files, offset sidecars and the manifest (see docs/format.md).

Everything on disk is safetensors or JSON: opening a cache never unpickles anything. Files are
written through a Storage (see storage.py), so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from .storage import Storage, open_storage

FORMAT_NAME = "torchcache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
BLOCK_DIR = "blocks"

_DTYPES = {"U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8")}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 1 << 20


class CacheFormatError(ValueError):
    """A cache file is missing, truncated, corrupted or not in a format this version can read."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return _DTYPES["U16"] if vocab_size <= 1 << 16 else _DTYPES["U32"]


def dtype_name(dtype: np.dtype) -> str:
    return _DTYPE_NAMES[np.dtype(dtype).newbyteorder("<")]


def block_name(input_index: int, block_index: int) -> str:
    """Relative path of a block file; its name is fixed by (input, block) so rebuilds are identical."""
    return f"{BLOCK_DIR}/{input_index:06d}-{block_index:06d}.safetensors"


def offsets_name(block_path: str) -> str:
    return block_path[: -len(".safetensors")] + ".offsets.safetensors"


def safetensors_bytes(name: str, array: np.ndarray, metadata: dict[str, str]) -> tuple[bytes, int]:
    """Header bytes of a one-tensor safetensors file, and the offset where its data starts."""
    array = np.ascontiguousarray(array)
    header = {
        "__metadata__": metadata,
        name: {"dtype": dtype_name(array.dtype), "shape": [int(array.shape[0])],
               "data_offsets": [0, int(array.nbytes)]},
    }
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, 8 + len(raw)


@dataclass(frozen=True)
class WrittenFile:
    path: str
    size: int
    checksum: str


def write_tensor_file(storage: "Storage", rel_path: str, name: str, array: np.ndarray,
                      metadata: dict[str, str]) -> WrittenFile:
    """Write a one-tensor safetensors file so that it appears whole or not at all."""
    head, _ = safetensors_bytes(name, array, metadata)
    data = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"), copy=False)
    size, checksum = storage.write(rel_path, [head, memoryview(data).cast("B")])
    return WrittenFile(rel_path, size, checksum)


def keys_name(block_path: str) -> str:
    return block_path[: -len(".safetensors")] + ".keys.json"


def write_keys_file(storage: "Storage", rel_path: str, keys: list[str | None]) -> WrittenFile:
    """Write a block's document keys (a JSON list of strings), like a tensor file."""
    data = json.dumps(keys, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    size, checksum = storage.write(rel_path, [data])
    return WrittenFile(rel_path, size, checksum)


@dataclass(frozen=True)
class TensorHeader:
    dtype: np.dtype
    length: int
    data_start: int
    metadata: dict[str, str]


def read_tensor_header(f: BinaryIO, path: str, name: str, file_size: int) -> TensorHeader:
    """Parse and check the header of a one-tensor safetensors file; errors name the file."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise CacheFormatError(f"{path}: truncated safetensors file (no header); run `torchcache verify`")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > _MAX_HEADER or 8 + header_len > file_size:
        raise CacheFormatError(f"{path}: corrupted safetensors header length {header_len}")
    try:
        header = json.loads(f.read(header_len))
        entry = header[name]
        dtype = _DTYPES[entry["dtype"]]
        (length,) = entry["shape"]
        begin, end = entry["data_offsets"]
    except (ValueError, KeyError, TypeError) as e:
        raise CacheFormatError(f"{path}: corrupted safetensors header ({e!r})") from None
    if begin != 0 or end != length * dtype.itemsize:
        raise CacheFormatError(f"{path}: inconsistent tensor offsets in header")
    expected = 8 + header_len + end
    if file_size != expected:
        raise CacheFormatError(
            f"{path}: file is {file_size} bytes, its header says {expected}: the block is "
            "truncated or corrupted; rebuild it (delete the cache and build again)")
    return TensorHeader(dtype, int(length), 8 + header_len, header.get("__metadata__") or {})


def read_tensor_file(path: str, name: str) -> np.ndarray:
    """Read a whole (small) one-tensor safetensors file, e.g. an offsets sidecar."""
    with open(path, "rb") as f:
        header = read_tensor_header(f, path, name, os.fstat(f.fileno()).st_size)
        return np.frombuffer(f.read(), dtype=header.dtype)


def file_checksum(path: str, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(chunk):
            digest.update(data)
    return "sha256:" + digest.hexdigest()


def safe_join(root: str, rel_path: str) -> str:
    """Join a manifest path to the cache root, refusing anything that escapes it."""
    if (not isinstance(rel_path, str) or not rel_path or rel_path.startswith(("/", "\\"))
            or "\\" in rel_path or ":" in rel_path):
        raise CacheFormatError(f"manifest names an unsafe path {rel_path!r}; refusing to open it")
    norm = posixpath.normpath(rel_path)
    if norm.startswith("..") or norm == ".":
        raise CacheFormatError(f"manifest path {rel_path!r} leaves the cache directory; refusing it")
    return os.path.join(root, *norm.split("/"))


def read_manifest(root: "str | Storage") -> dict[str, Any]:
    """The manifest of a cache (a local path or a Storage), checked for format and version."""
    storage = open_storage(root) if isinstance(root, (str, os.PathLike)) else root
    path = f"{storage.url}/{MANIFEST_NAME}"
    try:
        manifest = json.loads(storage.read(MANIFEST_NAME))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: no manifest; {storage.url!r} is not a torchcache cache (or its build has not "
            "committed anything yet)") from None
    except ValueError as e:
        raise CacheFormatError(f"{path}: manifest is not valid JSON ({e})") from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest: Any, path: str) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CacheFormatError(f"{path}: not a torchcache manifest")
    if manifest.get("version") != FORMAT_VERSION:
        raise CacheFormatError(
            f"{path}: format version {manifest.get('version')!r}; this torchcache reads version "
            f"{FORMAT_VERSION}. Upgrade torchcache or rebuild the cache")
    for key in ("spec", "blocks", "inputs", "complete"):
        if key not in manifest:
            raise CacheFormatError(f"{path}: manifest lacks {key!r}")


def spec_fingerprint(spec: dict[str, Any]) -> str:
    """Identity of a cache: the final cache is a pure function of its spec."""
    canon = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION, "spec": spec},
                       sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:32]
