"""Keyed pseudo-random permutations of ``[0, n)`` computed per index in O(1) memory.

A sampler needs a fresh shuffle of ``n`` samples every epoch, where ``n`` may be
far too large to materialise (up to 2**63) and resuming at position ``p`` must
cost the same as starting at 0. So instead of shuffling an index array we
evaluate a bijection ``[0, n) -> [0, n)`` one index at a time:

* a keyed Feistel network on the ``k``-bit domain ``[0, 2**k)``, ``2**k >= n``,
  with halves of ``floor(k/2)`` and ``ceil(k/2)`` bits that swap widths each
  round (an alternating unbalanced Feistel), so the domain is ``< 2n``;
* round functions ``F_i(y) = fmix(y ^ K_i)`` using the splitmix64 finaliser, a
  strong 64-bit mixer (an affine round function would give a visibly
  structured "shuffle"), with round keys ``K_i`` derived from the 64-bit key;
* cycle walking: outputs ``>= n`` are fed through the network again until they
  land in ``[0, n)``; since the domain is ``< 2n`` this takes < 2 passes on
  average and yields a bijection on ``[0, n)``.

The network runs on Python ints (fast single-index calls) and on numpy ``uint64``
arrays (vectorised; multiplication wraps mod 2**64 silently): the array version
uses numpy scalar constants and in-place operations, and finishes the last few
cycle walks of a batch on Python ints (a numpy pass over a handful of values
costs as much as over thousands). Both give the same values.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable

import numpy as np

__all__ = ["PERMUTATION_ALGORITHM", "Permutation", "derive_key", "mix64", "permute"]

#: Recorded in saved training state; bump whenever any output could change.
PERMUTATION_ALGORITHM = "feistel-fmix64-v1"

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MAX_N = 1 << 63  # outputs must fit in int64
_MIN_ROUNDS = 6
_SCALAR_WALKS = 8  # cycle walks left in a vectorised call that are finished on Python ints
_MIX_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MIX_FACTORS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def mix64(z: Any) -> Any:
    """splitmix64 finaliser: a bijective 64-bit mixer with full avalanche.

    Works on Python ints < 2**64 and on numpy uint64 arrays alike.
    """
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _nonneg_int(value: Any, name: str) -> int:
    """``operator.index(value)``, rejecting bools and negatives with a named error."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = operator.index(value)
    if value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")
    return value


def derive_key(seed: int, purpose: str, epoch: int) -> int:
    """64-bit permutation key for ``(seed, purpose, epoch)``.

    BLAKE2b over a length-prefixed encoding, so distinct triples never share an
    encoding and unrelated purposes (e.g. "sample" vs "shard") get independent keys.
    """
    seed = _nonneg_int(seed, "seed")
    epoch = _nonneg_int(epoch, "epoch")
    if not isinstance(purpose, str):
        raise TypeError(f"purpose must be a str, got {type(purpose).__name__}")
    h = hashlib.blake2b(digest_size=8, person=b"torchcache-perm1")
    for field in (str(seed).encode(), purpose.encode("utf-8"), str(epoch).encode()):
        h.update(len(field).to_bytes(8, "little"))
        h.update(field)
    return int.from_bytes(h.digest(), "little")


