"""A torch DataLoader whose state is the number of samples the training loop received.

Samplers and workers run ahead of the training loop (prefetching), so "what the sampler
dispatched" overstates progress. This loader counts batches as they are handed to the caller and
stores that count in global stream positions; on resume it restarts the sampler there, so
prefetched-but-unreceived batches are simply produced again.

A batch is made in one of three ways: by a reader thread of this process that reads ahead
(``prefetch_batches``), by torch worker processes (``num_workers``), or in the training loop's
own thread, synchronously. Each way makes the same batches from the same function (a dataset's
``get_batch``, or its items and ``collate_fn``) and pins them with :func:`pin_batch`.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch.utils.data

from .._util.args import bool_arg, flag_arg, int_arg, number_arg, optional_int_arg
from .counted import PassStart, pass_generators, sampler_name, skip_batches
from .data_wait import PassWait, clock as _clock
from ..order.permutation import PERMUTATION_ALGORITHM
from ..order.steps import StepMap, StepSegment, check_state_steps, merge_skips
from ..order.state import check_state
from .dataset import knows_content
from .fetch_ahead import FetchAhead
from ..read.cache import TokenCache
from ..read.prefetch import BatchReader, batch_indices
from .sampler import DistributedSampler, dataset_length
from .collate import pad_collate
from .transfer import inline_small_tensors, items_become_the_batch

__all__ = ["DataLoader", "batched_reader", "pin_batch"]

_DEFAULT_PREFETCH = 4  # batches read ahead by default for a dataset with get_batch
_HANDED_KEPT = 64  # counts remembered for batches a trainer's fetcher may hold ahead (Lightning: 1)
_WAITS_KEPT = 1000  # passes whose data wait stats() remembers (the latest ones)

T_co = TypeVar("T_co", covariant=True)

LOADER_STATE_FORMAT = "torchcache.loader"
LOADER_STATE_VERSION = 4
_LOADER_FIELDS_V1 = ("format", "version", "algorithm", "counts", "consumed", "seed", "shuffle",
                     "num_samples", "window", "fingerprint", "world_size", "batch_size")
#: Version 2 adds "schedule": a mixture's resume_prefix() at the saved position (else null).
_LOADER_FIELDS_V2 = _LOADER_FIELDS_V1 + ("schedule",)
#: Version 3 adds "content": the dataset's content_identity (the data of its cache's committed
#: blocks; null for a dataset without one). Older states are checked by fingerprint only.
_LOADER_FIELDS_V3 = _LOADER_FIELDS_V2 + ("content",)
#: Version 4 adds "steps" (how the run's steps map to stream positions: segments of world size,
#: batch size and loader epoch) and "skips" (the step ranges never trained on).
_LOADER_FIELDS = _LOADER_FIELDS_V3 + ("steps", "skips")
#: The state of a loader over a sampler of the user's own: batches received in the current pass.
_COUNTED_FIELDS = ("format", "version", "counts", "batches", "num_samples", "batch_size", "sampler",
                   "fingerprint", "content", "rng")
_COUNTED_MATCHING = ("format", "version", "counts", "num_samples", "batch_size", "sampler",
                     "fingerprint")
#: Fields of a loaded state that must equal this loader's (world and batch size may change).
_MATCHING = ("format", "version", "algorithm", "counts", "num_samples", "fingerprint", "seed",
             "shuffle", "window")
_HINT = ("Resume with the same dataset/cache, seed, shuffle and torchcache version that wrote the "
         "state; to train on different data, start a new run instead of loading it.")

# Why an iterator stopped (its next() raises RuntimeError with this): a loader has one live
# iterator, whose batches its state counts; any other would continue a stream nobody counts.
_LOADED = ("this DataLoader iterator was replaced by loader.load_state_dict(): its batches would "
           "continue the old stream; call iter(loader) again (or start a new `for batch in "
           "loader` loop): the new iterator starts at the loaded state")
_REPLACED = ("this DataLoader iterator was replaced by a newer iter(loader): only the newest "
             "iterator's batches are counted in the loader's state; use the newer iterator, or "
             "call iter(loader) again")
_MOVED = ("this DataLoader iterator's sampler was moved (set_position, set_epoch or "
          "sampler.load_state_dict) after it was made, so its batches would continue the old "
          "stream; call iter(loader) again: the new iterator starts at the sampler's new position")


def batched_reader(dataset: Any) -> Callable[[Any], Any] | None:
    """``dataset.get_batch`` where the dataset makes whole batches itself, else None.

    A dataset takes part in the batched protocol by having a ``get_batch(indices)`` method (see
    :class:`DataLoader`). A subclass that redefines its items (``__getitem__`` or
    ``__getitems__``) but not ``get_batch`` is read through its items instead, since the
    inherited ``get_batch`` would not know about the change.

    >>> class Squares(torch.utils.data.Dataset):
    ...     def __len__(self): return 10
    ...     def __getitem__(self, i): return torch.tensor(i * i)
    ...     def get_batch(self, indices): return torch.as_tensor(indices) ** 2
    >>> class Cubes(Squares):
    ...     def __getitem__(self, i): return torch.tensor(i ** 3)
    >>> batched_reader(Squares()) is not None, batched_reader(Cubes()), batched_reader([1, 2])
    (True, None, None)
    """
    get_batch = getattr(dataset, "get_batch", None)
    if not callable(get_batch):
        return None
    if "get_batch" in getattr(dataset, "__dict__", ()):  # set on the instance: it wins
        return get_batch
    mro = type(dataset).__mro__

    def defined_at(name: str) -> int:  # how far up the class hierarchy ``name`` is defined
        return next((depth for depth, cls in enumerate(mro) if name in vars(cls)), len(mro))
    items_at = min(defined_at("__getitem__"), defined_at("__getitems__"))
    return get_batch if defined_at("get_batch") <= items_at else None


def pin_batch(batch: Any) -> Any:
    """``batch`` with every tensor in page-locked memory (copied there), for a faster, and
    possibly asynchronous, copy to the accelerator. Dicts, lists and tuples (named ones too)
    are walked, keeping their types where they can be rebuilt; anything else with a
    ``pin_memory()`` method is pinned by it, and other values are kept as they are.

    >>> pin_batch({"ids": [1, 2], "name": "x"})  # no tensor: nothing to pin
    {'ids': [1, 2], 'name': 'x'}
    """
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, (str, bytes)):
        return batch
    if isinstance(batch, Mapping):
        pinned = {key: pin_batch(value) for key, value in batch.items()}
        try:
            return type(batch)(pinned)
        except TypeError:  # a mapping that cannot be made from a dict
            return pinned
    if isinstance(batch, tuple):
        values = [pin_batch(value) for value in batch]
        return type(batch)(*values) if hasattr(batch, "_fields") else tuple(values)
    if isinstance(batch, list):
        return [pin_batch(value) for value in batch]
    pin = getattr(batch, "pin_memory", None)
    return pin() if callable(pin) else batch


class DataLoader(torch.utils.data.DataLoader[T_co]):
    """``torch.utils.data.DataLoader`` with exact, elastic resume via :meth:`state_dict`.

    All of torch's arguments work (sampler, batch_sampler, num_workers, prefetch_factor,
    persistent_workers, pin_memory, collate_fn, drop_last, generator, multiprocessing_context,
    ...); ``in_order=False`` is refused (counting needs the batches in order). An
    IterableDataset is read exactly as torch's DataLoader reads it, with no state (its order is
    its own: ``state_dict()`` raises TypeError). A batch that cannot be made raises from
    ``next()`` and the next batches follow, as in torch; it counts as received once the loop
    asks for the next one (a state saved right at the error resumes at it). With no sampler, a
    :class:`torchcache.DistributedSampler` is built with ``shuffle`` (default False, as in
    torch) and the keyword ``seed`` (default 0; with ``shuffle`` and a ``generator`` and no
    ``seed``, the seed is drawn from the generator once, as torch's RandomSampler draws one). A
    list or other dataset that is not torchcache's may grow or shrink between passes: its
    length is read again at every ``iter()``, as torch does.

    **Samplers of your own.** A ``sampler`` that is not a DistributedSampler, or a
    ``batch_sampler``, yields exactly the batches torch's DataLoader yields from it. The state
    then counts the batches received in the current pass, with the random state the pass
    started from (torch's global generator, and the generators of the loader and the
    samplers); a loader given that state makes the same pass again and skips those batches
    without reading them (torchcache.train.counted). That resume is exact for the same
    sampler, batch size and world size; only a :class:`torchcache.DistributedSampler` resumes
    in O(1) at another world size or worker count. The rest of this docstring describes the
    DistributedSampler's counting.

    Counting rule: an iterator started at consumed position ``C`` serves ``k`` indices per rank
    (``sampler.iteration_length(C)``, None when unbounded) in batches of ``batch_size``; the
    last batch holds ``k % batch_size`` when that is not 0 (it is dropped with drop_last).
    Right before batch ``j`` is returned, ``consumed = C + W * (samples in batches 0..j)``;
    with drop_last, the last full batch already sets ``consumed = C + W * k``, the end of the
    range, since the short remainder will never be yielded. So once the last batch of a loader
    epoch is received, ``consumed`` is that epoch's end and a resumed ``iter()`` starts the
    next loader epoch. Every ``iter()`` first moves the sampler to ``consumed``, so batches
    prefetched but never received are produced again.

    If the user moved the sampler explicitly (``set_position``, ``set_epoch`` on a fresh
    sampler, ``sampler.load_state_dict``), the next ``iter()`` adopts that position instead.

    **The batched protocol.** A dataset with a method ``get_batch(indices) -> batch`` makes
    whole batches itself: ``indices`` is a 1-D int64 numpy array of its sample indices, and the
    batch must equal what ``default_collate([dataset[i] for i in indices])`` gives (the same
    keys, dtypes, shapes and values), only made in one call instead of one per sample.
    :class:`~torchcache.TokenDataset`, :class:`~torchcache.PackedDataset` and
    :class:`~torchcache.MixtureDataset` have it, and a dataset of your own may too. With no
    ``collate_fn``, the loader makes every batch of such a dataset with ``get_batch``, in every
    mode below; other datasets (or a ``collate_fn``) go through ``__getitems__`` (or
    ``__getitem__``) and the collate function, as in torch. ``get_batch`` may be called from the
    training loop's thread and the reader thread at once: make it thread-safe (torchcache's
    are). A dataset may also offer ``compact_batch(indices)`` and ``expand_batch(compact)``
    (``expand_batch(compact_batch(i))`` equal to ``get_batch(i)``): worker processes then send
    the compact form (``compact_transfer=True``, the default), and this process expands it.
    TokenDataset's and PackedDataset's compact batches are their tokens in the cache's dtype
    (uint16: 8x less data than two int64 tensors). Datasets of one ``compact_format`` (a
    hashable attribute: equal where compact batches hold one row per sample and either
    dataset's ``expand_batch`` expands the other's alike) let a
    :class:`~torchcache.MixtureDataset` of them put its rows in order compact and expand the
    batch once. A dataset with a method
    ``plan_reads(sampler, num_workers)`` (:class:`~torchcache.TokenDataset`) is told, whenever
    an iterator starts and before any worker starts, which sampler (and how many workers) will
    read it: a remote cache with a ``cache_limit`` then fetches ahead in that order.

    **Three modes.**

    - *In-process read-ahead*, the default for a dataset with ``get_batch`` (``num_workers=0``,
      no ``collate_fn``; ``prefetch_batches=4``): while the training loop is busy between
      batches (a GPU step), a thread reads the next ones (pread, numpy and torch copies release
      the GIL, so reading overlaps the step); while the loop asks faster than batches are read,
      the loop's own thread reads the next batch, since handing batches over between threads
      would then cost more than it saves. No batch is copied between processes. This is the
      recommended setting (the README's Performance section has the measured figures, from
      ``tools/bench_read.py``). ``prefetch_batches=N`` reads any other dataset's batches ahead
      too, one batch at a time (its ``__getitem__`` is never called from two threads at once).
    - *Worker processes* (``num_workers > 0``): use them when making a batch is heavy Python
      work (custom transforms), which would hold the GIL against the training loop. Each worker
      makes whole batches (torch's ``batch_size=None`` pattern: the workers belong to an inner
      torch DataLoader over a view of the dataset whose item ``indices`` is the batch of those
      samples; ``get_worker_info().dataset`` is that view, its ``dataset`` attribute the
      dataset given). ``prefetch_factor`` and ``persistent_workers`` apply. In each worker, the
      caches the dataset reads (its ``cache``, a mixture's sources' caches) are replaced by
      pread-only copies (:meth:`TokenCache.with_map_bytes` ``(0)``) before your
      ``worker_init_fn`` runs, so the workers' RSS stays flat. A batch's tensors of up to
      128 KiB come through the pipe, larger ones in shared memory (torchcache.train.transfer).
    - *Synchronous* (``prefetch_batches=0`` and ``num_workers=0``): each batch is made when
      ``next()`` asks for it, in the loop's thread.

    ``pin_memory=True`` pins every batch in this process (:func:`pin_batch`), in every mode.
    ``timeout`` bounds the wait for a batch from the reader thread or the workers (it needs
    one of them: refused in the synchronous mode). ``prefetch_batches`` (None: 4 for a dataset
    with ``get_batch``, else 0) and ``compact_transfer`` are the loader's own arguments;
    everything else is torch's. ``prefetch_batches`` with ``num_workers > 0`` is refused.

    Resume stays exact: :meth:`state_dict` counts the batches the loop received, and prefetched
    ones are read again after resume. An abandoned iterator stops its thread when
    garbage-collected. An exception raised while making a batch is re-raised by ``next()``,
    with its traceback.

    **One live iterator**, in every mode (in-process, worker processes, persistent workers): a
    new ``iter()``, :meth:`load_state_dict`, or a move of the sampler (``set_position``,
    ``sampler.load_state_dict``) stops the previous iterator (its read-ahead is dropped, its
    workers are released unless persistent) and its ``next()`` raises RuntimeError saying to
    call ``iter(loader)`` again, rather than continue a stream the state no longer counts.

    >>> class Squares(torch.utils.data.Dataset):  # any map-style dataset; this one is batched
    ...     def __len__(self): return 10
    ...     def __getitem__(self, i): return torch.tensor(i * i)
    ...     def get_batch(self, indices): return torch.as_tensor(indices) ** 2
    >>> loader = tc.DataLoader(Squares(), batch_size=4)  # in-process, 4 batches ahead
    >>> it = iter(loader)
    >>> next(it).tolist(), loader.consumed
    ([0, 1, 4, 9], 4)
    >>> state = loader.state_dict()  # JSON-serialisable: save it with the checkpoint
    >>> resumed = tc.DataLoader(Squares(), batch_size=4)
    >>> resumed.load_state_dict(state)  # on restart
    >>> [batch.tolist() for batch in resumed]  # the batches after the last one received
    [[16, 25, 36, 49], [64, 81]]
    """

    # accelerate (read by it, nothing imported): `Accelerator.prepare` returns a loader marked
    # prepared as it is, instead of re-sharding our per-rank batches a second time, and
    # `save_state`/`load_state` carry the state_dict of a loader marked stateful.
    _is_accelerate_prepared = True
    use_stateful_dataloader = True

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: DistributedSampler | None = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Any = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        seed: int | None = None,
        prefetch_batches: int | None = None,
        compact_transfer: bool = True,
        **kwargs: Any,
    ) -> None:
        self._counted = False
        self._iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if self._iterable:  # torch's loader, as it is: its order is the dataset's own
            if seed is not None or prefetch_batches:
                raise ValueError(f"seed= and prefetch_batches= do not apply to an IterableDataset "
                                 f"({type(dataset).__name__}): it yields its own order")
            super().__init__(
                dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                generator=generator, **kwargs)
            return
        _check_loader_args(batch_size=batch_size, num_workers=num_workers,
                           pin_memory=pin_memory, timeout=timeout, seed=seed,
                           prefetch_batches=prefetch_batches,
                           compact_transfer=compact_transfer)
        # a sampler or batch sampler of the user's own: torch makes the batches' indices from
        # it, and the state counts batches (see torchcache.train.counted)
        counted = batch_sampler is not None or (sampler is not None
                                                and not isinstance(sampler, DistributedSampler))
        if counted:
            _refuse_splitting_twice(batch_sampler if batch_sampler is not None else sampler)
            if seed is not None:
                raise ValueError("seed= seeds the DistributedSampler tc.DataLoader makes when no "
                                 "sampler is given; with a sampler or batch_sampler of your own, "
                                 "seed that one")
        if not kwargs.get("in_order", True):
            raise ValueError(
                "in_order=False is not supported by torchcache.DataLoader: batches must arrive in "
                "order for the consumed-sample count (and resume) to be exact"
            )
        if not counted:
            sampler = self._own_sampler(dataset, sampler, shuffle, seed, generator)
            shuffle = None
        super().__init__(
            dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
            batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, **kwargs,
        )
        self._counted = counted
        batched = collate_fn is None and self._auto_collation and batched_reader(dataset) is not None
        if prefetch_batches is None:  # read ahead wherever batches are made whole, in-process
            prefetch_batches = _DEFAULT_PREFETCH if num_workers == 0 and batched else 0
        if prefetch_batches and num_workers:
            raise ValueError(
                f"prefetch_batches={prefetch_batches} reads ahead in a thread of this process and "
                f"needs num_workers=0 (got num_workers={num_workers}); with worker processes use "
                "prefetch_factor instead"
            )
        if timeout and not (prefetch_batches or num_workers):
            raise ValueError(
                f"timeout={timeout} bounds the wait for a batch made by the reader thread or by "
                "worker processes, but this loader makes its batches synchronously "
                "(prefetch_batches=0, num_workers=0); pass prefetch_batches > 0 or "
                "num_workers > 0, or leave timeout=0"
            )
        compact = (batched and num_workers > 0 and compact_transfer
                   and callable(getattr(dataset, "compact_batch", None))
                   and callable(getattr(dataset, "expand_batch", None)))
        how = ("compact" if compact else "batch" if batched else "items" if self._auto_collation
               else "one")
        #: What makes a batch from its indices, in this process or in a worker.
        self._make = _Batches(dataset, self.collate_fn, how)
        #: Where the workers' loader takes each batch's indices from.
        self._worker_indices: _BatchIndices | _PassIndices = (
            _PassIndices() if counted else _BatchIndices(sampler, batch_size, drop_last))
        self._worker_loader: torch.utils.data.DataLoader | None = None
        if num_workers:  # torch workers that make whole batches (torch's batch_size=None pattern)
            kwargs.pop("pin_memory_device", None)  # pinned here, once (pin_batch)
            self._worker_loader = torch.utils.data.DataLoader(
                self._make, batch_size=None, sampler=self._worker_indices,
                num_workers=num_workers, collate_fn=inline_small_tensors, pin_memory=False, timeout=timeout,
                worker_init_fn=functools.partial(_start_worker, worker_init_fn),
                multiprocessing_context=multiprocessing_context, generator=generator, **kwargs,
            )
        self._pass_start: PassStart | None = None  # (counted) the random state the pass began at
        self._pass_received = 0  # (counted) batches the loop received in the current pass
        self._resume: tuple[int, PassStart | None] | None = None  # (counted) a loaded state, for iter()
        self._consumed = 0
        self._step_map: StepMap | None = None  # the steps read so far, when they are not the default
        # step ranges never trained on (a recipe's come with its mixture: skipped_steps)
        self._skips: list[tuple[int, int]] = merge_skips(getattr(dataset, "skipped_steps", ()),
                                                         "dataset.skipped_steps")
        self._generation = 0  # bumped per iter() and load_state_dict(); stale iterators stop counting
        self._sampler_version = getattr(self.sampler, "position_version", 0)  # after our last move
        self.prefetch_batches = prefetch_batches
        self._prefetcher: weakref.ref[BatchReader] | None = None
        self._live: weakref.ref[_LiveIterator] | None = None  # the iterator state counts
        self._pristine = True  # no batch received and no state loaded yet
        # a trainer's fetcher that takes batches ahead of the training step (Lightning), and the
        # counts (consumed, pass_received, pass_start) before each of the latest batches handed
        self._fetch_ahead: FetchAhead | None = None
        self._handed: collections.deque[tuple[int, int, PassStart | None]] = \
            collections.deque(maxlen=_HANDED_KEPT)
        self._waits: collections.deque[PassWait] = collections.deque(maxlen=_WAITS_KEPT)

    @staticmethod
    def _own_sampler(dataset: Any, sampler: DistributedSampler | None, shuffle: Any, seed: int | None,
                     generator: torch.Generator | None) -> DistributedSampler:
        """The loader's DistributedSampler: the one given, or one made with ``shuffle`` (truthy,
        as torch takes it) and ``seed`` (or, with ``shuffle`` and a ``generator``, a seed drawn
        from that generator once, as torch's RandomSampler draws one from it)."""
        if sampler is None:
            shuffle = False if shuffle is None else flag_arg(shuffle, "shuffle")
            if seed is None and shuffle and generator is not None:
                seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
            return DistributedSampler(dataset, seed=0 if seed is None else seed, shuffle=shuffle)
        if seed is not None:
            raise ValueError("seed is only used when sampler is None; set it on the DistributedSampler")
        if shuffle is not None and flag_arg(shuffle, "shuffle") != sampler.shuffle:
            raise ValueError(
                f"shuffle={shuffle} contradicts sampler.shuffle={sampler.shuffle}; "
                "set shuffle on the DistributedSampler only"
            )
        if sampler.dataset_size != dataset_length(dataset):
            raise ValueError(
                f"sampler covers {sampler.dataset_size} samples but len(dataset) is {len(dataset)}; "
                "build the sampler over the same dataset"
            )
        return sampler

    @property
    def consumed(self) -> int:
        """Global stream positions the training loop has received so far (all ranks together).
        With a sampler or batch_sampler of your own: the batches received in the current pass.

        >>> loader = tc.DataLoader(range(100), batch_size=8)
        >>> it = iter(loader)
        >>> _ = [next(it) for _ in range(10)]
        >>> loader.consumed  # 10 batches of 8 (on each rank: all ranks together count)
        80

        Under Lightning, batches its fetcher took ahead of the training step are not received
        yet (torchcache.train.fetch_ahead): they are not counted here, nor in :meth:`state_dict`.
        """
        self._refuse_iterable("consumed")
        if self._counted:
            if self._resume is not None:
                return self._resume[0]
            before = self._before_held()
            return self._pass_received if before is None else before[1]
        self._adopt_sampler_moves()
        before = self._before_held()
        return self._consumed if before is None else before[0]

    @property
    def data_wait_seconds(self) -> float:
        """Seconds the training loop has waited for data in the current pass (the latest
        ``for batch in loader`` loop: a loader epoch, or its rest after a resume or a
        ``break``): the time spent inside ``iter(loader)`` and its ``next()`` calls, in this
        process, whatever makes the batches (worker processes, the read-ahead thread, this
        thread). The time of the loop's own step between two batches is not counted, so a
        wait near 0 means data keeps up; log it per epoch, or divide by the batches received
        (:meth:`stats`). 0.0 before the first ``iter()``.

        >>> loader = tc.DataLoader(range(100), batch_size=10)
        >>> _ = [batch for batch in loader]
        >>> 0 < loader.data_wait_seconds < 60
        True
        """
        self._refuse_untimed("data_wait_seconds")
        return self._waits[-1].wait if self._waits else 0.0

    def stats(self) -> list[dict[str, Any]]:
        """The data wait of this loader's passes, oldest first (the latest 1000), one dict per
        ``iter()``: ``epoch`` (the loader epoch it started in; None with a sampler of your own),
        ``batches`` (received), ``data_wait_seconds`` (see :attr:`data_wait_seconds`),
        ``seconds`` (from ``iter()`` to the end of its latest ``next()``) and ``wait_fraction``
        (``data_wait_seconds / seconds``: the share of the loop's time spent waiting for data).
        A loader made to resume starts with no history: its first pass counts from the resume.

        >>> loader = tc.DataLoader(range(100), batch_size=10)
        >>> for epoch in range(2):
        ...     _ = [batch for batch in loader]
        >>> [(s["epoch"], s["batches"]) for s in loader.stats()]
        [(0, 10), (1, 10)]
        """
        self._refuse_untimed("stats()")
        return [wait.as_dict() for wait in self._waits]

    def _refuse_untimed(self, what: str) -> None:
        if self._iterable:
            raise TypeError(f"{what}: this loader reads an IterableDataset "
                            f"({type(self.dataset).__name__}) through torch's own iterator, which "
                            "torchcache does not time; time `next(iterator)` in your loop instead")

    def _before_held(self) -> tuple[int, int, PassStart | None] | None:
        """The counts (consumed, pass_received, pass_start) as they were before the batches a
        trainer's fetcher holds ahead of the training step; None when it holds none."""
        held = self._fetch_ahead.held() if self._fetch_ahead is not None else 0
        if not held:
            return None
        if held > len(self._handed):
            raise RuntimeError(
                f"a trainer's data fetcher holds {held} batches of this DataLoader ahead of the "
                f"training step, but the loader remembers its counts before the last "
                f"{len(self._handed)} only, so its state cannot leave them out; fetch at most "
                f"{_HANDED_KEPT} batches ahead")
        return self._handed[-held]

    def _forget_held(self) -> None:
        """No fetcher holds batches of this loader any more (a load or a move of the sampler)."""
        self._fetch_ahead = None
        self._handed.clear()

    def _handing_batch(self) -> None:
        """(The live iterator, before it returns a counted batch) remember the counts before it,
        for a fetcher that holds it ahead of the training step."""
        if self._fetch_ahead is not None:
            self._handed.append((self._consumed, self._pass_received, self._pass_start))
            self._fetch_ahead.took_batch()

    def _refuse_iterable(self, what: str) -> None:
        if self._iterable:
            raise TypeError(
                f"{what}: this loader reads an IterableDataset ({type(self.dataset).__name__}), "
                "as torch's DataLoader does, and has no state: its order is the dataset's own. "
                "For exact resume use a map-style dataset (a torchcache dataset); for an "
                "IterableDataset with a state_dict() of its own, torchdata's StatefulDataLoader")

    def _samples_per_batch(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    def _adopt_sampler_moves(self) -> None:
        """If the user moved the sampler explicitly (set_position, set_epoch on a fresh sampler,
        sampler.load_state_dict), take its position as what has been consumed."""
        sampler = self.sampler
        if self._counted:
            return
        if sampler.position_version != self._sampler_version:
            self._sampler_version = sampler.position_version
            self._consumed = sampler.position
            self._read_on_from(self._steps(), self._consumed)
            self._generation += 1
            live = self._live() if self._live is not None else None
            if isinstance(live, _CountingIterator) and live.pending:
                return  # it has not started: it starts at the new position (_begin_pending)
            self._stop_live(_MOVED)
            self._forget_held()

    def _position_sampler(self, position: int) -> None:
        """Move the sampler to ``position`` without taking it for a user's move."""
        self.sampler.set_position(position)
        self._sampler_version = self.sampler.position_version

    def _start(self) -> tuple[int, int | None, int]:
        """Move the sampler to the consumed position for a new iterator; -> (start, k, generation)."""
        self._adopt_sampler_moves()
        self._follow_dataset_length()
        self._consumed = self._past_skips(self._consumed)
        self._position_sampler(self._consumed)
        self._generation += 1
        return self._consumed, self.sampler.iteration_length(self._consumed), self._generation

    def _follow_dataset_length(self) -> None:
        """A dataset that is not torchcache's (a list) may have grown or shrunk since the last
        pass: torch's samplers read its length at every ``iter()``, and so does this loader's,
        between passes. The stream then goes on at the same loader epoch (from its start if no
        batch of it was received, else from the next one) at the new length."""
        sampler = self.sampler
        if self._live is not None and self._live() is not None or not sampler.follows_length:
            return
        epoch_size = sampler.epoch_size
        if not sampler.follow_dataset_length():
            return
        epoch, into = divmod(self._consumed, epoch_size)
        self._consumed = (epoch + (into > 0)) * sampler.epoch_size
        self._position_sampler(self._consumed)
        self._read_on_from(self._steps(), self._consumed)  # later epochs have the new length

    def __iter__(self) -> Iterator[Any]:
        if self._iterable:
            return super().__iter__()
        began = _clock()  # iter() is waited for too (worker processes start here)
        fetch_ahead = FetchAhead.of_caller()
        self._follow_fetcher(fetch_ahead)
        self._stop_live(_REPLACED)
        if self._counted:
            generation = self._generation = self._generation + 1
            wait = PassWait(None, began)
            live: _LiveIterator = _PassIterator(self, self._pass_batches(), generation, wait)
        elif fetch_ahead is not None and self._pristine:
            # Lightning iterates a new loader before it calls sampler.set_epoch (resuming from
            # the end of an epoch, it loads no state and sets the next epoch): the iterator
            # starts where the sampler is at its first next(), as torch's lazy samplers do
            if self._worker_loader is None:
                _draw_base_seed(self.generator)
            generation = self._generation = self._generation + 1
            wait = PassWait(None, began)  # its epoch: where it starts (_begin_pending)
            live = _CountingIterator(self, iter(()), self._consumed, None, generation, wait,
                                     pending=True)
        else:
            start, count, generation = self._start()
            if self._worker_loader is None:  # (the workers' loader draws it itself)
                _draw_base_seed(self.generator)
            wait = PassWait(self.sampler.epoch, began)
            live = _CountingIterator(self, self._batches(take=None), start, count, generation, wait)
        self._live = weakref.ref(live)
        self._waits.append(wait)
        wait.waited(began)
        return live

    def _begin_pending(self, live: _CountingIterator) -> None:
        """Start ``live``, made by ``iter()`` before a first batch was asked for, where the
        loader is now (a move of the sampler since, e.g. Lightning's set_epoch, included)."""
        fetch_ahead, self._live = self._fetch_ahead, None  # (not stopped by a move it follows)
        start, count, generation = self._start()
        self._fetch_ahead = fetch_ahead
        live.restart(self._batches(take=None), start, count, generation)
        live.data_wait.epoch = self.sampler.epoch
        live.pending = False
        self._live = weakref.ref(live)

    def _follow_fetcher(self, fetch_ahead: FetchAhead | None) -> None:
        """(At ``iter()``) ``fetch_ahead``: the trainer's fetcher that takes this iterator's
        batches, if any. The same fetcher may go on holding batches of the previous iterator
        (Lightning's CombinedLoader starts a loader again within a fetch), so its counts are
        kept; batches held by another fetcher, or by none now, were dropped: they were never
        received, and this iterator makes them again."""
        old = self._fetch_ahead
        if old is not None and fetch_ahead is not None and old.same_fetcher(fetch_ahead):
            return
        before = self._before_held()
        if before is not None and not self._counted:
            self._consumed = before[0]
        self._forget_held()
        self._fetch_ahead = fetch_ahead

    def _pass_batches(self) -> Iterator[Any]:
        """(A sampler of the user's own) a new pass's batches, as torch's DataLoader makes them:
        the index iterator first, then one draw for the workers' base seed (from ``generator``,
        else torch's global generator), the sampler's own draws at its first indices. After
        :meth:`load_state_dict`, the saved pass is made again the same way, from the random
        state it started at, and the batches it had received are skipped (nothing is read)."""
        generators = pass_generators(self, self._index_sampler)
        resume, self._resume = self._resume, None
        skip, start = resume if resume is not None else (0, None)
        self._pass_start = start if start is not None else PassStart.now(generators)
        self._pass_received = skip

        def begin() -> Iterator[Any]:
            indices = iter(self._index_sampler)
            if self._worker_loader is not None:  # its own iter() draws the base seed first
                self._worker_indices.source = _skipping_on_first(indices, skip)
                return self._batches(take=None)
            _draw_base_seed(self.generator)
            indices = skip_batches(indices, skip)
            # the sampler's first draws happen here, in this thread, not in a reader thread
            first = next(indices, _NO_BATCH)
            if first is not _NO_BATCH:
                indices = itertools.chain([first], indices)
            return self._batches(take=_take_from(indices))

        if start is None:
            return begin()
        start.check(generators)
        return start.replay(generators, begin)

    def _pass_ended(self, generation: int) -> None:
        """(Counted) the live pass was read to its end: the next one starts from scratch."""
        if generation == self._generation:
            self._pass_start, self._pass_received = None, 0

    def _batches(self, take: Callable[[], Any] | None) -> Iterator[Any]:
        """The batches of a new iterator in one of the three modes (see the class): from
        ``take()`` (each batch's indices), or from the sampler's (just set) position."""
        plan_reads = getattr(self.dataset, "plan_reads", None)
        if callable(plan_reads) and not self._counted:  # before workers start: the plan travels
            plan_reads(self.sampler, self.num_workers)
        finish = self._finish()
        if self._worker_loader is not None:
            # iter() here, not at the first next(): it fixes the sampler's start position now
            batches = iter(self._worker_loader)
            return batches if finish is None else _Finished(batches, finish)
        if take is None:  # iter(sampler) here, not in a thread or at the first next(): it fixes
            # the start now
            take = batch_indices(iter(self.sampler), self.batch_size, self.drop_last)
        make = self._make.__getitem__
        if self._make.how not in ("batch", "compact"):  # a dataset that never promised threads
            make = _one_at_a_time(make)
        read = make if finish is None else (lambda index: finish(make(index)))
        if not self.prefetch_batches:
            return _Synchronous(take, read)
        reader = BatchReader(take, read, self.prefetch_batches, self.timeout)
        self._prefetcher = weakref.ref(reader)
        return reader

    def _finish(self) -> Callable[[Any], Any] | None:
        """What this process does to each batch made: expand a compact one, pin (None: nothing)."""
        expand = self.dataset.expand_batch if self._make.how == "compact" else None
        pin = self.pin_memory and _pin_device() is not None
        if expand is None:
            return pin_batch if pin else None
        return (lambda batch: pin_batch(expand(batch))) if pin else expand

    def _close_prefetcher(self) -> None:
        """Stop the read-ahead thread and drop the batches it read (they were not received)."""
        prefetcher = self._prefetcher() if self._prefetcher is not None else None
        if prefetcher is not None:
            prefetcher.close()
        self._prefetcher = None

    def _stop_live(self, reason: str) -> None:
        """Stop the live iterator (its ``next()`` then raises RuntimeError(``reason``)), its
        prefetch thread and the batches it read ahead (they were not received)."""
        self._close_prefetcher()
        live = self._live() if self._live is not None else None
        if live is not None:
            live.stop(reason)
        self._live = None

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields on this rank, from the consumed position.

        While Lightning's fetcher iterates the loader: the batches of the whole loader epoch
        under way, from its start. Lightning reads the length after loading a checkpoint's state
        and counts an epoch's batches from its start (also when it resumes mid-epoch), for every
        epoch after it too.

        >>> len(tc.DataLoader(range(10), batch_size=4))
        3
        """
        if self._counted or self._iterable:
            return super().__len__()
        self._follow_dataset_length()
        position = self.consumed
        epoch_size = self.sampler.epoch_size
        if self._fetch_ahead is not None and epoch_size:
            position -= position % epoch_size
        count = self.sampler.iteration_length(position)
        if count is None:
            raise TypeError("an infinite DataLoader without max_epochs/max_samples has no len()")
        return _num_batches(count, self._samples_per_batch(), self.drop_last)

    # ------------------------------------------------------------ steps: provenance and skips
    def _epoch_size(self, world_size: int) -> int | None:
        """Positions per loader epoch at `world_size` (None: the sampler never ends an epoch)."""
        sampler = self.sampler
        if sampler.infinite:
            return None
        n = sampler.dataset_size
        return world_size * (n // world_size if sampler.drop_last else -(-n // world_size))

    def _steps(self) -> StepMap:
        """How every step of the run maps to stream positions: the segments read before the
        state this loader loaded, then this loader's own batching (see order.steps)."""
        if self._step_map is None:
            sampler = self.sampler
            self._step_map = StepMap([StepSegment(0, 0, sampler.world_size, self._samples_per_batch(),
                                                  self._epoch_size(sampler.world_size),
                                                  self.drop_last)])
        return self._step_map

    def _read_on_from(self, steps: StepMap, position: int) -> None:
        """Take `steps` as the run's so far, read on from `position` with this loader's batching."""
        sampler = self.sampler
        self._step_map = steps.continued(steps.step_at(position), position, sampler.world_size,
                                         self._samples_per_batch(),
                                         self._epoch_size(sampler.world_size), self.drop_last)

    def _refuse_steps(self, what: str) -> None:
        self._refuse_iterable(what)
        if self._counted:
            raise TypeError(f"{what} needs the loader's own tc.DistributedSampler: with a sampler "
                            "of your own, a step's samples depend on its random draws")
        if self.sampler.growing:
            raise ValueError(f"{what}: the cache is still being built, so its loader epochs (and "
                             "the steps in them) are not fixed yet; wait for the build to finish")

    @property
    def step(self) -> int:
        """The global step (batch of all ranks) the next batch belongs to: steps received so
        far, skipped ones included.

        >>> loader = tc.DataLoader(range(100), batch_size=8)
        >>> _ = next(iter(loader)); loader.step
        1
        """
        self._refuse_steps("step")
        return self._steps().step_at(self.consumed)

    def step_samples(self, step: int) -> list[int]:
        """The dataset indices of global batch `step`, all ranks together, as Python ints: rank
        ``r`` of ``W`` reads ``out[r::W]``. A pure function of the loader's configuration and
        state (world and batch sizes over the run, recorded in the state; skips keep step
        numbers), for past and future steps alike; O(global batch), nothing read.

        >>> loader = tc.DataLoader(range(100), batch_size=4, shuffle=True, seed=0)
        >>> loader.step_samples(0) == next(iter(loader)).tolist()
        True
        """
        self._refuse_steps("step_samples()")
        step = int_arg(step, "step", minimum=0)
        start, stop = self._steps().positions(step)
        return self.sampler.indices_for_positions(np.arange(start, stop, dtype=np.int64)).tolist()

    def skip_steps(self, start: int, end: int) -> None:
        """Never train on global steps [start, end): once the loader reaches step ``start`` it
        goes on with step ``end`` (the usual answer to a loss spike). Step numbers keep counting
        data, so :meth:`step_samples` of later steps is unchanged. Recorded in the state, so a
        resume at any world size or worker count skips the same steps. A range that overlaps
        steps already received is a ValueError: to redo those, load an earlier state.

        >>> loader = tc.DataLoader(range(100), batch_size=4)
        >>> loader.skip_steps(1, 3)
        >>> [batch.tolist() for batch, _ in zip(loader, range(2))]
        [[0, 1, 2, 3], [12, 13, 14, 15]]
        """
        self._refuse_steps("skip_steps()")
        start = int_arg(start, "start", minimum=0)
        end = int_arg(end, "end", minimum=start + 1)
        current = self._steps().step_at(self._consumed)
        if start < current:
            raise ValueError(f"cannot skip steps [{start}, {end}): steps before {current} were "
                             "already received; to train differently from an earlier step, load "
                             "a state saved before it and skip from there")
        self._skips = merge_skips(self._skips + [(start, end)])

    def _with_dataset_skips(self, saved: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """A loaded state's skips and the dataset's own (a recipe's), which may have been added
        since the state was saved, but only for steps not received yet."""
        current = self._steps().step_at(self._consumed)
        for start, end in getattr(self.dataset, "skipped_steps", ()):
            done = min(end, current)
            if start < done and not any(a <= start and done <= b for a, b in saved):
                raise ValueError(f"the dataset (its recipe) skips steps [{start}, {end}), but this "
                                 f"state was saved at step {current}, after steps {start}.."
                                 f"{done - 1} were trained on; load a state saved before step "
                                 f"{start} to skip them, or start the skip at step {current} or later")
        return merge_skips(saved + list(getattr(self.dataset, "skipped_steps", ())))

    @property
    def skipped_steps(self) -> list[tuple[int, int]]:
        """The step ranges this run never trains on (see :meth:`skip_steps`)."""
        return list(self._skips)

    def _past_skips(self, position: int) -> int:
        """`position`, or, if the step there is skipped, the position of the first step after
        the skips."""
        if not self._skips or self._counted:
            return position
        steps = self._steps()
        step = first = steps.step_at(position)
        for start, end in self._skips:
            if start <= step < end:
                step = end
        return steps.positions(step)[0] if step != first else position

    def _jump_past_skips(self, live: "_CountingIterator") -> None:
        """If the next step of the live iterator is skipped, continue it after the skip: its
        read-ahead is dropped and it goes on from the first step after the skipped ones."""
        after = self._past_skips(self._consumed)
        if after == self._consumed:
            return
        self._close_prefetcher()
        self._consumed = after
        start, count, generation = self._start()
        live.restart(self._batches(take=None), start, count, generation)

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: the consumed global position plus what must match.

        >>> loader = tc.DataLoader(range(100), batch_size=8, shuffle=True)
        >>> _ = next(iter(loader))
        >>> state = loader.state_dict()
        >>> state["consumed"], state["seed"], state["shuffle"], state["num_samples"]
        (8, 0, True, 100)
        """
        self._refuse_iterable("state_dict()")
        if self._counted:
            return self._counted_state()
        sampler = self.sampler
        consumed = self.consumed
        fingerprint, content = self._identity(consumed)
        schedule = _prefix_as_state(self.dataset.resume_prefix(consumed)) \
            if _edits_future(self.dataset) else None
        return {
            "format": LOADER_STATE_FORMAT,
            "version": LOADER_STATE_VERSION,
            "algorithm": PERMUTATION_ALGORITHM,
            "counts": "consumed",
            "consumed": consumed,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "num_samples": None if sampler.growing else sampler.dataset_size,
            "window": sampler.window,
            "fingerprint": fingerprint,
            "world_size": sampler.world_size,
            "batch_size": self.batch_size,
            "schedule": schedule,
            "content": content,
            "steps": [segment.as_list() for segment in self._steps().segments],
            "skips": [list(skip) for skip in self._skips],
        }

    def _identity(self, consumed: int | None = None) -> tuple[str | int | None, dict[str, Any] | None]:
        """(fingerprint, content identity) of the dataset, as states save them: a mixture's
        fingerprint is of what it read before ``consumed`` (None: the whole mixture's)."""
        if consumed is not None and _edits_future(self.dataset):
            fingerprint = self.dataset.resume_fingerprint(consumed)
        else:
            fingerprint = getattr(self.dataset, "fingerprint", None)
        if fingerprint is not None and not isinstance(fingerprint, (str, int)):
            fingerprint = str(fingerprint)
        return fingerprint, (self.dataset.content_identity if knows_content(self.dataset) else None)

    def _counted_state(self) -> dict[str, Any]:
        """(A sampler of the user's own) the batches received in the current pass and the random
        state the pass started from (see torchcache.train.counted)."""
        before = self._before_held()
        if self._resume is not None:  # loaded, not started yet: the state as it was loaded
            batches, start = self._resume
        elif before is not None and before[2] is not None:  # a fetcher holds batches ahead
            batches, start = before[1], before[2]
        elif self._pass_start is not None:  # a pass under way
            batches, start = self._pass_received, self._pass_start
        else:  # between passes: the next one starts from the generators as they are now
            generators = pass_generators(self, self._index_sampler)
            batches, start = 0, PassStart.now(generators, with_global=False)
        fingerprint, content = self._identity()
        return {
            "format": LOADER_STATE_FORMAT,
            "version": LOADER_STATE_VERSION,
            "counts": "batches",
            "batches": batches,
            "num_samples": len(self.dataset) if hasattr(self.dataset, "__len__") else None,
            "batch_size": self.batch_size,
            "sampler": sampler_name(self._index_sampler),
            "fingerprint": fingerprint,
            "content": content,
            "rng": start.to_json(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` starts at its consumed position.

        Refuses (ValueError) a state of another format, version, permutation algorithm, dataset
        (fingerprint or sample count), seed or shuffle, and one that identifies no dataset (null
        fingerprint and sample count where this dataset has a fingerprint). A state is also
        checked against the content of the cache(s) it was saved on (``"content"``: each cache's
        committed blocks then and :meth:`TokenCache.content_digest` of them), so a cache of other
        data is refused even where its fingerprint and size agree (built from another iterable,
        or from an input edited in place); a cache that committed more blocks since (quick
        start) is accepted. For a mixture, the sources read before the saved position are
        checked. States saved by earlier versions (1 and 2, without ``"content"``) still load,
        checked by fingerprint and size only. Every field is checked here, not at the next batch
        (TypeError/ValueError naming it): missing or unknown fields, wrong types, and a
        ``consumed`` that is not an int in ``[0, 2**62)``, for instance. World size and batch
        size may differ: the global stream simply continues.

        A live iterator is stopped (with every worker count): its ``next()`` raises
        RuntimeError saying to call ``iter(loader)`` again, which starts at the loaded state. A
        refused state changes nothing, and a live iterator goes on.

        >>> import json
        >>> first = tc.DataLoader(range(10), batch_size=4, shuffle=True)
        >>> received = next(iter(first))
        >>> saved = json.dumps(first.state_dict())  # with the checkpoint
        >>> again = tc.DataLoader(range(10), batch_size=4, shuffle=True)  # after a restart
        >>> again.load_state_dict(json.loads(saved))
        >>> rest = [batch for batch in again]  # the batches after the last one received
        >>> sorted(torch.cat([received, *rest]).tolist()) == list(range(10))
        True
        """
        if isinstance(state, Mapping) and state.get("format") == "torchcache.sampler":
            raise ValueError(
                "this is a DistributedSampler state (it counts dispatched, not consumed, samples); "
                "save and load tc.DataLoader.state_dict() instead, or load it with "
                "sampler.load_state_dict()"
            )
        self._refuse_iterable("load_state_dict()")
        counts = state.get("counts") if isinstance(state, Mapping) else None
        if self._counted or counts == "batches":
            self._load_counted(state, counts)
            return
        checked = self._checked_state(state)
        consumed = checked["consumed"]
        saved = StepMap(checked["steps"]) if "steps" in checked else \
            StepMap([StepSegment(0, 0, checked["world_size"], checked["batch_size"] or 1,
                                 self._epoch_size(checked["world_size"]), self.drop_last)])
        if "steps" in checked:  # its segments must agree with its other fields
            check_state_steps(saved, consumed, checked["world_size"], checked["batch_size"],
                              checked["num_samples"])
        self._stop_live(_LOADED)
        self._forget_held()
        self._pristine = False
        self._consumed = consumed
        self._read_on_from(saved, consumed)
        self._skips = self._with_dataset_skips(list(checked.get("skips", [])))
        self._generation += 1
        self._position_sampler(consumed)

    def _load_counted(self, state: Any, counts: Any) -> None:
        """(A sampler of the user's own) :meth:`load_state_dict`: the next ``iter()`` makes the
        saved pass again and skips the batches it had received."""
        if counts != ("batches" if self._counted else "consumed"):
            ours = "a sampler of your own (it counts batches)" if self._counted else \
                "a tc.DistributedSampler (it counts samples, and resumes at any world size)"
            raise ValueError(f"cannot load this state into DataLoader: it was saved by a loader "
                             f"whose state counts {counts!r}, and this loader reads {ours}. "
                             "Resume with the same kind of sampler that saved it")
        current = self._counted_state()
        checked = check_state(state, {k: current[k] for k in _COUNTED_MATCHING}, _COUNTED_FIELDS,
                              "DataLoader", "Resume with the same dataset, sampler and batch size "
                              "that saved the state.")
        self._check_content(checked["content"], 0)
        generators = pass_generators(self, self._index_sampler)
        start = PassStart.from_json(checked["rng"], len(generators))
        start.check(generators)
        self._stop_live(_LOADED)
        self._forget_held()
        self._generation += 1
        self._resume = (checked["batches"], start)

    def _checked_state(self, state: Any) -> dict[str, Any]:
        """``state``'s fields, every one checked against this loader (as its version saved them)."""
        current = self.state_dict()
        version = state.get("version") if isinstance(state, Mapping) else None
        fields = _LOADER_FIELDS
        if type(version) is int and version in (1, 2, 3):  # saved before "steps", "content"...
            current["version"] = version
            fields = (_LOADER_FIELDS_V1, _LOADER_FIELDS_V2, _LOADER_FIELDS_V3)[version - 1]
        mixture = _edits_future(self.dataset)
        if version == 1:
            if mixture:  # version 1 saved the whole mixture's fingerprint
                current["fingerprint"] = self.dataset.fingerprint
            return check_state(state, {k: current[k] for k in _MATCHING}, fields, "DataLoader", _HINT)
        if mixture:  # only what it read before the saved position must match
            matching = [k for k in _MATCHING if k not in ("fingerprint", "num_samples")]
            checked = check_state(state, {k: current[k] for k in matching}, fields, "DataLoader",
                                  _HINT)
            self._check_schedule(checked)
        else:
            checked = check_state(state, {k: current[k] for k in _MATCHING}, fields, "DataLoader",
                                  _HINT)
            if checked["schedule"] is not None:
                raise ValueError("cannot load this state into DataLoader: it was saved from a "
                                 "mixture, this loader does not read one. " + _HINT)
        if "content" in fields:
            self._check_content(checked["content"], checked["consumed"])
        return checked

    def _check_schedule(self, checked: Mapping[str, Any]) -> None:
        """ValueError unless this mixture reads what the state's did before its position."""
        saved = checked["schedule"]
        if saved is None:
            raise ValueError("cannot load this state into DataLoader: it was not saved from a "
                             "mixture (its schedule is null), this loader reads one. " + _HINT)
        self.dataset.check_resume(_prefix_of_state(saved), checked["consumed"])
        if checked["fingerprint"] != self.dataset.resume_fingerprint(checked["consumed"]):
            raise ValueError("cannot load this state into DataLoader: its fingerprint does not "
                             "match the schedule it describes (edited state?). " + _HINT)

    def _check_content(self, saved: Any, consumed: int) -> None:
        """ValueError unless this dataset reads the content the state was saved on."""
        dataset = self.dataset
        if not knows_content(dataset):
            if saved is not None:
                raise ValueError(f"cannot load this state into DataLoader: it records the content "
                                 f"of the cache it was saved on, this dataset "
                                 f"({type(dataset).__name__}) reads none. " + _HINT)
            return
        if saved is None:
            raise ValueError("cannot load this state into DataLoader: state['content'] is null, "
                             "but this dataset reads a cache, whose content a state records (the "
                             "state was saved from another dataset, or edited). " + _HINT)
        try:
            if _edits_future(dataset):
                dataset.check_content(saved, "state['content']", position=consumed)
            else:
                dataset.check_content(saved, "state['content']")
        except ValueError as error:
            raise ValueError(f"cannot load this state into DataLoader: {error}") from error


def _check_loader_args(*, batch_size: Any, num_workers: Any, pin_memory: Any, timeout: Any,
                       seed: Any, prefetch_batches: Any, compact_transfer: Any) -> None:
    """Type and range of the loader's own and torch's plain arguments, so a wrong one fails
    here, named, instead of failing inside torch. (``shuffle`` and ``pin_memory`` are taken for
    their truth, as torch takes them, but a string is refused.)"""
    # the types here; torch's own checks refuse, in its words, num_workers < 0, timeout < 0
    # and a drop_last that is not a bool
    optional_int_arg(batch_size, "batch_size", 1)
    int_arg(num_workers, "num_workers", None)
    flag_arg(pin_memory, "pin_memory")
    number_arg(timeout, "timeout", None)
    optional_int_arg(seed, "seed", 0)
    optional_int_arg(prefetch_batches, "prefetch_batches", 0)
    bool_arg(compact_transfer, "compact_transfer")


def _prefix_as_state(prefix: dict[str, Any]) -> dict[str, Any]:
    """A mixture's resume prefix as a state saves it (version 4): its sources as a list of
    [name, ...] sorted by name, not a mapping, so that the state's keys never depend on the
    position (torch.distributed.checkpoint loads a state into the keys of a fresh loader's)."""
    sources = prefix.get("sources")
    if isinstance(sources, Mapping):
        prefix = dict(prefix, sources=[[name, *values] for name, values in sorted(sources.items())])
    return prefix


def _prefix_of_state(saved: Any) -> Any:
    """The resume prefix a state holds, as :meth:`MixtureDataset.resume_prefix` gives it
    (states before version 4 hold the sources as a mapping already)."""
    if isinstance(saved, Mapping) and isinstance(saved.get("sources"), list):
        sources = {}
        for item in saved["sources"]:
            if not (isinstance(item, list) and item and isinstance(item[0], str)):
                raise ValueError(f"cannot load this state into DataLoader: state['schedule']"
                                 f"['sources'] holds {item!r}, not [name, ...]; the state was edited "
                                 "or corrupted")
            sources[item[0]] = list(item[1:])
        saved = dict(saved, sources=sources)
    return saved


def _edits_future(dataset: Any) -> bool:
    """A dataset (a MixtureDataset) whose saved states record only what was read before the
    saved position, so that its future may be edited (``resume_prefix``/``check_resume``)."""
    return all(callable(getattr(dataset, name, None))
               for name in ("resume_prefix", "resume_fingerprint", "check_resume"))


class _Batches(torch.utils.data.Dataset):
    """The dataset as its batches: item ``indices`` is the batch of those samples, made in one
    call (``get_batch``, ``compact_batch``) or from its items and the collate function.

    What worker processes read (torch's ``batch_size=None`` pattern: each index the sampler
    gives is a whole batch's indices), and what this process reads with in the other modes.
    ``how``: ``"batch"``, ``"compact"``, ``"items"`` (``__getitems__`` or ``__getitem__``, then
    collate) or ``"one"`` (one sample, no batching: ``collate_fn(dataset[index])``).
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[Any], Any], how: str) -> None:
        self.dataset, self.collate_fn, self.how = dataset, collate_fn, how

    def __getitem__(self, indices: Any) -> Any:
        dataset, how = self.dataset, self.how
        if how in ("batch", "compact") and not isinstance(indices, np.ndarray):
            indices = np.asarray(indices, dtype=np.int64)  # a batch sampler's list
        if how == "batch":
            return dataset.get_batch(indices)
        if how == "compact":
            return dataset.compact_batch(indices)
        if how == "one":
            return self.collate_fn(dataset[indices])
        indices = indices.tolist() if isinstance(indices, np.ndarray) else list(indices)
        get_items = getattr(dataset, "__getitems__", None)
        with items_become_the_batch(self.pads_items):
            items = get_items(indices) if get_items is not None else [dataset[i] for i in indices]
        return self.collate_fn(items)

    @functools.cached_property
    def pads_items(self) -> bool:
        """The collate function is ``pad_collate`` (or a partial of it), which returns the padded
        rows a DocumentDataset's items are as they are (torchcache.train.transfer)."""
        collate = self.collate_fn
        while isinstance(collate, functools.partial):
            collate = collate.func
        return collate is pad_collate


def _start_worker(worker_init_fn: Callable[[int], None] | None, worker_id: int) -> None:
    """First thing in a worker process: the caches its dataset reads (a dataset's ``cache``,
    and those of a mixture's sources) are replaced by copies that read with pread only
    (``map_bytes=0``), so that the worker's RSS stays flat; then the user's worker_init_fn."""
    view = torch.utils.data.get_worker_info().dataset
    _read_with_pread(view.dataset, {})
    if worker_init_fn is not None:
        worker_init_fn(worker_id)


def _read_with_pread(dataset: Any, copies: dict[int, tuple[TokenCache, TokenCache]]) -> None:
    """(In a worker) give ``dataset`` and its sources pread-only copies of their caches (one
    copy per cache: ``copies`` maps id(cache) -> (cache, its copy), the cache kept alive)."""
    cache = getattr(dataset, "cache", None)
    if isinstance(cache, TokenCache) and cache.map_bytes:
        if id(cache) not in copies:
            copies[id(cache)] = (cache, cache.with_map_bytes(0))
        dataset.cache = copies[id(cache)][1]
    sources = getattr(dataset, "datasets", None)
    if isinstance(sources, Mapping):
        for source in sources.values():
            _read_with_pread(source, copies)


class _BatchIndices(torch.utils.data.Sampler):
    """The sampler's indices in batches, for the workers' loader: each ``iter()`` starts the
    sampler at its position then (the loader sets it first)."""

    def __init__(self, sampler: DistributedSampler, batch_size: int | None, drop_last: bool) -> None:
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[Any]:
        take = batch_indices(iter(self.sampler), self.batch_size, self.drop_last)
        while (index := take()) is not None:
            yield index


def _refuse_splitting_twice(index_sampler: Any) -> None:
    """ValueError for a sampler that splits indices across ranks (a torch DistributedSampler,
    e.g. Lightning's DistributedSamplerWrapper) around a tc.DistributedSampler that is split
    across ranks already: each rank would silently read a fraction of its share."""
    outer, todo, seen = None, [(index_sampler, 0)], set()
    while todo:
        obj, depth = todo.pop()
        if obj is None or id(obj) in seen or depth > 4:
            continue
        seen.add(id(obj))
        if isinstance(obj, DistributedSampler):
            if outer is not None and obj.world_size > 1:
                raise ValueError(
                    f"the sampler given ({type(index_sampler).__name__}) splits across "
                    f"{outer.num_replicas} ranks a tc.DistributedSampler that is split across "
                    f"{obj.world_size} ranks already: each rank would read 1/{outer.num_replicas} "
                    "of its share. Pass the tc.DistributedSampler itself (with Lightning: "
                    "Trainer(use_distributed_sampler=False))")
            continue
        if isinstance(obj, torch.utils.data.DistributedSampler) and obj.num_replicas > 1:
            outer = outer or obj
        for name in ("sampler", "batch_sampler", "dataset", "_sampler", "data_source"):
            todo.append((getattr(obj, name, None), depth + 1))


def _draw_base_seed(generator: torch.Generator | None) -> None:
    """The draw torch's DataLoader makes at every ``iter()`` (its workers' base seed), from
    ``generator`` or torch's global generator: a training loop's later random numbers (and a
    RandomSampler's order) are then the same as under torch's loader."""
    torch.empty((), dtype=torch.int64).random_(generator=generator)


class _PassIndices(torch.utils.data.Sampler):
    """(A sampler of the user's own) the batches' indices of the current pass, for the workers'
    loader: the loader sets ``source`` at each ``iter()``."""

    def __init__(self) -> None:
        self.source: Iterator[Any] = iter(())

    def __iter__(self) -> Iterator[Any]:
        return self.source


_NO_BATCH = object()


def _skipping_on_first(indices: Iterator[Any], skip: int) -> Iterator[Any]:
    """``indices`` past its first ``skip`` items, skipped when the first one is asked for."""
    yield from skip_batches(indices, skip)


def _take_from(indices: Iterator[Any]) -> Callable[[], Any]:
    """``take()`` for a BatchReader over an index sampler's iterator: its next item, None at
    the end."""
    return functools.partial(next, indices, None)


def _one_at_a_time(make: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``make`` called by one thread at a time (a dataset that never said it is thread-safe)."""
    lock = threading.Lock()

    def made_alone(indices: Any) -> Any:
        with lock:
            return make(indices)
    return made_alone


class _Synchronous:
    """The synchronous mode: each batch made when asked for. A batch that cannot be made raises
    and the next ones follow (as with torch's loader); a failure to take indices ends it."""

    def __init__(self, take: Callable[[], Any], read: Callable[[Any], Any]) -> None:
        self._take, self._read, self._ended = take, read, False

    def __iter__(self) -> "_Synchronous":
        return self

    def __next__(self) -> Any:
        if self._ended:
            raise StopIteration
        try:
            index = self._take()
        except BaseException:
            self._ended = True
            raise
        if index is None:
            self._ended = True
            raise StopIteration
        return self._read(index)


def _pin_device() -> str | None:
    """The accelerator type to pin batches for, or None where torch would not pin."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is None:
        return "cuda" if torch.cuda.is_available() else None
    device = accelerator.current_accelerator() if accelerator.is_available() else None
    return None if device is None or device.type == "mps" else device.type


def _num_batches(count: int, batch_size: int, drop_last: bool) -> int:
    return count // batch_size if drop_last else -(-count // batch_size)


class _Finished:
    """The workers' batches, finished in this process (expanded, pinned); the inner iterator's
    attributes (torch's ``_workers``, ...) stay reachable through it."""

    def __init__(self, inner: Iterator[Any], finish: Callable[[Any], Any]) -> None:
        self._inner, self._finish = inner, finish

    def __iter__(self) -> "_Finished":
        return self

    def __next__(self) -> Any:
        return self._finish(next(self._inner))

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _LiveIterator:
    """A loader's live iterator: wraps the batches of one mode and counts what it returns in
    the loader (subclasses: ``_received_batch``, ``_ended``); the loader can stop it."""

    def __init__(self, loader: DataLoader, inner: Iterator[Any], generation: int,
                 wait: PassWait) -> None:
        self._loader = loader
        self._inner = inner
        self._generation = generation
        self.data_wait = wait  # this pass's time in iter() and next() (loader.stats())
        self._stopped: str | None = None  # why the loader stopped this iterator
        self._done = False
        self._failed = 0  # batches raised as errors since the last one returned

    def stop(self, reason: str) -> None:
        """No more batches: ``next()`` raises RuntimeError(``reason``) (StopIteration once
        ended). Dropping the inner iterator releases its workers (persistent ones stay with the
        loader) and read-ahead."""
        if self._stopped is None:
            self._stopped = reason
            self._inner = iter(())

    def __iter__(self) -> _LiveIterator:
        return self

    def __next__(self) -> Any:
        # the loop waits for data all the time it spends here, errors included (PassWait.waited
        # inlined, and the batch counted)
        wait, began = self.data_wait, _clock()
        try:
            batch = self._next()
        except BaseException:
            wait.last = now = _clock()
            wait.wait += now - began
            raise
        wait.last = now = _clock()
        wait.wait += now - began
        wait.batches += 1
        return batch

    def _next(self) -> Any:
        """The next batch (``__next__`` without the timing)."""
        if self._done:
            raise StopIteration
        if self._stopped is None:
            self._loader._adopt_sampler_moves()  # a sampler moved under this iterator stops it
        if self._stopped is not None:
            raise RuntimeError(self._stopped)
        counts = self._loader._generation == self._generation
        try:
            batch = next(self._inner)
        except StopIteration:
            self._done = True
            self._ended(counts)
            raise
        except Exception:
            # a batch that could not be made: the loop gets its error. It counts as received
            # once the loop asks for the next batch (it went on past it, as with torch's
            # loader); a state saved before that resumes at it, to make it again.
            self._failed += 1
            raise
        if counts:
            self._loader._handing_batch()
        for _ in range(self._failed + 1):
            self._received_batch(counts)
        self._failed = 0
        return batch

    def _received_batch(self, counts: bool) -> None:
        raise NotImplementedError

    def _ended(self, counts: bool) -> None:
        raise NotImplementedError

    def __getattr__(self, name: str) -> Any:  # torch iterator internals stay reachable
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _PassIterator(_LiveIterator):
    """(A sampler of the user's own) counts the batches of the pass as they are returned."""

    def _received_batch(self, counts: bool) -> None:
        if counts:
            self._loader._pass_received += 1

    def _ended(self, counts: bool) -> None:
        if counts:
            self._loader._pass_ended(self._generation)

    def __len__(self) -> int:
        return len(self._loader)


class _CountingIterator(_LiveIterator):
    """Advances ``loader._consumed`` (global stream positions) as batches are returned."""

    def __init__(self, loader: DataLoader, inner: Iterator[Any], start: int, count: int | None,
                 generation: int, wait: PassWait, pending: bool = False) -> None:
        super().__init__(loader, inner, generation, wait)
        self._start = start
        self._count = count
        self._world = loader.sampler.world_size
        self._batch = loader._samples_per_batch()
        self._received = 0  # samples of this rank returned so far
        #: Not started: the first next() starts it where the loader is then (_begin_pending).
        self.pending = pending

    def restart(self, inner: Iterator[Any], start: int, count: int | None, generation: int) -> None:
        """Go on with `inner`, a new iteration from `start` (after skipped steps)."""
        self._inner, self._start, self._count, self._generation = inner, start, count, generation
        self._received = 0

    def _next(self) -> Any:
        loader = self._loader
        if self.pending and self._stopped is None:
            loader._begin_pending(self)
        if loader._skips and not self._done and self._stopped is None \
                and loader._generation == self._generation:
            loader._jump_past_skips(self)
        return super()._next()

    def _received_batch(self, counts: bool) -> None:
        loader = self._loader
        if self._count is None and loader.sampler.growing is False:
            # a growing cache just completed: this loader epoch's length is known from now on
            self._count = loader.sampler.iteration_length(self._start)
        size = self._batch
        if self._count is not None:
            size = min(size, self._count - self._received)
        self._received += size
        received = self._received
        if loader.drop_last and self._count is not None and self._count - received < self._batch:
            received = self._count  # the short remainder is dropped: this was the epoch's last batch
        if counts:
            loader._consumed = self._start + received * self._world
            loader._pristine = False

    def _ended(self, counts: bool) -> None:
        if self._count is None:
            self._count = self._loader.sampler.iteration_length(self._start)
        if self._count is not None and counts:
            self._loader._consumed = self._start + self._count * self._world

    def __len__(self) -> int:
        if self.pending:
            return len(self._loader)
        if self._count is None:
            raise TypeError("an infinite DataLoader iterator has no len()")
        return _num_batches(self._count, self._batch, self._loader.drop_last)
