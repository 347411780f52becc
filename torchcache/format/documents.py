"""Format v3's documents sidecar: per block, where each document came from, which of its tokens
are trained, and the fields the build kept (see docs/format.md, "Format v3").

`blocks/IIIIII-KKKKKK.docs.safetensors` holds up to four 1-D tensors:
  records        I64, one per document: the 0-based index of its record in its input (line - 1,
                 row, sample, item)
  mask           I32 (I64 for a block of 2^31 tokens or more): (start, length) pairs, flattened, of
                 the runs of trained tokens, block-relative, sorted, apart, never empty. Only in a
                 cache with loss masks.
  fields         U8, the documents' kept fields, each a compact JSON object, back to back
  field_offsets  I64, one per document + 1: where each document's fields start in `fields`.
                 Both only in a cache built with keep_fields.
  arrays_sha256  U8[32], the sha256 of the block's arrays sidecar (format/arrays.py); only in a
                 cache built with arrays=.
  keys           U8, the documents' sample keys (webdataset `__key__`) as one compact JSON list
                 (UTF-8), one per document; only in a block whose input's records have keys (tars).
Its sha256 takes the index record's third checksum slot (the keys file's in v1/v2), so it covers
the keys too: a v3 block has no keys file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import CacheFormatError
from . import blocks as fmt
from .storage import Storage

DOCS_VERSION = 3  # the layout version of a cache whose blocks have documents sidecars
_REQUIRED = ("records",)
_OPTIONAL = ("mask", "fields", "field_offsets", "arrays_sha256", "keys")
MAX_FIELDS_BYTES = 1 << 30


def has_documents(spec: dict[str, Any]) -> bool:
    """True for a cache that keeps a documents sidecar per block (format v3)."""
    return spec.get("documents") is not None


def layout_version(spec: dict[str, Any]) -> int:
    """The format version a new cache of `spec` is written in: 3 with documents sidecars, else 2
    (a text cache stays v2, byte for byte)."""
    return DOCS_VERSION if has_documents(spec) else fmt.FORMAT_VERSION


def has_loss_mask(spec: dict[str, Any]) -> bool:
    return has_documents(spec) and bool(spec["documents"].get("loss_mask"))


def has_arrays(spec: dict[str, Any]) -> bool:
    """True for a cache whose documents carry typed arrays (an arrays sidecar per block)."""
    return has_documents(spec) and bool(spec["documents"].get("arrays"))


@dataclass(frozen=True)
class BlockDocuments:
    """One block's documents sidecar, checked."""

    records: np.ndarray        # int64, one per document: its record's 0-based index in its input
    runs: np.ndarray | None    # int64 (n, 2): (start, length) of trained runs, block-relative
    fields: bytes | None
    field_offsets: np.ndarray | None
    path: str = ""             # the sidecar's path, for errors
    arrays_sha256: str | None = None  # "sha256:<hex>" of the block's arrays sidecar (None: no arrays)
    keys: tuple[str | None, ...] | None = None  # each document's sample key (None: the block has none)

    def key_of(self, d: int) -> str | None:
        """The sample key of the block's document d (None when the block keeps no keys)."""
        return None if self.keys is None else self.keys[d]

    def fields_of(self, d: int) -> dict[str, Any]:
        """The kept fields of the block's document d ({} when none were kept); damaged bytes
        there are a CacheFormatError naming the sidecar, never a bare decoding error."""
        if self.fields is None:
            return {}
        raw = self.fields[int(self.field_offsets[d]): int(self.field_offsets[d + 1])]
        try:
            value = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CacheFormatError(f"{self.path}: the kept fields of document {d} of the block are "
                                   f"not UTF-8 JSON ({type(e).__name__}: {e}); the documents sidecar "
                                   "is corrupted (run `torchcache verify --repair`)") from None
        if not isinstance(value, dict):
            raise CacheFormatError(f"{self.path}: the kept fields of document {d} of the block are "
                                   f"a JSON {type(value).__name__}, not an object; the documents "
                                   "sidecar is corrupted (run `torchcache verify --repair`)")
        return value


def write_docs_file(storage: Storage, rel_path: str, records: Sequence[int], runs: np.ndarray | None,
                    fields: Sequence[bytes] | None, num_tokens: int,
                    arrays_sha256: str | None = None,
                    keys: Sequence[str | None] | None = None) -> fmt.WrittenFile:
    """Write a block's documents sidecar (whole or not at all); `arrays_sha256`: the checksum ("sha256:<hex>")
    of the block's arrays sidecar, in a cache with arrays; `keys`: the documents' sample keys
    (None, or all None: the block keeps none, and the sidecar has no `keys` tensor)."""
    tensors: dict[str, np.ndarray] = {"records": np.asarray(records, dtype=np.int64)}
    if runs is not None:
        dtype = np.int32 if num_tokens < 1 << 31 else np.int64
        tensors["mask"] = np.asarray(runs, dtype=dtype).reshape(-1)
    if fields is not None:
        offsets = np.zeros(len(fields) + 1, dtype=np.int64)
        np.cumsum([len(f) for f in fields], out=offsets[1:])
        tensors["fields"] = np.frombuffer(b"".join(fields), dtype=np.uint8)
        tensors["field_offsets"] = offsets
    if arrays_sha256 is not None:
        tensors["arrays_sha256"] = np.frombuffer(bytes.fromhex(arrays_sha256.removeprefix("sha256:")),
                                                 dtype=np.uint8)
    if keys is not None and any(k is not None for k in keys):
        text = json.dumps(list(keys), ensure_ascii=False, separators=(",", ":")).encode("utf-8")
        tensors["keys"] = np.frombuffer(text, dtype=np.uint8)
    meta = {"format": fmt.FORMAT_NAME, "version": str(DOCS_VERSION)}
    return fmt.write_tensors_file(storage, rel_path, tensors, meta)


