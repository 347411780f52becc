"""A record's array fields -> typed numpy arrays, one dtype and rank per field (`arrays=`).

A declared dtype casts each value with numpy's "same_kind" rule (integers to any integer type),
refusing values it cannot hold
(an integer out of range, a finite float that would overflow); an undeclared field takes the
dtype, rank and trailing dims of its first record (in each input) and casts later ones the same
way (the commit step then refuses a block whose dtype or rank differs from the cache's first
block: builder/commit.py). Nested lists must be rectangular; an empty list takes the field's rank, 0 first. A value
that does not convert is a BadRecord "bad_array" naming the field.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.arrays import ARRAY_DTYPES, ArrayDeclaration
from .records import BadRecord

_KINDS = "biuf"
_ALLOWED = set(ARRAY_DTYPES.values())


class ArrayConverter:
    """Converts the declared fields of each record; remembers undeclared fields' first forms."""

    def __init__(self, declarations: dict[str, ArrayDeclaration]):
        self.declarations = declarations
        self._first: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}

    def __call__(self, obj: Any) -> dict[str, np.ndarray]:
        if not isinstance(obj, dict):
            raise BadRecord("bad_array", f"the record is a {type(obj).__name__}, not an object")
        return {name: self._field(name, obj) for name in self.declarations}

    def _field(self, name: str, obj: dict) -> np.ndarray:
        def bad(what: str) -> BadRecord:
            return BadRecord("bad_array", f"array field {name!r}: {what}")

        if name not in obj:
            raise bad(f"missing from the record (found {sorted(obj)[:8]})")
        array = _as_array(obj[name], bad)
        declared = self.declarations[name]
        first = self._first.get(name)
        dtype = np.dtype(declared.dtype) if declared.dtype else (first[0] if first else None)
        shape = declared.shape if declared.shape is not None else \
            (first[1] if first else None)
        if array.size == 0 and shape is not None and array.ndim != len(shape):
            array = array.reshape((0,) + tuple(0 if d is None else d for d in shape[1:]))
        if array.ndim == 0:
            raise bad("is a scalar; give a list (rank 1 or more)")
        if shape is not None:
            if array.ndim != len(shape):
                raise bad(f"has rank {array.ndim} (shape {list(array.shape)}), the field's is "
                          f"{len(shape)}")
            if declared.shape is not None:
                for k, (got, want) in enumerate(zip(array.shape, shape)):
                    if want is not None and got != want:
                        raise bad(f"has shape {list(array.shape)}; dimension {k} must be {want} "
                                  f"(declared {declared.dtype}{list(declared.shape)})")
        if dtype is not None:
            array = _cast(array, dtype, bad)
        elif array.dtype.newbyteorder("<") not in _ALLOWED and array.dtype not in _ALLOWED:
            raise bad(f"has dtype {array.dtype}; use bool, (u)int8..64 or float16/32/64")
        if first is None:
            self._first[name] = (array.dtype, (None,) + array.shape[1:])
        return array  # in any memory layout: the block's writer copies it into C order


def _as_array(value: Any, bad: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (list, tuple)):
        try:
            array = np.array(value)
        except ValueError as e:  # ragged nested lists
            raise bad(f"is not rectangular ({e})") from None
    else:
        raise bad(f"is a {type(value).__name__}, not a list, numpy array or tensor")
    if array.dtype.kind not in _KINDS:
        raise bad(f"holds {array.dtype} values, not numbers (nested lists must be rectangular "
                  "and numeric)")
    return array


def _cast(array: np.ndarray, dtype: np.dtype, bad: Any) -> np.ndarray:
    if array.dtype == dtype:
        return array
    if array.size == 0:
        return array.astype(dtype)
    integers = dtype.kind in "iu" and array.dtype.kind in "iu"  # signed <-> unsigned: by range
    if not integers and not np.can_cast(array.dtype, dtype, "same_kind"):
        raise bad(f"holds {array.dtype} values, which {dtype} cannot hold (declare the field's "
                  "dtype, or convert in a map step)")
    if integers:
        info = np.iinfo(dtype)
        low, high = array.min(), array.max()
        if low < info.min or high > info.max:
            raise bad(f"holds values in [{low}, {high}], outside {dtype}'s range")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is found below and refused
        out = array.astype(dtype)
    if dtype.kind == "f" and array.dtype.kind in "iuf" and not np.all(np.isfinite(out) | ~np.isfinite(array)):
        raise bad(f"holds values too large for {dtype}")
    return out


def check_token_rows(arrays: dict[str, np.ndarray], names: tuple[str, ...], num_ids: int) -> None:
    """BadRecord "bad_array" unless each per-token field has one row per input id."""
    for name in names:
        rows = len(arrays[name])
        if rows != num_ids:
            raise BadRecord("bad_array", f"per-token array field {name!r} has {rows} rows, the "
                                         f"record has {num_ids} input_ids (token_arrays need one "
                                         "row per input id)")


def pad_token_rows(array: np.ndarray, before: int, after: int) -> np.ndarray:
    """A per-token field with zero rows for the `before` ids prepended (BOS) and the `after`
    ids appended (EOS) to its document."""
    if not before and not after:
        return array
    out = np.zeros((before + len(array) + after,) + array.shape[1:], dtype=array.dtype)
    out[before: before + len(array)] = array
    return out
