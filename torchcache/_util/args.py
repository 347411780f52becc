"""Argument checks shared by the public API: what a valid integer, flag, number or index is.

Each check fails at once, naming the argument: TypeError for a wrong type, ValueError for a wrong
value, IndexError for an index no dataset can have. So a bad argument is reported where it is
given, not deep inside numpy or torch later (a float index silently truncated, a bool taken as
0 or 1, a counter that overflows int64 a thousand steps on). No torch import: the builder uses it.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Collection
from typing import Any

import numpy as np

__all__ = ["INT64_MAX", "POSITION_LIMIT", "bool_arg", "choice_arg", "flag_arg", "index_array", "int_arg",
           "number_arg", "optional_int_arg", "position_arg", "unsigned_max"]

INT64_MAX = 2**63 - 1
#: Stream positions and counters stay below this, so int64 arithmetic on them (a position plus
#: a few chunks of world_size * rows, a mixture index plus a block) has room to spare.
POSITION_LIMIT = 2**62


def _is_bool(value: Any) -> bool:
    """True for Python and numpy bools and 0-d boolean tensors (anything with a bool dtype)."""
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and str(dtype) in ("bool", "torch.bool")


def _describe(value: Any) -> str:
    """``type value`` for an error message, the value's text cut short."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def int_arg(value: Any, name: str, minimum: int | None = 0, maximum: int | None = None) -> int:
    """``value`` as a Python int in ``[minimum, maximum]`` (bounds inclusive, None: unbounded).

    Integers of any kind pass (int, numpy integers, integer 0-d tensors: whatever
    ``operator.index`` takes); bools, floats and strings are refused, as they are not counts.
    """
    if type(value) is int:  # the usual argument: nothing to convert
        number = value
    elif _is_bool(value):
        raise TypeError(f"{name} must be an integer, not a bool ({value!r})")
    else:
        try:
            number = operator.index(value)
        except TypeError as error:
            raise TypeError(f"{name} must be an integer, got {_describe(value)}") from error
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {number}")
    return number


def optional_int_arg(value: Any, name: str, minimum: int | None = 0,
                     maximum: int | None = None) -> int | None:
    """None, or :func:`int_arg` of ``value``."""
    return None if value is None else int_arg(value, name, minimum, maximum)


def position_arg(value: Any, name: str) -> int:
    """A global stream position or sample counter: an int in ``[0, POSITION_LIMIT)``.

    2**62 samples is far beyond any run; a larger value is a corrupt or hand-edited state, and
    accepting it would only fail later, inside int64 arithmetic at the next batch.
    """
    position = int_arg(value, name, minimum=0)
    if position >= POSITION_LIMIT:
        raise ValueError(f"{name} must be < 2**62 (a stream position; no run gets near it), got "
                         f"{position}: the state is corrupt or was edited")
    return position


def bool_arg(value: Any, name: str) -> bool:
    """``value`` as a bool; only True and False (Python or numpy) pass, not 0, 1 or "no"."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_describe(value)}")
    return bool(value)


def flag_arg(value: Any, name: str) -> bool:
    """``value`` taken for its truth, as torch takes its flags (``shuffle=1``, ``pin_memory=0``),
    except a string: ``shuffle="no"`` would be true, so it is refused."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be True or False, got the string {value!r} (which would be "
                        "taken as true)")
    return bool(value)


def number_arg(value: Any, name: str, minimum: float | None = 0.0, *,
               positive: bool = False) -> float:
    """``value`` as a finite float >= ``minimum`` (> 0 too when ``positive``); no bools."""
    if _is_bool(value) or not isinstance(value, (numbers.Real, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {_describe(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if positive and number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return number


def choice_arg(value: Any, name: str, choices: Collection[str]) -> str:
    """``value`` if it is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
    return value


def index_array(indices: Any, name: str = "indices") -> np.ndarray:
    """``indices`` as an int64 array of the same shape, checked in one vectorised step.

    An integer array (or a list of ints, numpy or torch integers) costs one ``np.asarray`` and a
    dtype test. Anything else (floats, strings, bools, Python ints past int64) goes through
    :func:`int_arg` element by element, which names the first bad element: a TypeError for a
    non-integer, an IndexError for an integer no dataset can have (beyond int64). Range checks
    against a dataset's length are the caller's.
    """
    try:
        arr = indices if isinstance(indices, np.ndarray) else np.asarray(indices)
    except (ValueError, TypeError) as error:  # ragged nesting, objects numpy cannot hold
        raise TypeError(f"{name} must be integers, got {_describe(indices)}") from error
    kind = arr.dtype.kind
    if kind == "i":
        return arr.astype(np.int64, copy=False)
    if kind == "u" and (arr.size == 0 or int(arr.max()) <= INT64_MAX):
        return arr.astype(np.int64)
    return _index_objects(indices, arr.shape, name)


def unsigned_max(values: np.ndarray) -> int:
    """The largest of non-empty int64 ``values`` read as unsigned, so that a negative value
    counts as larger than any int64: a range check of an index array in one pass. (A batch's
    few indices go through a list: a numpy reduction costs more than the values then.)"""
    flat = values.reshape(-1).view(np.uint64)
    return max(flat.tolist()) if flat.size <= 64 else int(flat.max())


def _index_objects(indices: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    """The slow path of :func:`index_array`: each element checked on its own (errors, huge ints)."""
    items = np.asarray(indices, dtype=object).reshape(-1)
    values = [int_arg(x, f"{name}[{i}]", minimum=None)
              for i, x in enumerate(items.tolist())]
    for value in values:
        if not -INT64_MAX - 1 <= value <= INT64_MAX:
            raise IndexError(f"{name}: index {value} is out of range (beyond int64, larger than "
                             "any dataset)")
    return np.array(values, dtype=np.int64).reshape(shape)