def docs_max_size(num_documents: int, num_tokens: int) -> int:
    """The largest a sound documents sidecar of such a block can be (a cap checked before reading)."""
    return fmt.MAX_HEADER_BYTES + 8 + 8 * num_documents + 8 * (num_documents + 1) + 8 * num_tokens \
        + MAX_FIELDS_BYTES + 32 + fmt.MAX_KEYS_BYTES


def read_docs_file(fd: int, path: str, num_documents: int, num_tokens: int,
                   *, mask: bool, fields: bool, arrays: bool = False) -> BlockDocuments:
    """A block's documents sidecar, checked against the block (its documents and tokens) and the
    spec (whether it has a mask and fields); errors name the file."""
    size = os.fstat(fd).st_size
    headers = fmt.read_tensors_header(fd, path, _REQUIRED, _OPTIONAL, size)

    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{path}: {what}; the documents sidecar is corrupted (run "
                                "`torchcache verify --repair`)")

    for name, wanted in (("mask", mask), ("fields", fields), ("field_offsets", fields),
                         ("arrays_sha256", arrays)):
        if (name in headers) != wanted:
            raise bad(f"tensor {name!r} is {'missing' if wanted else 'unexpected'}")
    records = _array(fd, path, headers["records"], ("I64",), num_documents, bad, "records")
    if len(records) and (records[0] < 0 or np.any(np.diff(records) <= 0)):
        raise bad("record indices are not increasing from 0")
    runs = None
    if mask:
        flat = _array(fd, path, headers["mask"], ("I32", "I64"), None, bad, "mask")
        if len(flat) % 2:
            raise bad("mask holds an odd number of values")
        runs = flat.astype(np.int64).reshape(-1, 2)
        starts, lengths = runs[:, 0], runs[:, 1]
        if len(runs) and (starts[0] < 0 or np.any(lengths <= 0) or starts[-1] + lengths[-1] > num_tokens
                          or np.any(starts[1:] <= starts[:-1] + lengths[:-1])):
            raise bad(f"mask runs are not sorted, apart and inside the block's {num_tokens} tokens")
    text = offsets = None
    if fields:
        offsets = _array(fd, path, headers["field_offsets"], ("I64",), num_documents + 1, bad,
                         "field_offsets")
        h = headers["fields"]
        if h.dtype != fmt.DTYPES["U8"] or h.length > MAX_FIELDS_BYTES:
            raise bad("fields is not bytes")
        text = bytes(fmt.read_exact(fd, h.data_start, h.length, path))
        if offsets[0] != 0 or offsets[-1] != len(text) or np.any(np.diff(offsets) < 0):
            raise bad("field_offsets do not cover fields")
    digest = None
    if arrays:
        digest = "sha256:" + bytes(_array(fd, path, headers["arrays_sha256"], ("U8",), 32, bad,
                                          "arrays_sha256")).hex()
    keys = None
    if "keys" in headers:
        keys = _keys(fd, path, headers["keys"], num_documents, bad)
    return BlockDocuments(records, runs, text, offsets, path, digest, keys)


def _keys(fd: int, path: str, header: fmt.TensorHeader, num_documents: int,
          bad: Any) -> tuple[str | None, ...]:
    """The sidecar's `keys` tensor: a UTF-8 JSON list of one string (or null) per document."""
    if header.dtype != fmt.DTYPES["U8"] or header.length > fmt.MAX_KEYS_BYTES:
        raise bad("keys is not bytes")
    raw = bytes(fmt.read_exact(fd, header.data_start, header.length, path))
    try:
        keys = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"the sample keys are not a UTF-8 JSON list ({type(e).__name__}: {e})") from None
    if not isinstance(keys, list) or not all(k is None or isinstance(k, str) for k in keys):
        raise bad("the sample keys are not a JSON list of strings")
    if len(keys) != num_documents:
        raise bad(f"keys holds {len(keys)} sample keys, the block has {num_documents} documents")
    return tuple(keys)


def _array(fd: int, path: str, header: fmt.TensorHeader, dtypes: tuple[str, ...], length: int | None,
           bad: Any, name: str) -> np.ndarray:
    if fmt.dtype_name(header.dtype) not in dtypes:
        raise bad(f"{name} has dtype {fmt.dtype_name(header.dtype)}, not {' or '.join(dtypes)}")
    if length is not None and header.length != length:
        raise bad(f"{name} holds {header.length} values, the block needs {length}")
    return fmt.read_tensor_data(fd, path, header)
