"""The mixture schedule: which source, and which of its samples, each mixture index reads.

A pure, immutable function of ``(stages, seed, block_size, the sources' lengths)``; it never
touches the sources themselves (:class:`torchcache.MixtureDataset` reads them). The mixture is
one endless, already shuffled stream of samples. Index ``i`` is mapped in O(1) time and memory
(no per-sample index arrays, nothing that grows with ``i``):

1. **How many of each source.** Weights become exact fractions, normalised per stage to
   proportions ``p`` summing to 1. ``H(m)`` is the largest-remainder apportionment of ``m`` seats:
   ``floor(m * p_k)`` each, then one more for the sources with the largest remainders ``m * p_k -
   floor(m * p_k)``, ties going to the source that comes first in the ``datasets`` dict. So every
   ``H_k(m)`` is ``floor`` or ``ceil`` of ``m * p_k`` and they sum to ``m``. Samples come in blocks
   of ``B = block_size``; the running count of source ``k`` after block ``b`` is

       T_k(b) = T_k(b_s) + H_k^(s)((b - b_s) * B),

   where stage ``s`` (the one holding block ``b``) starts at block ``b_s``, and ``T_k(b_s)`` comes
   from the previous stage the same way (``T(0) = 0``). Block ``b`` holds ``c_k(b) = T_k(b + 1) -
   T_k(b)`` samples of source ``k``: they sum to ``B``, and there is no drift (inside a stage, after
   any whole number of blocks, each source has floor or ceil of its exact share of the samples
   since the stage started; stages carry the totals on).
2. **Order inside a block.** Slot ``j`` of block ``b`` goes to ``t = perm_b(j)`` (a keyed
   permutation of ``[0, B)``, one per block); the sources' samples are laid out in dict order, so
   ``t`` falls in source ``k``'s run ``[P_k, P_k + c_k(b))`` and is its ``r = t - P_k``-th sample in
   the block: the source-local position ``L = T_k(b) + r``.
3. **Reading the source.** Source ``k`` of length ``n_k`` is read as its own endless stream:
   epoch ``e = L // n_k`` is a keyed permutation of ``[0, n_k)``, a different one per epoch, so a
   source that runs out starts a new, differently shuffled pass over all its samples.

All permutations are :class:`torchcache.order.permutation.Permutation` with keys from
``derive_key(seed, purpose, epoch)`` (purposes ``"mix-block"`` and ``"mix-source:<name>"``).
"""

from __future__ import annotations

import bisect
import decimal
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from .._util.args import INT64_MAX, POSITION_LIMIT, index_array, int_arg
from .._util.lru import LRUCache
from .permutation import PERMUTATION_ALGORITHM, Permutation, derive_key

__all__ = ["MIXTURE_ALGORITHM", "MixtureSchedule", "group_by", "prefix_difference"]

#: Part of :attr:`MixtureDataset.fingerprint`; bump whenever any mixture index could map elsewhere.
MIXTURE_ALGORITHM = "mixture-largest-remainder-v1"

_BLOCK_CACHE = 64  # per-block (totals, layout, permutation) entries kept
_PERM_CACHE = 64  # per-(source, epoch) permutations kept
_TABLE_CACHE = 4  # whole-block tables (source and local index of every slot) kept
_TABLE_MAX = 1 << 16  # blocks larger than this are never tabled (B * 9 bytes a table)
_RUN = 1 << 13  # a source's epoch is permuted in runs of this many positions (64 KB each) ...
_RUN_CACHE = 16  # ... and this many runs are kept (1 MB)


