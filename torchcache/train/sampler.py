"""Distributed sampler over one continuous, keyed-permuted stream of sample positions.

The whole data order is a pure function of ``(seed, n)``: global position ``p = 0, 1, 2, ...``
(continuous across epochs) is in permutation epoch ``e = p // n`` and reads dataset index
``perm_e(p % n)``, a fresh keyed permutation every epoch (see :mod:`torchcache.order.permutation`).
Rank ``r`` of ``W`` takes positions ``P + r, P + r + W, ...`` from the start position ``P``, so a
global step of ``G = W * b`` samples always covers ``[P + t*G, P + (t+1)*G)`` whatever ``W`` is.
Ranks never talk to each other: each computes its own indices in O(1) memory, so resuming at
position 10**12 costs the same as at 0.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import numpy as np
import torch
import torch.utils.data

from .._util.args import (POSITION_LIMIT, bool_arg, flag_arg, index_array, int_arg, number_arg,
                          optional_int_arg, position_arg)
from .._util.lru import LRUCache
from ..order.permutation import PERMUTATION_ALGORITHM, Permutation, derive_key
from ..order.state import check_state

__all__ = ["DistributedSampler", "dataset_length"]

SAMPLER_STATE_FORMAT = "torchcache.sampler"
SAMPLER_STATE_VERSION = 1

_SAMPLER_FIELDS = ("format", "version", "counts", "position", "world_size", "algorithm", "seed",
                   "shuffle", "num_samples", "window")
_ITERATOR_FIELDS = _SAMPLER_FIELDS + ("remaining",)

_SLICE = 8192  # positions per rank mapped in one vectorised call while iterating (~40 ns each)
_PERM_CACHE = 4  # Permutation objects kept (a slice of positions spans at most a few epochs)


def _distributed_defaults() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when it is initialised, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def dataset_length(dataset: Any) -> int:
    """``len(dataset)`` as a checked int; a TypeError naming ``dataset`` if it has no length.

    >>> dataset_length(range(5))
    5
    """
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"dataset must be a sized dataset (with len()), got {type(dataset).__name__}")
    return int_arg(len(dataset), "len(dataset)", 0)


def _replicas(num_replicas: Any, world_size: Any) -> int | None:
    """The number of ranks given as ``num_replicas`` or its alias ``world_size`` (None: neither)."""
    replicas = optional_int_arg(num_replicas, "num_replicas", 1)
    world = optional_int_arg(world_size, "world_size", 1)
    if replicas is not None and world is not None and replicas != world:
        raise ValueError(f"num_replicas={replicas} and world_size={world} disagree: world_size is "
                         "an alias of num_replicas; pass only one of them")
    return replicas if replicas is not None else world


def _build_handle(build: Any) -> Any:
    """``build``: None or a :class:`torchcache.BuildHandle` (anything with an ``error`` attribute)."""
    if build is not None and not hasattr(build, "error"):
        raise TypeError(f"build must be the tc.BuildHandle of the background build (or None), "
                        f"got {type(build).__name__}")
    return build


class DistributedSampler(torch.utils.data.DistributedSampler):
    """Each rank's share of the global stream of permuted dataset indices.

    It is a ``torch.utils.data.DistributedSampler`` subclass, so frameworks that look for one
    (Lightning's ``use_distributed_sampler``, accelerate) leave it in place instead of wrapping it
    in a second split; torch's ``__init__`` is not called (it needs a process group) and every
    attribute torch's has is this class's own (:attr:`epoch` is read-only: use
    :meth:`set_epoch` or :meth:`set_position`).

    The first six parameters are torch's, in torch's order:
    ``tc.DistributedSampler(ds, 2, 1, False, 0, True)`` is rank 1 of 2, no shuffle, seed 0,
    drop_last, as for ``torch.utils.data.DistributedSampler``; the others are keyword-only.
    So are the attributes torch has: :attr:`num_samples` is what each rank yields per loader
    epoch and :attr:`total_size` what all ranks yield; ``n`` itself is :attr:`dataset_size`.

    Args:
        dataset: anything with ``len()``; ``n = len(dataset)`` samples.
        num_replicas: the number of ranks ``W`` (``world_size=`` is an alias). With ``rank``,
            defaults to torch.distributed's when it is initialised, else 1 (and rank 0).
            The sampler never initialises a process group and never synchronises.
        rank: this process's rank, in ``[0, num_replicas)``.
        shuffle: permute each epoch; if False position ``p`` reads index ``p % n``. Ignored for a
            dataset with ``unbounded_indices = True`` (:class:`torchcache.MixtureDataset`): it is
            already shuffled and every index ``>= 0`` is valid, so position ``p`` reads index
            ``p`` (``len(dataset)`` then only sets the loader-epoch size; ``window`` is refused).
        seed: permutation seed (>= 0); the same seed gives the same stream on every run.
        drop_last: make loader epochs ``W * floor(n / W)`` positions long instead of
            ``W * ceil(n / W)``, so no rank gets a position past ``n`` in the first epoch, as in
            torch. Nothing is lost: the stream continues, so the positions an epoch leaves out
            open the next one. It changes only where loader epochs end, not the stream (a state
            saved with one value loads with the other). Needs ``n >= W``.
        world_size: alias of ``num_replicas`` (give one of them, or both equal).
        infinite: ``iter()`` never ends (continues across epochs), for step-based loops.
        max_epochs: stop the stream at global position ``max_epochs * E``, ``E`` below.
        max_samples: stop the stream at global position ``max_samples``.
        window: quick start. Permutation epoch 0 is shuffled within consecutive windows of
            ``window`` samples (window k holds samples [k*window, (k+1)*window)), so training can
            start while the cache is still being built: a window is served once it is fully
            committed, and the sampler waits for it. Later epochs are full permutations. The
            stream is a pure function of (seed, final cache, window), whether training started
            early or not; it is required while the dataset's cache is incomplete.
        wait_timeout: seconds to wait for a growing cache to commit the next window before
            raising TimeoutError.
        build: optional :class:`torchcache.BuildHandle` of the background build; if it fails,
            the sampler raises its error instead of waiting.

    Loader epochs: with ``E = W * ceil(n / W)`` (:attr:`epoch_size`), loader epoch ``e`` is the
    global range ``[e*E, (e+1)*E)``; it contains permutation epoch ``e``'s samples plus, when
    ``W`` does not divide ``n``, the first ``E - n`` positions of the stream after it, so nothing
    is dropped or repeated and every rank yields ``E / W = ceil(n / W)`` indices
    (:attr:`num_samples`). With ``drop_last``, ``E = W * floor(n / W)``. ``iter()`` starts at
    :attr:`position` ``P`` and yields ``ceil((end - P) / W)`` indices on every rank, ``end`` being
    the end of the loader epoch containing ``P``; the next ``iter()`` continues after them.
    If ``P`` is not a multiple of ``W`` (elastic resume) the last few positions spill past
    ``end``; the stream stays continuous.

    Limits (``max_epochs``, ``max_samples``, the smaller wins) give a global stop position
    ``L``. From start ``P`` each rank yields at most ``floor((L - P) / W)`` indices, so every rank
    gets the same count and no position ``>= L`` is served; when ``L - P`` is not a multiple of
    ``W`` the last ``(L - P) % W`` positions before ``L`` are left out.

    :attr:`position` is the global position of the next row of ``W`` positions this sampler
    dispatches (rank ``r`` next yields position ``position + r``). The sampler's own
    :meth:`state_dict` records that *dispatched* position; :class:`torchcache.DataLoader`'s
    state records what the training loop *consumed* and drives this position itself.

    The sampler only computes indices: it never reads or changes its dataset or the dataset's
    cache. (The order a remote cache under a ``cache_limit`` fetches ahead is given to it by
    whoever reads, e.g. :class:`torchcache.DataLoader`.)

    With ``shuffle=False`` the first loader epoch is exactly torch's, with or without
    ``drop_last`` (without it torch pads the last positions with the first indices, as the
    continuing stream does; with it both stop at ``W * floor(n / W)``); torch repeats that
    epoch while this stream moves on, so later epochs agree only when ``W`` divides ``n``.

    >>> sampler = tc.DistributedSampler(range(10), 2, 1, shuffle=False)  # rank 1 of 2
    >>> list(sampler)
    [1, 3, 5, 7, 9]
    >>> loader = tc.DataLoader(range(20), batch_size=4, sampler=tc.DistributedSampler(range(20), seed=0))
    >>> sorted(i for batch in loader for i in batch.tolist()) == list(range(20))  # one shuffled epoch
    True
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        world_size: int | None = None,
        infinite: bool = False,
        max_epochs: int | None = None,
        max_samples: int | None = None,
        window: int | None = None,
        wait_timeout: float = 600.0,
        build: Any = None,
    ) -> None:
        self.dataset = dataset
        self._dataset_size = dataset_length(dataset)
        self.window = optional_int_arg(window, "window", 1, POSITION_LIMIT)
        # Datasets with unbounded indices (tc.MixtureDataset): already shuffled, read in order.
        self.unbounded = bool(getattr(dataset, "unbounded_indices", False))
        if self.unbounded and self.window is not None:
            raise ValueError(
                f"window= (quick start) is not supported for {type(dataset).__name__}: its "
                "indices are an already shuffled, unbounded stream, read in order; drop window=")
        self.wait_timeout = number_arg(wait_timeout, "wait_timeout", positive=True)
        self.build = _build_handle(build)
        self._growing = getattr(dataset, "complete", True) is False
        if self._growing and self.window is None:
            raise ValueError(
                "the dataset's cache is still being built: pass window=W (e.g. 8192) to train on "
                "its committed prefix (the first epoch is then shuffled within windows of W "
                "samples), or wait for the build to finish")
        if self._dataset_size == 0 and not self._growing:
            raise ValueError("dataset is empty: DistributedSampler needs len(dataset) >= 1")
        self.seed = int_arg(seed, "seed", 0)
        self.shuffle = flag_arg(shuffle, "shuffle")  # truthy, as torch takes it
        self.drop_last = flag_arg(drop_last, "drop_last")
        default_rank, default_world = _distributed_defaults()
        given = _replicas(num_replicas, world_size)
        # (rank, world) taken from torch.distributed's absence: checked again at iter()
        self._assumed_single = given is None and rank is None and default_world == 1
        self.world_size = default_world if given is None else given
        self.rank = int_arg(default_rank if rank is None else rank, "rank", None)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"Invalid rank {self.rank}, rank should be in the interval "
                             f"[0, {self.world_size - 1}] (num_replicas, or world_size, is "
                             f"{self.world_size})")
        self.infinite = bool_arg(infinite, "infinite")
        self.max_epochs = optional_int_arg(max_epochs, "max_epochs", 0)
        self.max_samples = optional_int_arg(max_samples, "max_samples", 0)
        if not self._growing:
            self._check_drop_last()

        self.position = 0
        self._fresh = True  # never iterated or positioned: set_epoch may jump
        self._generation = 0  # bumped by iter()/set_position(); stale iterators stop writing position
        self._position_version = 0  # bumped by every set_position (see position_version)
        self._perms: LRUCache[Permutation] = LRUCache(_PERM_CACHE)

    def _check_drop_last(self) -> None:
        """ValueError if ``drop_last`` would leave no position at all (``n < W``)."""
        if self.drop_last and self._dataset_size < self.world_size:
            raise ValueError(
                f"drop_last=True with len(dataset)={self._dataset_size} < num_replicas="
                f"{self.world_size} leaves no sample for any rank: use drop_last=False (the "
                "last positions then continue the stream) or fewer ranks")

    # -- the stream ---------------------------------------------------------------------------

    @property
    def dataset_size(self) -> int:
        """``n = len(dataset)``: the samples of one permutation epoch (while the cache is still
        being built, the samples committed so far). Saved states call it ``"num_samples"``.

        >>> tc.DistributedSampler(range(10), 4, 0).dataset_size
        10
        """
        return self._dataset_size

    @property
    def num_samples(self) -> int | None:
        """Indices each rank yields per loader epoch, as in torch: ``ceil(n / W)``, or
        ``floor(n / W)`` with ``drop_last`` (None while the cache is still being built).

        >>> tc.DistributedSampler(range(10), 4, 0).num_samples
        3
        >>> tc.DistributedSampler(range(10), 4, 0, drop_last=True).num_samples
        2
        """
        size = self.epoch_size
        return None if size is None else size // self.world_size

    @property
    def epoch_size(self) -> int | None:
        """``E = W * num_samples``: global positions per loader epoch (None while n is unknown).

        >>> tc.DistributedSampler(range(10), 4, 0).epoch_size
        12
        """
        if self._growing:
            return None
        n, W = self._dataset_size, self.world_size
        return W * (n // W if self.drop_last else -(-n // W))

    @property
    def total_size(self) -> int | None:
        """torch's name for :attr:`epoch_size`: all ranks' indices per loader epoch.

        >>> tc.DistributedSampler(range(10), 4, 0).total_size
        12
        """
        return self.epoch_size

    @property
    def stop_position(self) -> int | None:
        """Global position where the stream stops (from max_epochs/max_samples), or None."""
        limits = [self.max_samples] if self.max_samples is not None else []
        if self.max_epochs is not None and not self._growing:
            limits.append(self.max_epochs * self.epoch_size)
        return min(limits) if limits else None

    @property
    def growing(self) -> bool:
        """True while the dataset's cache is still being built (its final length is unknown)."""
        return self._growing

    def _wait_for(self, position: int) -> None:
        """Quick start: wait until the window holding ``position`` is committed (or n is final)."""
        deadline = time.monotonic() + self.wait_timeout
        needed = (position // self.window + 1) * self.window
        last = self._dataset_size
        while self._growing and self._dataset_size < needed:
            error = getattr(self.build, "error", None)
            if error is not None:
                raise RuntimeError(f"the background build failed, so sample window "
                                   f"{position // self.window} will never be committed: {error}")
            time.sleep(0.05)
            self._refresh()
            if self._dataset_size != last:
                last, deadline = self._dataset_size, time.monotonic() + self.wait_timeout
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"waited {self.wait_timeout:.0f} s for the cache to commit samples up to "
                    f"{needed} (it has {self._dataset_size}) and it did not grow; is the build still "
                    "running? (pass build=handle to be told when it fails, or raise wait_timeout)")

    def _refresh(self) -> None:
        """Re-read a growing dataset's length; freeze it when its cache is complete."""
        refresh = getattr(self.dataset, "refresh", None)
        self._dataset_size = int_arg(refresh() if refresh else len(self.dataset), "len(dataset)", 0)
        if getattr(self.dataset, "complete", True):
            self._growing = False
            self._perms.clear()
            if self._dataset_size == 0:
                raise ValueError("the finished cache holds no complete sample")
            self._check_drop_last()

    @property
    def follows_length(self) -> bool:
        """True for a dataset that is not torchcache's (a list, a map-style dataset of your
        own): its length may change between passes, as torch's samplers allow (see
        :meth:`follow_dataset_length`). A cache's datasets grow through their cache instead, and
        a mixture's indices are unbounded."""
        return not (self.unbounded or hasattr(self.dataset, "refresh")
                    or hasattr(self.dataset, "complete"))

    def follow_dataset_length(self) -> bool:
        """Re-read ``len(dataset)`` of a dataset that :attr:`follows_length` (torch's samplers
        read it at every ``iter()``): a list that grew or shrank since is read at its new
        length from the next ``iter()`` on. True if the length changed. Only call it between
        passes: a live iterator reads indices of the length it started with.

        >>> data = list(range(4))
        >>> sampler = tc.DistributedSampler(data, shuffle=False)
        >>> data.append(4)
        >>> sampler.follow_dataset_length(), len(sampler)
        (True, 5)
        """
        if not self.follows_length:
            return False
        n = dataset_length(self.dataset)
        if n == self._dataset_size:
            return False
        if n == 0:
            raise ValueError("dataset is empty: DistributedSampler needs len(dataset) >= 1")
        self._dataset_size = n
        self._perms.clear()
        self._check_drop_last()
        return True

    def _permutation(self, epoch: int) -> Permutation:
        return self._perms.get_or_make(
            epoch, lambda: Permutation(self._dataset_size, derive_key(self.seed, "sample", epoch)))

    def indices_for_positions(self, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) for global stream ``positions``, vectorised per epoch.

        This is the only place that maps positions to indices, so a subclass can change the
        order (e.g. a quick-start first epoch) by overriding it alone.

        >>> tc.DistributedSampler(range(5), shuffle=False).indices_for_positions(np.arange(3, 8))
        array([3, 4, 0, 1, 2])
        """
        positions = index_array(positions, "positions")
        if positions.size and positions.min() < 0:
            raise ValueError(f"positions must be >= 0, got {positions.min()}")
        if self.unbounded:
            # A dataset with ``unbounded_indices`` (tc.MixtureDataset) is already shuffled and
            # defined at every index >= 0: global position p reads index p, whatever ``shuffle``
            # says, and later loader epochs continue its stream instead of replaying it.
            return positions
        n = self._dataset_size
        if self.window is not None and positions.size and (self._growing or positions.min() < n):
            if self._growing and positions.max() >= n // self.window * self.window:
                raise ValueError("positions beyond the committed windows of a growing cache")
            first = positions < n if not self._growing else np.ones(positions.shape, dtype=bool)
            out = np.empty_like(positions)
            out[first] = self._windowed(positions[first])
            if not first.all():
                out[~first] = self.indices_for_positions(positions[~first])
            return out
        epochs, offsets = np.divmod(positions, n)
        if not self.shuffle or n == 1 or positions.size == 0:
            return offsets
        first, last = int(epochs.min()), int(epochs.max())
        if first == last:
            return self._permutation(first)(offsets)
        out = np.empty_like(offsets)
        for epoch in np.unique(epochs):  # a slice spans few epochs (unless n is tiny)
            mask = epochs == epoch
            out[mask] = self._permutation(int(epoch))(offsets[mask])
        return out

    def _windowed(self, positions: np.ndarray) -> np.ndarray:
        """Permutation epoch 0 with quick start: shuffle within windows of ``window`` samples."""
        w = self.window
        windows, offsets = np.divmod(positions, w)
        if not self.shuffle:
            return positions
        out = np.empty_like(positions)
        for k in np.unique(windows).tolist():
            mask = windows == k
            size = min(w, self._dataset_size - k * w) if not self._growing else w
            perm = Permutation(size, derive_key(self.seed, "window", k))
            out[mask] = k * w + perm(offsets[mask])
        return out

    def iteration_length(self, position: int | None = None) -> int | None:
        """Indices ``iter()`` yields on each rank when started at ``position``; None if unbounded.

        >>> tc.DistributedSampler(range(10), 2, 0).iteration_length(4)
        3
        """
        start = self.position if position is None else position_arg(position, "position")
        W = self.world_size
        count = None
        if not self.infinite and not self._growing:
            end = (start // self.epoch_size + 1) * self.epoch_size
            count = -(-(end - start) // W)
        stop = self.stop_position
        if stop is not None:
            cap = max(0, (stop - start) // W)
            count = cap if count is None else min(count, cap)
        return count

    def __iter__(self) -> Iterator[int]:
        self._check_still_single()
        self._generation += 1
        self._fresh = False
        return _SamplerIterator(self, self.position, self.iteration_length(), self._generation)

    def _check_still_single(self) -> None:
        """RuntimeError if this sampler took rank 0 of 1 because torch.distributed was not
        initialised yet, and it is now, with more processes: every rank would read the whole
        stream (each sample world-size times per epoch)."""
        if not self._assumed_single:
            return
        rank, world = _distributed_defaults()
        if world != 1:
            raise RuntimeError(
                f"this DistributedSampler was made before torch.distributed was initialised, so "
                f"it took rank 0 of 1; the process group now has {world} processes (this is rank "
                f"{rank}), and every rank would read the whole stream. Make the sampler (and "
                "the DataLoader) after init_process_group / Accelerator() / the trainer's "
                "setup, or pass num_replicas= and rank= explicitly")

    def _index_slices(self, start: int, count: int | None) -> Iterator[np.ndarray]:
        """The rank's indices from ``start`` (``count`` of them, or endless), as int64 arrays,
        one slice of consecutive positions at a time."""
        W, r = self.world_size, self.rank
        # Slices start small (cheap first batch, cheap abandoned iterators) and never span more
        # than ~n positions, so one slice touches at most two permutation epochs (when n >= W).
        rows = 64
        j = 0
        while count is None or j < count:
            cap = max(1, min(_SLICE, (self.window if self._growing else self._dataset_size) // W))
            rows = min(cap, rows)
            stop = j + rows if count is None else min(j + rows, count)
            rows = 8 * rows
            positions = start + r + W * np.arange(j, stop, dtype=np.int64)
            if self._growing:
                self._wait_for(int(positions[-1]))
                if not self._growing and not self.infinite and count is None:
                    count = self.iteration_length(start)  # n is final now: so is this epoch's end
                    positions = positions[:max(0, count - j)]
            j += len(positions)
            if len(positions):
                yield self.indices_for_positions(positions)

    def __len__(self) -> int:
        """Indices the next ``iter()`` yields on this rank (:attr:`num_samples` at a loader-epoch
        start)."""
        count = self.iteration_length()
        if count is None:
            raise TypeError("this DistributedSampler has no len(): it is infinite without "
                            "max_epochs/max_samples, or its cache is still being built")
        return count

    # -- positioning and state ----------------------------------------------------------------

    def set_position(self, position: int) -> None:
        """Continue from global ``position`` at the next ``iter()`` (a live iterator is unaffected).

        Every call bumps :attr:`position_version`. :class:`torchcache.DataLoader` positions its
        sampler this way at each ``iter()``, and takes a move made by someone else (this method,
        :meth:`set_epoch` on a fresh sampler, :meth:`load_state_dict`) as the new consumed count.

        >>> sampler = tc.DistributedSampler(range(10), 2, 1, shuffle=False)  # rank 1 of 2
        >>> sampler.set_position(4)
        >>> next(iter(sampler))  # the index at global position 4 + rank
        5
        """
        self.position = position_arg(position, "position")
        self._fresh = False
        self._generation += 1
        self._position_version += 1

    @property
    def position_version(self) -> int:
        """How many times :meth:`set_position` has moved this sampler (directly, or through
        :meth:`set_epoch` or :meth:`load_state_dict`); iterating does not change it.

        An owner that positions the sampler itself (:class:`torchcache.DataLoader`) compares it
        with the value after its own last move to tell whether someone else moved the sampler.

        >>> sampler = tc.DistributedSampler(range(10), 2, 1)
        >>> before = sampler.position_version
        >>> sampler.set_position(0)
        >>> sampler.position_version == before + 1
        True
        """
        return self._position_version

    @property
    def num_replicas(self) -> int:
        """The number of ranks (torch's name for :attr:`world_size`)."""
        return self.world_size

    @property
    def epoch(self) -> int:
        """The loader epoch of :attr:`position` (torch's attribute; 0 while the cache is still
        being built). Read-only: :meth:`set_epoch` and :meth:`set_position` move the sampler.

        >>> sampler = tc.DistributedSampler(range(10), 2, 0)
        >>> sampler.set_position(12)
        >>> sampler.epoch
        1
        """
        return 0 if self._growing else self.position // self.epoch_size

    def set_epoch(self, epoch: int) -> None:
        """Accepted for drop-in compatibility with torch's DistributedSampler; usually a no-op.

        The position counter is the source of truth and ``iter()`` already moves on by itself.
        If ``epoch`` is the loader epoch of the current position, nothing happens. On a fresh
        sampler (never iterated or positioned) it jumps to the start of loader epoch ``epoch``.
        Otherwise it warns and changes nothing, rather than silently skip or replay data; use
        :meth:`set_position` to move explicitly.

        >>> sampler = tc.DistributedSampler(range(6), 1, 0, seed=0)
        >>> loader = tc.DataLoader(range(6), batch_size=3, sampler=sampler)
        >>> for epoch in range(3):  # a torch-style epoch loop works unchanged
        ...     sampler.set_epoch(epoch)
        ...     print([batch.tolist() for batch in loader])  # a new permutation each epoch
        [[3, 2, 5], [0, 1, 4]]
        [[2, 3, 4], [5, 0, 1]]
        [[5, 2, 0], [4, 1, 3]]
        """
        epoch = int_arg(epoch, "epoch", 0, None if self._growing
                        else (POSITION_LIMIT - 1) // self.epoch_size)
        if self._growing:
            if epoch != 0 or not self._fresh:
                warnings.warn(f"set_epoch({epoch}) ignored while the cache is still being built",
                              stacklevel=2)
            return
        if self.position // self.epoch_size == epoch:
            return
        if self._fresh:
            self.set_position(epoch * self.epoch_size)
            return
        warnings.warn(
            f"set_epoch({epoch}) ignored: the sampler is at global position {self.position}, in "
            f"loader epoch {self.position // self.epoch_size}; it continues from there. "
            "Use set_position() to move explicitly.",
            stacklevel=2,
        )

    def _identity(self) -> dict[str, Any]:
        return {
            "algorithm": PERMUTATION_ALGORITHM,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": None if self._growing else self._dataset_size,  # n, not per rank
            "window": self.window,
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; ``"position"`` counts *dispatched* positions, not consumed ones.

        Indices already dispatched to DataLoader workers but not yet received by the training
        loop are counted here; use :meth:`torchcache.DataLoader.state_dict` for exact resume.
        (torchdata's ``StatefulDataLoader`` also resumes exactly: it snapshots this state, and the
        live iterator's, when a batch is dispatched and keeps that snapshot until the batch is
        yielded; see :class:`_SamplerIterator`.)

        >>> tc.DistributedSampler(range(10), seed=3).state_dict()["position"]
        0
        """
        return {
            "format": SAMPLER_STATE_FORMAT,
            "version": SAMPLER_STATE_VERSION,
            "counts": "dispatched",
            "position": self.position,
            "world_size": self.world_size,
            **self._identity(),
        }

    def _expected_state(self, state_format: str) -> dict[str, Any]:
        """The fields a loaded state of ``state_format`` must have as they are here."""
        return {"format": state_format, "version": SAMPLER_STATE_VERSION, "counts": "dispatched",
                **self._identity()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Validate a :meth:`state_dict` and continue from its position (any world size).

        >>> two_ranks = tc.DistributedSampler(range(10), 2, 0, seed=3)
        >>> two_ranks.set_position(6)
        >>> one_rank = tc.DistributedSampler(range(10), 1, 0, seed=3)
        >>> one_rank.load_state_dict(two_ranks.state_dict())  # any world size
        >>> one_rank.position
        6
        >>> tc.DistributedSampler(range(10), 1, 0, seed=4).load_state_dict(two_ranks.state_dict())
        Traceback (most recent call last):
        ValueError: cannot load this state into DistributedSampler: seed: saved 3, this ... has 4. ...
        """
        checked = check_state(
            state, self._expected_state(SAMPLER_STATE_FORMAT), _SAMPLER_FIELDS, "DistributedSampler",
            "Load a state saved by a DistributedSampler over the same dataset with the same seed "
            "and shuffle (or start a new run without loading it).",
        )
        self.set_position(checked["position"])


# -- torchdata interop: a live iteration that can save and restore itself ---------------------

SAMPLER_ITERATOR_STATE_FORMAT = "torchcache.sampler_iterator"


class _SamplerIterator(Iterator[int]):
    """What ``iter(DistributedSampler)`` returns: the rank's indices for one ``iter()``.

    It also has ``state_dict``/``load_state_dict`` so that torchdata's ``StatefulDataLoader``
    (which saves the sampler's state *and* its live iterator's, then on resume calls
    ``sampler.load_state_dict``, ``iter(sampler)`` and ``iterator.load_state_dict``) continues
    the interrupted ``iter()`` itself. That matters only at a loader-epoch end: there the
    sampler's position alone means "start the next epoch", while the interrupted iteration has
    nothing left, so the resumed loader must end its epoch first, as the uninterrupted one does.
    Like the sampler's state, ``"position"`` counts dispatched positions.
    """

    def __init__(self, sampler: DistributedSampler, start: int, count: int | None, generation: int) -> None:
        self._sampler = sampler
        self._start, self._count, self._generation = start, count, generation
        self._restart(start, count)

    def _restart(self, start: int, count: int | None) -> None:
        self._start, self._count, self._yielded = start, count, 0
        self._slices = self._sampler._index_slices(start, count)
        self._buffer = np.empty(0, dtype=np.int64)  # the current slice
        self._items: list[int] | None = None  # the same as Python ints, made for __next__
        self._at = 0  # next unread place in the slice

    def __iter__(self) -> _SamplerIterator:
        return self

    def _advance(self, k: int) -> None:
        """``k`` more indices were handed out: the sampler's (dispatched) position follows."""
        self._yielded += k
        sampler = self._sampler
        if sampler._generation == self._generation:
            sampler.position = self._start + self._yielded * sampler.world_size

    def _refill(self) -> bool:
        indices = next(self._slices, None)
        if indices is None:
            return False
        self._buffer, self._items, self._at = indices, None, 0
        return True

    def __next__(self) -> int:
        if self._at >= len(self._buffer) and not self._refill():
            raise StopIteration
        if self._items is None:
            self._items = self._buffer.tolist()
        idx = self._items[self._at]
        self._at += 1
        self._advance(1)
        return idx

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` indices (fewer at the end, none when done) as one int64 array: what
        :class:`torchcache.DataLoader` reads a batch with, without a Python int per sample."""
        parts = []
        while n > 0:
            if self._at >= len(self._buffer) and not self._refill():
                break
            part = self._buffer[self._at:self._at + n]
            self._at += len(part)
            n -= len(part)
            parts.append(part)
        out = parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts
                                                else np.empty(0, dtype=np.int64))
        self._advance(len(out))
        return out

    def state_dict(self) -> dict[str, Any]:
        sampler = self._sampler
        count = self._count if self._count is not None else sampler.iteration_length(self._start)
        return {
            "format": SAMPLER_ITERATOR_STATE_FORMAT,
            "version": SAMPLER_STATE_VERSION,
            "counts": "dispatched",
            "position": self._start + self._yielded * sampler.world_size,
            "remaining": None if count is None else max(0, count - self._yielded),
            "world_size": sampler.world_size,
            **sampler._identity(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved iteration: the same indices (another world size: to its loader-epoch end)."""
        sampler = self._sampler
        checked = check_state(
            state, sampler._expected_state(SAMPLER_ITERATOR_STATE_FORMAT), _ITERATOR_FIELDS,
            "DistributedSampler iterator",
            "Load a state saved by an iterator of a DistributedSampler over the same dataset with "
            "the same seed and shuffle.",
        )
        position, remaining = checked["position"], checked["remaining"]
        if remaining is None or remaining > 0 and checked["world_size"] != sampler.world_size:
            remaining = sampler.iteration_length(position)
        if sampler._generation == self._generation:  # the live iterator: it drives the position
            sampler.position = position
        self._restart(position, remaining)


class SampleView:
    """A dataset's items in the order of ``DistributedSampler(dataset, seed=seed)`` on one rank,
    from global position :attr:`position` on: an iterable for scripts and notebooks (training
    uses :class:`torchcache.DataLoader`). Made by ``dataset.shuffle(seed)``.

    >>> view = SampleView(list("abcdef"), seed=3)
    >>> sorted(view) == list("abcdef"), list(view.seek(4)) == list(view)[4:]
    (True, True)
    """

    def __init__(self, dataset: Any, seed: int = 0, shuffle: bool = True, position: int = 0) -> None:
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle
        self.position = position_arg(position, "position")

    def seek(self, position: int) -> "SampleView":
        """The same view from global position `position` (its first item is the one there)."""
        return SampleView(self.dataset, self.seed, self.shuffle, position)

    def __iter__(self) -> Iterator[Any]:
        sampler = DistributedSampler(self.dataset, 1, 0, shuffle=self.shuffle, seed=self.seed)
        sampler.set_position(self.position)
        for index in sampler:
            yield self.dataset[index]

    def __len__(self) -> int:
        return DistributedSampler(self.dataset, 1, 0).iteration_length(self.position) or 0

    def __repr__(self) -> str:
        return (f"SampleView({type(self.dataset).__name__}, seed={self.seed}, "
                f"position={self.position})")
