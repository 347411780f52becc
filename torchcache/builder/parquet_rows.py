"""Parquet rows read whole: a record batch -> one dict per row (column -> Python value, as
pyarrow's `to_pylist` makes it: list columns are lists, nested lists are lists of lists), and
the bytes that identify each row's content for the input's digest (builder/records.py).

A row is hashed cell by cell, in column order: the column's name, then the cell. A list column
whose leaf is a number or a bool (list, large_list or fixed_size_list, nested to any depth) is
hashed from its Arrow buffers: per level the cell's list lengths (and where the cell holds a
null there, that level's null flags), then the leaf values' bytes (nulls as 0, with their
flags). Every other cell is hashed as compact JSON of its Python value. Both depend only on the
row, never on how the file is cut into row groups or batches, and the buffers are hashed without
making a Python object per value (JSON of a large float list costs ~10x its `to_pylist`).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterator

import numpy as np

from .records import BadRecord


class BatchRows:
    """The rows of one record batch: `row(i)` (a dict, or a BadRecord naming the column pyarrow
    cannot make into a Python value: a string that is not UTF-8, a date out of Python's range)
    and `frames(i)` (the (tag, bytes) frames to hash, in order). A column's Python values are
    made once, on first need, so rows before a resume point cost only their hashing."""

    def __init__(self, pa: Any, batch: Any):
        self.pa, self.batch = pa, batch
        self.names = batch.schema.names
        self.encoded = [name.encode("utf-8", "surrogatepass") for name in self.names]
        self.buffers = [_list_buffers(pa, column) for column in batch.columns]
        self._values: dict[int, list[Any]] = {}

    def _column(self, k: int) -> list[Any]:
        values = self._values.get(k)
        if values is None:
            column = self.batch.column(k)
            try:
                values = column.to_pylist()
            except (ValueError, OverflowError, self.pa.ArrowException):  # find the cells, name them
                values = [self._cell(k, column, i) for i in range(len(column))]
            self._values[k] = values
        return values

    def _cell(self, k: int, column: Any, i: int) -> Any:
        try:
            return column[i].as_py()
        except (ValueError, OverflowError, self.pa.ArrowException) as e:
            reason = "invalid_utf8" if isinstance(e, UnicodeDecodeError) else "bad_content"
            bad = BadRecord(reason, f"column {self.names[k]!r} cannot be read as a Python value "
                                    f"({type(e).__name__}: {e})")
            bad.__cause__ = e
            return bad

    def row(self, i: int) -> dict[str, Any] | BadRecord:
        row = {}
        for k, name in enumerate(self.names):
            value = self._column(k)[i]
            if isinstance(value, BadRecord):
                return value
            row[name] = value
        return row

    def frames(self, i: int) -> Iterator[tuple[bytes, bytes]]:
        for k, (name, buffers) in enumerate(zip(self.encoded, self.buffers)):
            yield b"c", name
            if buffers is not None:
                yield from buffers(i)
                continue
            value = self._column(k)[i]
            if isinstance(value, BadRecord):
                yield b"x", value.detail.encode("utf-8", "surrogatepass")
            else:
                yield b"j", _json(value)


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                      default=_plain).encode("utf-8", "surrogatepass")


def _plain(value: Any) -> list[str]:
    """A value JSON has no form for (bytes, a date, a Decimal...), as its type and text."""
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    return [type(value).__name__, str(value)]


def _nulls(array: Any) -> np.ndarray | None:
    return array.is_null().to_numpy(zero_copy_only=False) if array.null_count else None


def _list_buffers(pa: Any, array: Any) -> Callable[[int], Iterator[tuple[bytes, bytes]]] | None:
    """For a list column with a numeric (or bool) leaf: i -> the frames of cell i, read from
    the Arrow buffers; None for any other column."""
    types = pa.types
    levels: list[tuple[np.ndarray, np.ndarray | None]] = []
    while True:
        kind = array.type
        if types.is_list(kind) or types.is_large_list(kind):
            offsets = array.offsets.to_numpy().astype(np.int64, copy=False)
        elif types.is_fixed_size_list(kind):
            size = kind.list_size
            offsets = (np.arange(len(array) + 1, dtype=np.int64) + array.offset) * size
        else:
            break
        levels.append((offsets, _nulls(array)))
        array = array.values  # the whole child: the offsets above index into it
    leaf = array.type
    if not levels or not (types.is_integer(leaf) or types.is_floating(leaf) or types.is_boolean(leaf)):
        return None
    leaf_nulls = _nulls(array)
    values = _leaf_values(pa, array, leaf_nulls)

    def frames(i: int) -> Iterator[tuple[bytes, bytes]]:
        start, end = i, i + 1
        for offsets, nulls in levels:
            if nulls is not None and nulls[start:end].any():
                yield b"n", nulls[start:end].tobytes()
            bounds = offsets[start:end + 1]
            yield b"l", np.diff(bounds).tobytes()
            start, end = int(bounds[0]), int(bounds[-1])
        if leaf_nulls is not None and leaf_nulls[start:end].any():
            yield b"n", leaf_nulls[start:end].tobytes()
        yield b"v", values[start:end].tobytes()
    return frames


def _leaf_values(pa: Any, array: Any, nulls: np.ndarray | None) -> np.ndarray:
    """The leaf's values as numpy (zero-copy when it has no nulls and is not bool), nulls as 0."""
    if pa.types.is_boolean(array.type):  # bit-packed in Arrow: one byte per value here
        return array.fill_null(False).to_numpy(zero_copy_only=False)
    if nulls is None:
        return array.to_numpy()
    dtype = np.dtype(array.type.to_pandas_dtype())
    values = np.frombuffer(array.buffers()[1], dtype=dtype)[array.offset:array.offset + len(array)].copy()
    values[nulls] = 0  # what a null slot's buffer holds is unspecified
    return values