def _fraction(value: Any, what: str) -> Fraction:
    """``value`` as an exact Fraction (a float as written), rejecting bools, NaN, inf and < 0."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    if isinstance(value, np.integer):
        value = int(value)
    elif isinstance(value, np.floating):
        value = float(value)
    if not isinstance(value, (numbers.Real, decimal.Decimal)):
        raise TypeError(f"{what} must be a number, got {value!r}")
    try:
        # a float is taken as its shortest decimal form, i.e. as written: 0.7 is exactly 7/10
        frac = Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        raise ValueError(f"{what} must be a finite number, got {value!r}") from None
    if frac < 0:
        raise ValueError(f"{what} must be >= 0, got {value!r}")
    return frac


def _ceil_text(x: Fraction, digits: int = 6) -> str:
    """``x`` rounded *up* to ``digits`` significant digits, as text (a lower bound stays one)."""
    if x <= 0:
        return "0"
    exp = math.floor(math.log10(x)) - digits + 1
    up = math.ceil(x / Fraction(10) ** exp) * Fraction(10) ** exp
    return format(decimal.Decimal(up.numerator) / decimal.Decimal(up.denominator), "g")


def _apportion(a: tuple[int, ...], denom: int, m: int) -> list[int]:
    """Largest-remainder apportionment of ``m`` seats for proportions ``a[k] / denom``.

    Exact integers; ties in the remainder go to the lower index (the source listed first).
    Each result is floor or ceil of ``m * a[k] / denom``: the leftover seats number
    ``sum(remainders) / denom``, fewer than the sources with a non-zero remainder, so a source
    with a zero remainder (an exact share, or weight 0) never gets an extra seat.
    """
    quotas = [m * x for x in a]
    seats = [q // denom for q in quotas]
    left = m - sum(seats)
    if left:
        order = sorted(range(len(a)), key=lambda k: (-(quotas[k] % denom), k))
        for k in order[:left]:
            seats[k] += 1
    return seats


_SCALAR_MAX = 24  # below this many indices a Permutation is faster on Python ints than on numpy


def _permute(perm: Permutation, values: np.ndarray) -> np.ndarray:
    """``perm(values)`` for a 1-D int64 array; small ones on Python ints (numpy's per-call
    overhead over the Feistel rounds dominates for a handful of indices)."""
    if values.size > _SCALAR_MAX:
        return perm(values)
    return np.fromiter((perm(v) for v in values.tolist()), dtype=np.int64, count=values.size)


def group_by(keys: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(key, positions)`` for each distinct value of the 1-D int array ``keys`` (ascending keys).

    >>> [(k, p.tolist()) for k, p in group_by(np.array([1, 0, 1]))]
    [(0, [1]), (1, [0, 2])]
    """
    if keys.size == 0:
        return
    first = keys[0]
    if (keys == first).all():
        yield int(first), np.arange(keys.size)
        return
    low, high = int(keys.min()), int(keys.max())
    if high - low < 8:  # a few keys close together (a batch's sources): one mask each
        for key in range(low, high + 1):
            where = np.flatnonzero(keys == key)
            if where.size:
                yield key, where
        return
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    cuts = [0, *(np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1).tolist(), keys.size]
    for start, stop in zip(cuts, cuts[1:]):
        yield int(sorted_keys[start]), order[start:stop]