class Permutation:
    """Keyed bijection of ``[0, n)``; ``perm(i)`` maps an index, ``perm.inverse(v)`` undoes it."""

    def __init__(self, n: int, key: int, rounds: int = 8) -> None:
        n = operator.index(n)
        if not 1 <= n <= _MAX_N:
            raise ValueError(f"n must be in [1, 2**63], got {n}")
        key = operator.index(key)
        if not 0 <= key <= _M64:
            raise ValueError(f"key must be in [0, 2**64), got {key}")
        rounds = operator.index(rounds)
        if rounds < _MIN_ROUNDS:
            raise ValueError(f"rounds must be >= {_MIN_ROUNDS}, got {rounds}")
        self.n = n
        self.key = key
        self.rounds = rounds
        bits = max(1, (n - 1).bit_length())  # smallest k with 2**k >= n (k >= 1)
        self._widths = (bits // 2, bits - bits // 2)  # (high half, low half)
        self._round_keys = [mix64((key + (i + 1) * _GOLDEN) & _M64) for i in range(rounds)]
        self._array_constants: tuple | None = None  # numpy scalars of _forward_array (made once)

    def __repr__(self) -> str:
        return f"Permutation(n={self.n}, key={self.key:#018x}, rounds={self.rounds})"

    def _forward(self, v: Any) -> Any:
        """One pass of the Feistel network on ``[0, 2**k)``: (L, R) -> (R, L ^ F(R))."""
        a, b = self._widths
        for rk in self._round_keys:
            left, right = v >> b, v & ((1 << b) - 1)
            v = (right << a) | (left ^ (mix64(right ^ rk) & ((1 << a) - 1)))
            a, b = b, a
        return v

    def _forward_array(self, v: np.ndarray) -> np.ndarray:
        """:meth:`_forward` on a uint64 array (consumed): the same values, fewer temporaries."""
        if self._array_constants is None:
            widths = {w: (np.uint64(w), np.uint64((1 << w) - 1)) for w in self._widths}
            self._array_constants = (widths, [np.uint64(rk) for rk in self._round_keys])
        widths, round_keys = self._array_constants
        (s30, s27, s31), (m1, m2) = _MIX_SHIFTS, _MIX_FACTORS
        a, b = self._widths
        for rk in round_keys:
            shift_b, mask_b = widths[b]
            shift_a, mask_a = widths[a]
            left = v >> shift_b
            v &= mask_b  # the right half
            z = v ^ rk  # mix64(right ^ rk), in place
            z ^= z >> s30
            z *= m1
            z ^= z >> s27
            z *= m2
            z ^= z >> s31
            z &= mask_a
            left ^= z
            v <<= shift_a
            v |= left
            a, b = b, a
        return v

    def _backward(self, v: Any) -> Any:
        """Exact inverse of :meth:`_forward`."""
        a, b = self._widths
        if self.rounds % 2:
            a, b = b, a
        for rk in reversed(self._round_keys):
            old_right, cur_right = v >> b, v & ((1 << b) - 1)
            v = ((cur_right ^ (mix64(old_right ^ rk) & ((1 << b) - 1))) << a) | old_right
            a, b = b, a
        return v

    def _apply(self, step: Callable[[Any], Any], index: Any, what: str,
               array_step: Callable[[np.ndarray], np.ndarray] | None = None) -> Any:
        """Validate ``index``, then cycle-walk ``step`` until every result is < n
        (``array_step``: the same step, faster on uint64 arrays)."""
        n = self.n
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            v = int(index)
            if not 0 <= v < n:
                raise IndexError(f"{what} {v} out of range for permutation of n={n}")
            v = step(v)
            while v >= n:
                v = step(v)
            return v

        arr = np.asarray(index)
        if arr.size == 0:
            return np.zeros(arr.shape, dtype=np.int64)
        if arr.dtype.kind == "i":
            if arr.min() < 0:
                raise IndexError(f"{what} {arr.min()} out of range for permutation of n={n}")
            arr = arr.astype(np.uint64)
        elif arr.dtype.kind == "u":
            arr = arr.astype(np.uint64)
        else:
            raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
        if arr.max() >= n:
            raise IndexError(f"{what} {arr.max()} out of range for permutation of n={n}")

        array_step = array_step or step
        out = array_step(arr.ravel())  # (arr is a copy: astype copies)
        todo = np.flatnonzero(out >= n)
        while todo.size > _SCALAR_WALKS:  # re-walk only the outputs that fell outside [0, n)
            walked = array_step(out[todo])
            out[todo] = walked
            todo = todo[walked >= n]
        for i in todo.tolist():
            v = step(int(out[i]))
            while v >= n:
                v = step(v)
            out[i] = v
        return out.astype(np.int64).reshape(arr.shape)

    def __call__(self, index: Any) -> int | np.ndarray:
        """Permuted position(s) of ``index``: int -> int, array-like -> int64 array, same shape."""
        return self._apply(self._forward, index, "index", self._forward_array)

    def inverse(self, value: Any) -> int | np.ndarray:
        """The index ``i`` with ``self(i) == value``; same shapes as :meth:`__call__`."""
        return self._apply(self._backward, value, "value")


def permute(n: int, seed: int, purpose: str, epoch: int, index: Any) -> int | np.ndarray:
    """Convenience: ``Permutation(n, derive_key(seed, purpose, epoch))(index)``."""
    return Permutation(n, derive_key(seed, purpose, epoch))(index)
