"""A block's arrays sidecar: the typed arrays each document carries beside its tokens (see
docs/format.md, "Arrays sidecar").

`blocks/IIIIII-KKKKKK.arrays.safetensors` holds, per array field F (a plain safetensors file):
  F          the field's values of every document of the block, flattened, in document order
  F.offsets  I64, one per document + 1: where each document's values start in F (in values)
  F.shapes   I64 [n, rank], each document's shape; only for a field of rank > 1 (rank 1: the
             shape is the offsets' difference)
Its sha256 is in the block's documents sidecar (tensor `arrays_sha256`), whose own checksum is
in the index, so verify and repair cover it.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import CacheFormatError
from . import blocks as fmt
from .storage import LocalStorage, Storage

ARRAY_DTYPES = {"BOOL": np.dtype("bool"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
                "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"),
                "I32": np.dtype("<i4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
                "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8")}
_NAMES = {v: k for k, v in ARRAY_DTYPES.items()}
_DECLARATION = re.compile(r"^\s*([a-z]+[0-9]*)\s*(?:\[([^\]]*)\])?\s*$")
_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


def arrays_name(block_path: str) -> str:
    """The arrays sidecar's path: the block's stem + `.arrays.safetensors`."""
    return block_path[: -len(".safetensors")] + ".arrays.safetensors"


@dataclass(frozen=True)
class ArrayDeclaration:
    """A field's declared dtype and shape (None: fixed by the first record; a None dim: any);
    `per_token`: one row per token of the document (first dimension = its token count)."""

    dtype: str | None = None
    shape: tuple[int | None, ...] | None = None
    per_token: bool = False

    def to_spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"dtype": self.dtype, "shape": None if self.shape is None else list(self.shape)}
        if self.per_token:  # (absent otherwise: caches with document arrays keep their bytes)
            spec["per_token"] = True
        return spec


def parse_declarations(arrays: Any, per_token: bool = False) -> dict[str, ArrayDeclaration]:
    """`arrays=` of build_cache: a sequence of field names, or a map name -> "dtype[d, ...]"
    ("float16[*, 80]"; "*" any size; "float32" alone: any rank) or None (first record's).

    With `per_token` (`token_arrays=`): the first dimension is the document's token count, the
    others are fixed ("float32[*, 8]"); a name alone or a dtype alone is rank 1."""
    argument = "token_arrays" if per_token else "arrays"
    if isinstance(arrays, str):
        raise TypeError(f"{argument} must be a list of field names or a dict of declarations, not "
                        f"the string {arrays!r} (write {argument}=({arrays!r},))")
    items = arrays.items() if isinstance(arrays, dict) else [(name, None) for name in arrays]
    out: dict[str, ArrayDeclaration] = {}
    for name, declared in items:
        if not isinstance(name, str) or not _FIELD_NAME.match(name) or name.endswith((".offsets", ".shapes")):
            raise ValueError(f"{argument}: field name {name!r} must be letters, digits, _ or -")
        one = ArrayDeclaration() if declared is None else _parse_one(name, declared, argument)
        out[name] = _per_token(name, declared, one) if per_token else one
    return dict(sorted(out.items()))


def _per_token(name: str, declared: Any, one: ArrayDeclaration) -> ArrayDeclaration:
    """A token array's declaration: rank 1 unless its shape says more, whose first dimension
    is '*' and whose other dimensions are sizes (rows of one shape, sliced like input_ids)."""
    shape = one.shape if one.shape is not None else (None,)
    if shape[0] is not None or any(d is None for d in shape[1:]):
        raise ValueError(f"token_arrays[{name!r}] = {declared!r}: the first dimension is the "
                         f"document's token count ('*') and the others are sizes, e.g. "
                         f"'float32[*]' or 'float16[*, 8]'")
    return ArrayDeclaration(one.dtype, shape, per_token=True)


def merged_declarations(arrays: Any, token_arrays: Any) -> dict[str, ArrayDeclaration]:
    """The fields of `arrays=` and `token_arrays=` together (a name in both is refused)."""
    documents = parse_declarations(arrays or ())
    tokens = parse_declarations(token_arrays or (), per_token=True)
    both = sorted(set(documents) & set(tokens))
    if both:
        raise ValueError(f"field {both[0]!r} is in both arrays and token_arrays; name it in one "
                         "(token_arrays: one row per token, sliced with the tokens)")
    return dict(sorted((documents | tokens).items()))


def _parse_one(name: str, declared: Any, argument: str) -> ArrayDeclaration:
    match = _DECLARATION.match(declared) if isinstance(declared, str) else None
    dtype = None
    if match:
        try:
            dtype = np.dtype(match.group(1))
        except TypeError:
            match = None
    if not match or dtype.newbyteorder("<") not in _NAMES and dtype not in _NAMES:
        raise ValueError(f"{argument}[{name!r}] = {declared!r}: write a numpy dtype and optional shape, "
                         f"e.g. 'float16[*, 80]' (dtypes: bool, uint8..uint64, int8..int64, "
                         "float16, float32, float64)")
    shape = None
    if match.group(2) is not None:
        dims = [d.strip() for d in match.group(2).split(",")]
        if not all(d == "*" or d.isdigit() for d in dims) or not dims or dims == [""]:
            raise ValueError(f"{argument}[{name!r}] = {declared!r}: each dimension is a size or '*'")
        shape = tuple(None if d == "*" else int(d) for d in dims)
    return ArrayDeclaration(str(dtype), shape)


def declarations_from_spec(spec: dict[str, Any] | None) -> dict[str, ArrayDeclaration]:
    """The declarations a spec's documents entry records ({} for a cache without arrays)."""
    arrays = (spec or {}).get("arrays") or {}
    return {name: ArrayDeclaration(d["dtype"], None if d["shape"] is None else tuple(d["shape"]),
                                   bool(d.get("per_token", False)))
            for name, d in arrays.items()}


def write_arrays_file(storage: Storage, rel_path: str, fields: dict[str, Sequence[np.ndarray]]) -> fmt.WrittenFile:
    """Write a block's arrays sidecar (whole or not at all): per field, its documents' arrays
    (one dtype and rank per field)."""
    # each tensor as its pieces (a field: its documents' arrays), written one after the other:
    # no concatenated copy of a field's values is made
    tensors: dict[str, tuple[str, list[int], Sequence[np.ndarray]]] = {}
    for name, arrays in fields.items():
        rank = arrays[0].ndim if arrays else 1
        offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        dtype = arrays[0].dtype if arrays else np.dtype("f4")
        tensors[name] = (_NAMES[dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype],
                         [int(offsets[-1])], arrays)
        tensors[name + ".offsets"] = ("I64", [len(offsets)], [offsets])
        if rank > 1:
            shapes = np.asarray([a.shape for a in arrays], dtype=np.int64).reshape(len(arrays), rank)
            tensors[name + ".shapes"] = ("I64", [len(arrays), rank], [shapes])
    header: dict[str, Any] = {"__metadata__": {"format": fmt.FORMAT_NAME, "kind": "arrays"}}
    end, parts = 0, []
    for name in sorted(tensors):
        dtype_name, shape, pieces = tensors[name]
        little = ARRAY_DTYPES[dtype_name]
        start = end
        for piece in pieces:  # (one dtype per field: a piece is cast only where it is big-endian)
            piece = np.ascontiguousarray(piece).astype(little, copy=False)
            if piece.nbytes:
                parts.append(memoryview(piece).cast("B"))
                end += int(piece.nbytes)
        header[name] = {"dtype": dtype_name, "shape": shape, "data_offsets": [start, end]}
    raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    size, checksum = storage.write(rel_path, [struct.pack("<Q", len(raw)) + raw] + parts)
    return fmt.WrittenFile(rel_path, size, checksum)


@dataclass(frozen=True)
class _Field:
    data: np.ndarray
    offsets: np.ndarray
    shapes: np.ndarray | None


class BlockArrays:
    """One block's arrays sidecar, checked, its values a read-only view of a memory map."""

    def __init__(self, fields: dict[str, _Field], path: str):
        self._fields, self.path = fields, path
        self._token_rows: dict[str, np.ndarray] = {}  # per-token fields, checked once

    def document(self, d: int) -> dict[str, np.ndarray]:
        """The block's document d: field name -> its array, in its own shape."""
        out = {}
        for name, f in self._fields.items():
            flat = f.data[int(f.offsets[d]): int(f.offsets[d + 1])]
            out[name] = flat if f.shapes is None else flat.reshape(tuple(int(x) for x in f.shapes[d]))
        return out

    def pieces(self, name: str, local: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.dtype]:
        """Field ``name`` of the block's documents ``local`` (int64 array): their values (flat
        read-only views, one per document), their shapes (int64 [n, rank]) and the dtype; what
        a gather of a batch's arrays copies from (a few vectorised lookups, no per-document
        dict)."""
        f = self._fields[name]
        starts, stops = f.offsets[local], f.offsets[local + 1]
        shapes = (stops - starts).reshape(-1, 1) if f.shapes is None else f.shapes[local]
        data = f.data
        return [data[a:b] for a, b in zip(starts.tolist(), stops.tolist())], shapes, data.dtype

    def token_rows(self, name: str, num_tokens: int, trailing: tuple[int, ...]) -> np.ndarray:
        """A per-token field's values as (num_tokens, *trailing): row t belongs to the block's
        token t, as the documents lie back to back (CacheFormatError if they do not)."""
        if name in self._token_rows:
            return self._token_rows[name]
        f = self._fields[name]
        inner = int(np.prod(trailing, dtype=np.int64))
        if f.data.size != num_tokens * inner or (f.shapes is not None and (
                f.shapes.shape[1] != 1 + len(trailing) or np.any(f.shapes[:, 1:] != trailing))):
            raise CacheFormatError(f"{self.path}: per-token field {name!r} does not hold one "
                                   f"{list(trailing)} row per token of the block's {num_tokens} "
                                   "tokens; the arrays sidecar is corrupted (run `torchcache "
                                   "verify --repair`)")
        rows = self._token_rows[name] = f.data.reshape((num_tokens,) + tuple(trailing))
        return rows


def read_arrays_file(fd: int, path: str, num_documents: int, names: Sequence[str]) -> BlockArrays:
    """A block's arrays sidecar, mapped and checked against the block (its documents) and the
    spec (its field names); errors name the file."""
    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{path}: {what}; the arrays sidecar is corrupted or truncated "
                                "(run `torchcache verify --repair`)")

    size = os.fstat(fd).st_size
    if size < 8:
        raise bad("no header")
    mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    (header_len,) = struct.unpack("<Q", mapping[:8])
    if header_len > fmt.MAX_HEADER_BYTES or 8 + header_len > size:
        raise bad(f"header length {header_len}")
    try:
        header = json.loads(bytes(mapping[8: 8 + header_len]))
    except (ValueError, RecursionError) as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a map")
    header.pop("__metadata__", None)
    wanted = {n for name in names for n in (name, name + ".offsets")}
    if not wanted <= set(header) or not set(header) <= wanted | {n + ".shapes" for n in names}:
        raise bad(f"holds tensors {sorted(header)}, the cache's fields are {sorted(names)}")
    views, end = {}, 0
    for name in sorted(header):
        entry = header[name]
        try:
            dtype = ARRAY_DTYPES[entry["dtype"]]
            shape = [int(x) for x in entry["shape"]]
            start, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {name!r} is not a safetensors tensor entry") from None
        if start != end or stop - start != int(np.prod(shape)) * dtype.itemsize:
            raise bad(f"tensor {name!r} does not lie where its shape says")
        end = stop
        views[name] = (dtype, shape, 8 + header_len + start)
    if 8 + header_len + end != size:
        raise bad(f"file is {size} bytes, its header says {8 + header_len + end}")
    buffer = memoryview(mapping)

    def tensor(name: str) -> np.ndarray:
        dtype, shape, at = views[name]
        array = np.frombuffer(buffer, dtype=dtype, count=int(np.prod(shape)), offset=at).reshape(shape)
        array.flags.writeable = False
        return array

    fields = {}
    for name in names:
        data, offsets = tensor(name), tensor(name + ".offsets")
        if offsets.dtype != np.int64 or offsets.shape != (num_documents + 1,) or offsets[0] != 0 \
                or offsets[-1] != data.size or np.any(np.diff(offsets) < 0):
            raise bad(f"{name}.offsets do not cover {name} for the block's {num_documents} documents")
        shapes = tensor(name + ".shapes") if name + ".shapes" in views else None
        if shapes is not None and (shapes.dtype != np.int64 or shapes.ndim != 2
                                   or shapes.shape[0] != num_documents or np.any(shapes < 0)
                                   or np.any(shapes.prod(axis=1) != np.diff(offsets))):
            raise bad(f"{name}.shapes disagree with {name}.offsets")
        fields[name] = _Field(data, offsets, shapes)
    return BlockArrays(fields, path)


def read_layout(storage: Storage, rel_path: str) -> dict[str, tuple[str, int]]:
    """Each field's (numpy dtype name, rank) in a block's arrays sidecar, from its header alone
    (two small reads, however large the arrays)."""
    def prefix(n: int) -> bytes:
        if isinstance(storage, LocalStorage):
            with open(os.path.join(storage.root, rel_path), "rb") as f:
                return f.read(n)
        return storage.read_range(rel_path, 0, n)

    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{rel_path}: {what}; the arrays sidecar is corrupted or truncated")

    start = prefix(8)
    if len(start) < 8:
        raise bad("no header")
    (header_len,) = struct.unpack("<Q", start)
    if header_len > fmt.MAX_HEADER_BYTES:
        raise bad(f"header length {header_len}")
    try:
        header = json.loads(prefix(8 + header_len)[8:])
        return {name: (str(ARRAY_DTYPES[entry["dtype"]]), int(header[name + ".shapes"]["shape"][1])
                       if name + ".shapes" in header else 1)
                for name, entry in header.items() if name != "__metadata__" and "." not in name}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise bad(f"header is not a safetensors header ({e!r})") from None