class _Stage:
    """One stage of the schedule: proportions ``a[k] / denom`` from block ``block`` on."""

    __slots__ = ("start", "block", "a", "denom", "weights")

    def __init__(self, start: int, block: int, weights: tuple[Fraction, ...]) -> None:
        total = sum(weights)
        props = [w / total for w in weights]
        self.denom = math.lcm(*(p.denominator for p in props))
        self.a = tuple(p.numerator * (self.denom // p.denominator) for p in props)
        self.start, self.block, self.weights = start, block, weights

    @property
    def proportions(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(x, self.denom) for x in self.a)



class MixtureSchedule:
    """Which source, and which of its samples, every mixture index reads: exact, O(1), immutable.

    The schedule alone, without the sources (only their lengths): what
    :class:`torchcache.MixtureDataset` indexes with, and what you can inspect or check before
    training (``source_counts`` over any range costs the same, however far out).

    Args:
        lengths: dict name -> number of samples of each source. Its order is the tie-break order
            of the apportionment and the layout order inside a block.
        weights: dict name -> non-negative number, one entry per source (0 excludes a source);
            only the ratios matter, computed exactly (a float as written: ``0.7`` is 7/10).
            Default (neither ``weights`` nor ``schedule``): proportional to ``lengths``.
        schedule: instead of ``weights``: a list of ``(start_sample, weights)`` stages, the first
            at 0, starts increasing and each a multiple of ``block_size``.
        seed: keys the block order and the sources' per-epoch permutations.
        block_size: ``B``; every block of ``B`` consecutive indices holds each source's exact
            largest-remainder share.

    See :class:`torchcache.MixtureDataset` for the meaning of each argument in full; it builds
    its schedule from the same arguments.

    >>> schedule = tc.MixtureSchedule({"web": 1000, "code": 50}, {"web": 0.9, "code": 0.1},
    ...                               block_size=10)
    >>> schedule.source_counts(0, 100)
    {'web': 90, 'code': 10}
    >>> source, local = schedule.locate([0, 1, 2])  # source ids index schedule.names
    """

    def __init__(
        self,
        lengths: Mapping[str, int],
        weights: Mapping[str, Any] | None = None,
        *,
        schedule: Iterable[tuple[int, Mapping[str, Any]]] | None = None,
        seed: int = 0,
        block_size: int = 1024,
    ) -> None:
        if not isinstance(lengths, Mapping):
            raise TypeError(f"lengths must be a dict name -> number of samples, got "
                            f"{type(lengths).__name__}")
        if not lengths:
            raise ValueError("lengths is empty: a mixture needs at least one source")
        for name in lengths:
            if not isinstance(name, str):
                raise TypeError(f"source names must be str, got {name!r}")
        self.names: tuple[str, ...] = tuple(lengths)
        self.lengths: tuple[int, ...] = tuple(int_arg(n, f"lengths[{name!r}]", 0)
                                              for name, n in lengths.items())
        self.seed = int_arg(seed, "seed", 0)
        self.block_size = int_arg(block_size, "block_size", 1, POSITION_LIMIT)
        if weights is not None and schedule is not None:
            raise ValueError("pass weights or schedule, not both (a constant mixture is a "
                             "schedule with one stage: schedule=[(0, weights)])")
        if schedule is None:
            if weights is None:
                weights = dict(zip(self.names, self.lengths))
            stages_in = [(0, weights)]
        else:
            if isinstance(schedule, (Mapping, str, bytes)) or not isinstance(schedule, Iterable):
                raise TypeError(f"schedule must be a list of (start_sample, weights) pairs, got "
                                f"{type(schedule).__name__}")
            stages_in = list(schedule)
            if not stages_in:
                raise ValueError("schedule is empty: give at least one (0, weights) stage")
        self._is_schedule = schedule is not None
        self._stages = self._parse_stages(stages_in)
        self._stage_blocks = [st.block for st in self._stages]
        # per-source totals T(b_s) at each stage start, carried from the previous stage
        totals = [(0,) * len(self.names)]
        for prev, st in zip(self._stages, self._stages[1:]):
            seats = _apportion(prev.a, prev.denom, (st.block - prev.block) * self.block_size)
            totals.append(tuple(t + c for t, c in zip(totals[-1], seats)))
        self._stage_totals = totals
        # small caches of immutable entries; a batch touches one or two blocks
        self._blocks: LRUCache[tuple[np.ndarray, np.ndarray, Permutation]] = LRUCache(_BLOCK_CACHE)
        self._perms: LRUCache[Permutation] = LRUCache(_PERM_CACHE)
        # blocks read densely (a loader reads the mixture in order) are mapped whole, once
        self._tables: LRUCache[tuple[np.ndarray, np.ndarray]] = LRUCache(_TABLE_CACHE)
        self._touched: LRUCache[bool] = LRUCache(_BLOCK_CACHE)
        # runs of each source's permuted epoch: consecutive blocks take consecutive positions of
        # a source, so one vectorised pass over a run serves the next several blocks
        self._runs: LRUCache[np.ndarray] = LRUCache(_RUN_CACHE)

    # -- construction ---------------------------------------------------------------------------

    def _parse_stages(self, stages_in: list[Any]) -> list[_Stage]:
        B = self.block_size
        named: set[str] = set()
        empty = [n for n, length in zip(self.names, self.lengths) if length == 0]
        stages: list[_Stage] = []
        for s, item in enumerate(stages_in):
            try:
                start, weights = item
            except (TypeError, ValueError):
                raise TypeError(f"schedule stage {s} must be a (start_sample, weights) pair, "
                                f"got {item!r}") from None
            start = int_arg(start, f"schedule stage {s} start", 0, POSITION_LIMIT)
            if s == 0 and start != 0:
                raise ValueError(f"the first schedule stage must start at sample 0, not {start}")
            if stages and start <= stages[-1].start:
                raise ValueError(f"schedule stage starts must increase: stage {s} starts at "
                                 f"{start}, stage {s - 1} at {stages[-1].start}")
            if start % B:
                lo, hi = start // B * B, (start // B + 1) * B
                raise ValueError(
                    f"schedule stage {s} starts at sample {start}, which is not a multiple of "
                    f"block_size={B} (stages start on block boundaries): move it to {lo} or {hi}, "
                    f"or use a block_size that divides every stage start")
            stages.append(_Stage(start, start // B, self._parse_weights(weights, s)))
            named.update(weights)
        unnamed = [n for n in self.names if n not in named]
        if unnamed:
            if not self._is_schedule:
                raise ValueError(f"weights have no entry for source(s) {unnamed}: give every "
                                 "source a weight (0 excludes it), or leave it out of the sources")
            raise ValueError(f"source(s) {unnamed} are named in no stage of the schedule: give "
                             "each a weight in some stage (a stage that does not name a source "
                             "gives it weight 0), or leave it out of the sources")
        if empty:
            raise ValueError(f"source {empty[0]!r} is empty (it has no samples): leave it out of "
                             "the sources, or build it from data")
        # every active source must get B * p >= 1, i.e. at least one sample per block on average
        needs = [math.ceil(st.denom / x) for st in stages for x in st.a if x]
        for s, st in enumerate(stages):
            for k, x in enumerate(st.a):
                if x == 0:
                    continue
                if B * x < st.denom:
                    raise ValueError(self._too_small(s, st, k, max(needs), len(stages) > 1))
        return stages

    def _too_small(self, s: int, st: _Stage, k: int, works: int, staged: bool) -> str:
        """The error for source ``k`` getting less than one sample per block in stage ``s``."""
        B = self.block_size
        p = Fraction(st.a[k], st.denom)
        others = sum(st.weights) - st.weights[k]
        text = (f"weight {self._weight_text(st.weights[k])} of source {self.names[k]!r}"
                f"{self._where(s, st)} is too small for block_size={B}: its proportion "
                f"{float(p):.6g} gives {float(B * p):.4g} samples per block of {B}, less than one "
                f"(each block holds every source's exact share). Use block_size >= "
                f"{math.ceil(1 / p)} (>= {works} works for every source"
                f"{' and stage, if it divides every stage start' if staged else ''})")
        if B > 1:
            text += (f", or raise its weight to at least 1/{B} of the total (>= "
                     f"{_ceil_text(others / (B - 1))} with the other weights unchanged)")
        return text

    def _where(self, s: int, st: _Stage) -> str:
        return f" in schedule stage {s} (from sample {st.start})" if self._is_schedule else ""

    @staticmethod
    def _weight_text(w: Fraction) -> str:
        return str(w) if w.denominator == 1 else f"{float(w):.6g}"

    def _parse_weights(self, weights: Any, s: int) -> tuple[Fraction, ...]:
        where = f" of schedule stage {s}" if self._is_schedule else ""
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights{where} must be a dict name -> number, got "
                            f"{type(weights).__name__}")
        unknown = [n for n in weights if n not in self.names]
        if unknown:
            raise ValueError(f"weights{where} name unknown source(s) {unknown}; the sources are "
                             f"{list(self.names)}")
        # a source a stage does not name has weight 0 in it
        values = tuple(_fraction(weights[n], f"weight of source {n!r}{where}") if n in weights
                       else Fraction(0) for n in self.names)
        if sum(values) == 0:
            raise ValueError(f"all weights{where} are zero: at least one source needs a positive "
                             "weight")
        return values


    # -- public description ---------------------------------------------------------------------

    @property
    def stages(self) -> tuple[tuple[int, dict[str, Fraction]], ...]:
        """The schedule as ``((start_sample, {name: proportion}), ...)``, exact, summing to 1.

        >>> tc.MixtureSchedule({"a": 10, "b": 10}, {"a": 3, "b": 1}, block_size=4).stages
        ((0, {'a': Fraction(3, 4), 'b': Fraction(1, 4)}),)
        """
        return tuple((st.start, dict(zip(self.names, st.proportions))) for st in self._stages)

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={float(p):.3g}" for n, p in self.stages[0][1].items())
        more = f", {len(self._stages)} stages" if len(self._stages) > 1 else ""
        return f"MixtureSchedule({parts}{more}, block_size={self.block_size}, seed={self.seed})"

    # -- what a resumed run must agree on --------------------------------------------------------

    def prefix(self, position: int) -> dict[str, Any]:
        """What mixture indices ``[0, position)`` depend on, as plain JSON: the algorithm, seed,
        block size, the stages that start before ``position`` (each with the exact proportions
        of its sources with a non-zero weight, in layout order) and those sources' lengths.

        Two schedules with equal prefixes map every index before ``position`` to the same source
        and sample, so a run saved at ``position`` under one continues exactly under the other:
        later stages may differ, and sources used only later may be added or removed.

        >>> tc.MixtureSchedule({"a": 10, "b": 10}, {"a": 3, "b": 1}, block_size=4).prefix(8)["stages"]
        [[0, [['a', '3/4'], ['b', '1/4']]]]
        """
        position = int_arg(position, "position", 0, INT64_MAX)
        stages = [st for st in self._stages if st.start < position]
        active = sorted({k for st in stages for k, x in enumerate(st.a) if x})
        return {
            "algorithm": MIXTURE_ALGORITHM,
            "permutation": PERMUTATION_ALGORITHM,
            "seed": self.seed,
            "block_size": self.block_size,
            "stages": [[st.start, [[self.names[k], str(Fraction(x, st.denom))]
                                   for k, x in enumerate(st.a) if x]] for st in stages],
            "sources": {self.names[k]: [self.lengths[k]] for k in active},
        }

    def source_epochs(self, position: int) -> dict[str, float]:
        """How many times each source has been read through by mixture indices ``[0, position)``:
        its samples taken divided by its length (2.5: two full passes and half of a third).

        >>> tc.MixtureSchedule({"a": 10, "b": 40}, {"a": 1, "b": 1}, block_size=2).source_epochs(40)
        {'a': 2.0, 'b': 0.5}
        """
        counts = self.source_counts(0, position)
        return {name: counts[name] / n for name, n in zip(self.names, self.lengths)}

    def first_over(self, name: str, samples: int, stop: int) -> int | None:
        """The first mixture index before ``stop`` that reads source ``name``'s sample number
        ``samples + 1`` (counting from 1), or None. O(log stop) calls of :meth:`source_counts`."""
        if self.source_counts(0, stop)[name] <= samples:
            return None
        lo, hi = 0, stop  # counts(0, lo) <= samples < counts(0, hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.source_counts(0, mid)[name] <= samples:
                lo = mid
            else:
                hi = mid
        return hi - 1

    def check_epochs(self, max_epochs: Any, stop: int) -> None:
        """ValueError if some source is read more than ``max_epochs`` times (a number, or a dict
        name -> number) by mixture indices ``[0, stop)``, naming the source and the index."""
        stop = int_arg(stop, "total_samples", 1, INT64_MAX)
        caps = max_epochs if isinstance(max_epochs, Mapping) else dict.fromkeys(self.names, max_epochs)
        unknown = [n for n in caps if n not in self.names]
        if unknown:
            raise ValueError(f"max_epochs_per_source names unknown source(s) {unknown}; the sources "
                             f"are {list(self.names)}")
        first = None  # (index, name, cap, allowed): the earliest read over a cap
        for name, cap in caps.items():
            if cap is None:
                continue
            cap = _fraction(cap, f"max_epochs_per_source[{name!r}]")
            allowed = math.floor(cap * self.lengths[self.names.index(name)])
            index = self.first_over(name, allowed, stop)
            if index is not None and (first is None or index < first[0]):
                first = (index, name, cap, allowed)
        if first is None:
            return
        index, name, cap, allowed = first
        s = bisect.bisect_right([st.start for st in self._stages], index) - 1
        where = f" in schedule stage {s} (from sample {self._stages[s].start})" if self._is_schedule else ""
        epochs = self.source_epochs(stop)[name]
        raise ValueError(
            f"source {name!r} ({self.lengths[self.names.index(name)]} samples) would be read "
            f"{epochs:.4g} times in the first {stop} mixture samples, more than "
            f"max_epochs_per_source={float(cap):g}: mixture index {index}{where} reads its sample "
            f"number {allowed + 1} (the first read over any cap). Lower its weight, end the "
            f"stage sooner, or raise the cap")

    # -- the stream -----------------------------------------------------------------------------

    def _totals(self, b: int) -> tuple[int, ...]:
        """``T(b)``: samples of each source in mixture indices ``[0, b * B)``; O(#sources)."""
        s = bisect.bisect_right(self._stage_blocks, b) - 1
        st = self._stages[s]
        seats = _apportion(st.a, st.denom, (b - st.block) * self.block_size)
        return tuple(t + c for t, c in zip(self._stage_totals[s], seats))

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray, Permutation]:
        """``(T(b), prefix, perm_b)`` of block ``b``: ``prefix[k]`` is where source ``k``'s run
        starts in the block's layout (``prefix[-1] == B``)."""
        return self._blocks.get_or_make(b, lambda: self._make_block(b))

    def _make_block(self, b: int) -> tuple[np.ndarray, np.ndarray, Permutation]:
        before, after = self._totals(b), self._totals(b + 1)
        # c_k = T_k(b+1) - T_k(b) >= 0: within one stage, with q = m * p_k (m samples since the
        # stage start), T_k(b) - T_k(b_s) <= ceil(q) and T_k(b+1) - T_k(b_s) >= floor(q + B p_k),
        # so c_k >= floor(q + B p_k) - ceil(q) >= floor(B p_k) - 1 >= 0, since construction
        # checked B p_k >= 1 (if q is an integer, c_k >= floor(B p_k) >= 1). Weight 0: c_k = 0.
        # Blocks never straddle stages (stage starts are multiples of B).
        counts = [y - x for x, y in zip(before, after)]
        assert min(counts) >= 0 and sum(counts) == self.block_size, (b, counts)
        prefix = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=prefix[1:])
        return (np.array(before, dtype=np.int64), prefix,
                Permutation(self.block_size, derive_key(self.seed, "mix-block", b)))

    def _source_permutation(self, k: int, epoch: int) -> Permutation:
        """Source ``k``'s permutation of its pass (epoch) ``epoch`` over its samples."""
        return self._perms.get_or_make((k, epoch), lambda: Permutation(
            self.lengths[k], derive_key(self.seed, f"mix-source:{self.names[k]}", epoch)))

    @staticmethod
    def _indices(indices: Any) -> np.ndarray:
        """Mixture indices as an int64 array (same shape), checked in one vectorised step:
        TypeError for non-integers, IndexError for negative ones or ones past int64."""
        arr = index_array(indices, "indices")
        if arr.size and arr.min() < 0:
            raise IndexError(f"mixture index {int(arr.min())} is negative (a mixture has no end, "
                             "so negative indices have no meaning)")
        return arr

    @staticmethod
    def _scalar(index: Any) -> int:
        """One mixture index as an int in ``[0, 2**63)``; TypeError/IndexError naming it."""
        index = int_arg(index, "index", minimum=None)
        if index < 0:
            raise IndexError(f"mixture index {index} is negative (a mixture has no end, so "
                             "negative indices have no meaning)")
        if index > INT64_MAX:
            raise IndexError(f"mixture index {index} is out of range (beyond int64)")
        return index

    def positions(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(source_ids, local_positions)`` of mixture ``indices`` (int or array-like, any shape).

        ``local_positions`` count in the source's own endless stream: the ``L``-th sample the
        mixture takes from that source (before the source's per-pass permutation, which
        :meth:`locate` applies). So over the first ``m`` whole blocks a source's positions are
        exactly ``0, 1, ..., count - 1``.

        >>> schedule = tc.MixtureSchedule({"a": 5, "b": 5}, block_size=2, seed=0)
        >>> source, pos = schedule.positions(np.arange(4))
        >>> sorted(pos[source == 0].tolist())
        [0, 1]
        """
        idx = self._indices(indices)
        source, local = self._flat_positions(idx.reshape(-1))
        return source.reshape(idx.shape), local.reshape(idx.shape)

    def _check_largest(self, idx: np.ndarray) -> None:
        """IndexError if a mixture index is too large for its block's arithmetic in int64."""
        B = self.block_size
        if idx.size and int(idx.max()) > INT64_MAX - B:
            raise IndexError(f"mixture index {int(idx.max())} is too large (max 2**63 - 1 - {B})")

    def _flat_positions(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Source and source-local stream position ``L`` of flat, checked mixture indices."""
        B = self.block_size
        self._check_largest(idx)
        blocks, slots = np.divmod(idx, B)
        source = np.empty(idx.shape, dtype=np.int64)
        local = np.empty(idx.shape, dtype=np.int64)
        for b, where in group_by(blocks):
            totals, prefix, perm = self._block(b)
            t = _permute(perm, slots[where])
            k = np.searchsorted(prefix[1:], t, side="right")  # prefix[k] <= t < prefix[k + 1]
            source[where] = k
            local[where] = totals[k] + (t - prefix[k])
        return source, local

    def locate(self, indices: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(source_ids, local_indices)`` of mixture ``indices`` (int or array-like, any shape).

        ``source_ids`` index :attr:`names`; ``local_indices`` are indices into that source's
        dataset. Both are int64 arrays of the input's shape. O(1) per index, whatever its size.

        >>> schedule = tc.MixtureSchedule({"web": 1000, "code": 50}, block_size=64)
        >>> source, local = schedule.locate([0, 10**12])
        >>> [schedule.names[k] for k in source.tolist()]
        ['web', 'web']
        """
        idx = self._indices(indices)
        source, local = self._flat_locate(idx.reshape(-1))
        return source.reshape(idx.shape), local.reshape(idx.shape)

    def _flat_locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`locate` of flat, checked mixture indices.

        A block read a second time (or by many indices at once) is mapped whole, in one
        vectorised pass, and kept: a loader reads the mixture in order, so the next batches of
        that block are plain lookups instead of two keyed permutations per index.
        """
        B = self.block_size
        if B > _TABLE_MAX or not idx.size:
            return self._source_locals(*self._flat_positions(idx))
        b = int(idx[0]) // B
        table = self._tables.get(b)
        if table is not None and int(idx.max()) < (b + 1) * B and int(idx.min()) >= b * B:
            slots = idx - b * B  # the usual batch: inside one block already mapped
            return table[0][slots], table[1][slots]
        self._check_largest(idx)
        blocks, slots = np.divmod(idx, B)
        source = np.empty(idx.shape, dtype=np.int64)
        local = np.empty(idx.shape, dtype=np.int64)
        rest = []  # positions of indices in blocks read sparsely: mapped one by one
        for b, where in group_by(blocks):
            table = self._tables.get(b)
            if table is None and (self._touched.get(b) or where.size * 8 >= B):
                table = self._tables.get_or_make(b, lambda: self._make_table(b))
            if table is None:
                self._touched.put(b, True)
                rest.append(where)
                continue
            at = slots[where]
            source[where], local[where] = table[0][at], table[1][at]
        if rest:
            where = np.concatenate(rest) if len(rest) > 1 else rest[0]
            source[where], local[where] = self._source_locals(*self._flat_positions(idx[where]))
        return source, local

    def _make_table(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, local)`` of every slot of block ``b``: its whole mapping, vectorised."""
        slots = np.arange(self.block_size, dtype=np.int64)
        return self._source_locals(*self._flat_positions(b * self.block_size + slots))

    def _source_locals(self, source: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source, local index)`` from sources and source-local stream positions ``L``:
        each source's pass ``L // n`` is its own keyed permutation of ``[0, n)``."""
        local = np.empty_like(pos)
        for k, where in group_by(source):
            n = self.lengths[k]
            if n == 1:
                local[where] = 0
                continue
            epochs, offsets = np.divmod(pos[where], n)
            for e, sub in group_by(epochs):
                local[where[sub]] = self._permuted_offsets(k, e, offsets[sub])
        return source, local

    def _permuted_offsets(self, k: int, epoch: int, offsets: np.ndarray) -> np.ndarray:
        """Source ``k``'s permutation of ``epoch`` at ``offsets``: from cached runs of it when
        the offsets are dense (a block's positions of a source are consecutive), else directly."""
        perm = self._source_permutation(k, epoch)
        low, high = int(offsets.min()), int(offsets.max())
        if offsets.size <= _SCALAR_MAX or high - low >= 2 * offsets.size:
            return _permute(perm, offsets)
        first, last = low // _RUN, high // _RUN
        if first == last:
            return self._run(k, epoch, perm, first)[offsets - first * _RUN]
        runs = np.concatenate([self._run(k, epoch, perm, r) for r in range(first, last + 1)])
        return runs[offsets - first * _RUN]

    def _run(self, k: int, epoch: int, perm: Permutation, r: int) -> np.ndarray:
        """Positions ``[r * _RUN, (r + 1) * _RUN)`` (within ``[0, n)``) of a source's permuted epoch."""
        def make() -> np.ndarray:
            run = perm(np.arange(r * _RUN, min((r + 1) * _RUN, perm.n), dtype=np.int64))
            run.flags.writeable = False
            return run
        return self._runs.get_or_make((k, epoch, r), make)

    def locate_one(self, index: int) -> tuple[int, int]:
        """``(source_id, local_index)`` of one mixture index, as ints.

        >>> schedule = tc.MixtureSchedule({"web": 1000, "code": 50}, block_size=64)
        >>> k, i = schedule.locate_one(7)
        >>> 0 <= i < schedule.lengths[k]
        True
        """
        source, local = self.locate(self._scalar(index))
        return int(source), int(local)

    def source_of(self, index: int) -> str:
        """Name of the source that mixture index ``index`` comes from.

        >>> tc.MixtureSchedule({"only": 3}).source_of(10**9)
        'only'
        """
        return self.names[self.locate_one(index)[0]]

    def source_counts(self, start: int, stop: int) -> dict[str, int]:
        """Exact number of samples each source contributes to mixture indices ``[start, stop)``.

        O(#sources) for the whole blocks (from the running totals) plus the slots of at most two
        partial blocks, so any range costs the same, however long or far out. Use it to check a
        schedule (see ``examples/mixture_schedule.py``).

        >>> schedule = tc.MixtureSchedule({"web": 10**6, "code": 10**5},
        ...                               schedule=[(0, {"web": 9, "code": 1}), (1000, {"web": 1, "code": 1})],
        ...                               block_size=100)
        >>> schedule.source_counts(0, 2000)
        {'web': 1400, 'code': 600}
        """
        start = int_arg(start, "start", 0, INT64_MAX)
        stop = int_arg(stop, "stop", 0, INT64_MAX)
        if stop < start:
            raise ValueError(f"stop must be >= start, got start={start}, stop={stop}")
        B = self.block_size
        counts = np.zeros(len(self.names), dtype=np.int64)
        first, last = -(-start // B), stop // B  # whole blocks [first, last)
        if first <= last:
            counts += np.array(self._totals(last), dtype=np.int64) - self._totals(first)
            partial = [(start, min(first * B, stop)), (max(last * B, start), stop)]
        else:
            partial = [(start, stop)]  # inside one block
        for lo, hi in partial:
            if hi > lo:
                counts += self._partial_counts(lo, hi)
        return dict(zip(self.names, counts.tolist()))

    def _partial_counts(self, lo: int, hi: int) -> np.ndarray:
        """Counts per source of indices ``[lo, hi)`` inside one block."""
        B = self.block_size
        b = lo // B
        _, prefix, perm = self._block(b)
        j0, j1 = lo - b * B, hi - b * B
        whole = np.diff(prefix)
        if j1 - j0 > B // 2:  # cheaper to count the complement
            rest = np.concatenate([np.arange(0, j0), np.arange(j1, B)]).astype(np.int64)
            return whole - self._slot_counts(perm(rest), prefix)
        return self._slot_counts(perm(np.arange(j0, j1, dtype=np.int64)), prefix)

    @staticmethod
    def _slot_counts(t: np.ndarray, prefix: np.ndarray) -> np.ndarray:
        k = np.searchsorted(prefix[1:], t, side="right")
        return np.bincount(k, minlength=len(prefix) - 1).astype(np.int64)


def prefix_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> tuple[int, str] | None:
    """Where the schedule a run was saved under (its :meth:`MixtureSchedule.prefix` at the saved
    position) and the current one first differ: ``(mixture index, why)``, or None if they agree.

    >>> a = tc.MixtureSchedule({"x": 9, "y": 9}, schedule=[(0, {"x": 1}), (4, {"y": 1})], block_size=2)
    >>> b = tc.MixtureSchedule({"x": 9, "y": 9}, schedule=[(0, {"x": 1}), (6, {"y": 1})], block_size=2)
    >>> prefix_difference(a.prefix(8), b.prefix(8))[0]
    4
    """
    if dict(saved) == dict(current):
        return None
    for key in ("algorithm", "permutation", "seed", "block_size"):
        if saved.get(key) != current.get(key):
            return 0, f"{key} was {saved.get(key)!r}, it is now {current.get(key)!r}"
    try:
        a, b = list(saved["stages"]), list(current["stages"])
        starts = sorted({int(st[0]) for st in a} | {int(st[0]) for st in b})
        for x in starts:
            sa = [st for st in a if int(st[0]) <= x][-1:] or [None]
            sb = [st for st in b if int(st[0]) <= x][-1:] or [None]
            if sa[0] != sb[0]:
                return x, (f"from mixture index {x} the saved run's stage was {_stage_text(sa[0])}, "
                           f"this schedule's is {_stage_text(sb[0])}")
            for name, _ in sa[0][1]:
                was, now = saved["sources"].get(name), current["sources"].get(name)
                if was != now:
                    return x, (f"source {name!r}, read from mixture index {x} on, is not the same: "
                               f"saved {was}, now {now} ([length, identity])")
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return 0, "the saved schedule description is malformed"
    return 0, "the saved schedule description differs"


def _stage_text(stage: Any) -> str:
    if stage is None:
        return "absent"
    start, props = stage
    return "{" + ", ".join(f"{name}: {p}" for name, p in props) + f"}} (stage from {start})"

