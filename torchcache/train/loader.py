"""A torch DataLoader whose state is the number of samples the training loop received.

Samplers and workers run ahead of the training loop (prefetching), so "what the sampler
dispatched" overstates progress. This loader counts batches as they are handed to the caller and
stores that count in global stream positions; on resume it restarts the sampler there, so
prefetched-but-unreceived batches are simply produced again.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch.utils.data
from torch.utils.data._utils.pin_memory import pin_memory as _pin_memory

from .._util.args import bool_arg, int_arg, number_arg, optional_int_arg
from ..order.permutation import PERMUTATION_ALGORITHM
from ..order.state import check_state
from .dataset import TokenDataset, knows_content
from .packed import PackedDataset
from ..read.prefetch import BatchReader, Prefetcher, batch_indices
from .sampler import DistributedSampler, dataset_length

__all__ = ["DataLoader"]

_DEFAULT_PREFETCH = 4  # batches read ahead by default for a TokenDataset/PackedDataset

LOADER_STATE_FORMAT = "torchcache.loader"
LOADER_STATE_VERSION = 3
_LOADER_FIELDS_V1 = ("format", "version", "algorithm", "counts", "consumed", "seed", "shuffle",
                     "num_samples", "window", "fingerprint", "world_size", "batch_size")
#: Version 2 adds "schedule": a mixture's resume_prefix() at the saved position (else null).
_LOADER_FIELDS_V2 = _LOADER_FIELDS_V1 + ("schedule",)
#: Version 3 adds "content": the dataset's content_identity (the data of its cache's committed
#: blocks; null for a dataset without one). Older states are checked by fingerprint only.
_LOADER_FIELDS = _LOADER_FIELDS_V2 + ("content",)
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


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with exact, elastic resume via :meth:`state_dict`.

    All of torch's arguments work (num_workers, prefetch_factor, persistent_workers,
    pin_memory, collate_fn, drop_last, multiprocessing_context, ...). The sampler must be a
    :class:`torchcache.DistributedSampler`; if none is given one is built with ``shuffle``
    (default False, as in torch: pass ``shuffle=True`` to shuffle) and the keyword ``seed``
    (default 0). ``batch_sampler`` and ``in_order=False`` are refused: counting needs known
    batch sizes in order.

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

    **Fast mode for token data, the default:** with ``num_workers=0`` (the default), no
    ``collate_fn`` and a :class:`~torchcache.TokenDataset` or :class:`~torchcache.PackedDataset`,
    batches are made in this process, each in one call (``get_batch``: the same tensors as the
    default collate), ``prefetch_batches=4`` ahead. While the training loop is busy between
    batches (a GPU step), a thread reads the next ones (pread, numpy and torch copies release the
    GIL, so reading overlaps the step); while the loop asks faster than batches are read, the
    loop's own thread reads the next batch, since handing batches over between threads would then
    cost more than it saves. No batch is copied between processes. ``prefetch_batches=0`` turns
    reading ahead off (torch's synchronous path); ``prefetch_batches=N`` also reads any other
    dataset's batches ahead, in a thread. This is the recommended setting (the README's
    Performance section has the measured figures, from ``tools/bench_read.py``). Use worker
    processes instead when making a batch is heavy Python work (custom transforms), which would
    hold the GIL against the training loop.

    **Compact transfer** (``compact_transfer=True``, the default): with worker processes, no
    ``collate_fn`` and a :class:`~torchcache.TokenDataset` (or ``PackedDataset``), workers send
    each batch as its tokens in the cache's dtype (uint16: 8x less data than two int64 tensors)
    and this process widens them to the usual int64 ``input_ids``/``labels``. The batches are identical. The
    workers then belong to an inner torch DataLoader over a view of the dataset whose items are
    those windows (``get_worker_info().dataset`` is that view; its ``dataset`` attribute is the
    dataset given); ``loader.dataset`` is the dataset given.

    Resume stays exact: :meth:`state_dict` counts the batches the loop received, and prefetched
    ones are read again after resume. An abandoned iterator stops its thread when
    garbage-collected. An exception
    in the thread is re-raised by ``next()``, with its traceback. ``pin_memory`` and ``timeout``
    apply; ``prefetch_batches`` with ``num_workers > 0`` is refused.

    ``prefetch_batches`` (None: 4 for the fast mode above, else 0) is the loader's own
    argument; everything else is torch's.

    **One live iterator**, in every mode (in-process, worker processes, persistent workers): a
    new ``iter()``, :meth:`load_state_dict`, or a move of the sampler (``set_position``,
    ``sampler.load_state_dict``) stops the previous iterator (its read-ahead is dropped, its
    workers are released unless persistent) and its ``next()`` raises RuntimeError saying to
    call ``iter(loader)`` again, rather than continue a stream the state no longer counts.

    >>> ds = tc.TokenDataset("runs/quickstart/cache", seq_len=2048)  # doctest: +SKIP
    >>> sampler = tc.DistributedSampler(ds, shuffle=True, seed=0)  # doctest: +SKIP
    >>> loader = tc.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2)  # doctest: +SKIP
    >>> for step, batch in enumerate(loader):  # doctest: +SKIP
    ...     if step % 1000 == 0:
    ...         torch.save({"loader": loader.state_dict()}, "ckpt.pt")
    >>> loader.load_state_dict(torch.load("ckpt.pt")["loader"])  # on restart  # doctest: +SKIP
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
        _check_loader_args(batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                           pin_memory=pin_memory, drop_last=drop_last, timeout=timeout, seed=seed,
                           prefetch_batches=prefetch_batches, compact_transfer=compact_transfer)
        if prefetch_batches is None:  # the fast mode wherever it applies: our batches, in-process
            fast = (num_workers == 0 and collate_fn is None and batch_size is not None
                    and _batched_dataset(dataset))
            prefetch_batches = _DEFAULT_PREFETCH if fast else 0
        if prefetch_batches and num_workers:
            raise ValueError(
                f"prefetch_batches={prefetch_batches} reads ahead in a thread of this process and "
                f"needs num_workers=0 (got num_workers={num_workers}); with worker processes use "
                "prefetch_factor instead"
            )
        if sampler is None:
            sampler = DistributedSampler(
                dataset, seed=0 if seed is None else seed, shuffle=False if shuffle is None else shuffle
            )
        elif not isinstance(sampler, DistributedSampler):
            raise TypeError(
                "sampler must be a torchcache.DistributedSampler (or a subclass), got "
                f"{type(sampler).__name__}: the loader counts consumed samples through it. "
                "Pass sampler=tc.DistributedSampler(dataset, ...) or leave sampler=None."
            )
        else:
            if seed is not None:
                raise ValueError("seed is only used when sampler is None; set it on the DistributedSampler")
            if shuffle is not None and shuffle != sampler.shuffle:
                raise ValueError(
                    f"shuffle={shuffle} contradicts sampler.shuffle={sampler.shuffle}; "
                    "set shuffle on the DistributedSampler only"
                )
        if sampler.num_samples != dataset_length(dataset):
            raise ValueError(
                f"sampler covers {sampler.num_samples} samples but len(dataset) is {len(dataset)}; "
                "build the sampler over the same dataset"
            )
        if batch_sampler is not None:
            raise ValueError(
                "batch_sampler is not supported by torchcache.DataLoader; pass batch_size and drop_last"
            )
        if not kwargs.get("in_order", True):
            raise ValueError(
                "in_order=False is not supported by torchcache.DataLoader: batches must arrive in "
                "order for the consumed-sample count (and resume) to be exact"
            )
        super().__init__(
            dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
            collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, **kwargs,
        )
        # Compact transfer: workers of an inner torch DataLoader read token windows in the
        # cache's dtype; this process widens each batch to int64 (see _expanded).
        self._compact_loader: torch.utils.data.DataLoader | None = None
        if (compact_transfer and num_workers and collate_fn is None and batch_size is not None
                and _batched_dataset(dataset)):
            self._compact_loader = torch.utils.data.DataLoader(
                _WorkerWindows(dataset), batch_size=batch_size, sampler=sampler,
                num_workers=num_workers, pin_memory=False, drop_last=drop_last, timeout=timeout,
                worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                generator=generator, **kwargs,
            )
        self._consumed = 0
        self._generation = 0  # bumped per iter() and load_state_dict(); stale iterators stop counting
        self._sampler_version = sampler.position_version  # after the last move this loader made
        self.prefetch_batches = prefetch_batches
        self._use_get_batch = collate_fn is None
        self._prefetcher: weakref.ref[Prefetcher | BatchReader] | None = None
        self._live: weakref.ref[_CountingIterator] | None = None  # the iterator state counts

    @property
    def consumed(self) -> int:
        """Global stream positions the training loop has received so far (all ranks together).

        >>> loader.consumed  # after 10 batches of 8 on each of 4 ranks  # doctest: +SKIP
        320
        """
        self._adopt_sampler_moves()
        return self._consumed

    def _samples_per_batch(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    def _adopt_sampler_moves(self) -> None:
        """If the user moved the sampler explicitly (set_position, set_epoch on a fresh sampler,
        sampler.load_state_dict), take its position as what has been consumed."""
        sampler = self.sampler
        if sampler.position_version != self._sampler_version:
            self._sampler_version = sampler.position_version
            self._consumed = sampler.position
            self._generation += 1
            self._stop_live(_MOVED)

    def _position_sampler(self, position: int) -> None:
        """Move the sampler to ``position`` without taking it for a user's move."""
        self.sampler.set_position(position)
        self._sampler_version = self.sampler.position_version

    def _start(self) -> tuple[int, int | None, int]:
        """Move the sampler to the consumed position for a new iterator; -> (start, k, generation)."""
        self._adopt_sampler_moves()
        self._position_sampler(self._consumed)
        self._generation += 1
        return self._consumed, self.sampler.iteration_length(self._consumed), self._generation

    def __iter__(self) -> Iterator[Any]:
        self._stop_live(_REPLACED)
        start, count, generation = self._start()
        live = _CountingIterator(self, self._batches(), start, count, generation)
        self._live = weakref.ref(live)
        return live

    def _batches(self) -> Iterator[Any]:
        """The batches of a new iterator, from the sampler's (just set) position."""
        if self._compact_loader is not None:
            # iter() here, not at the first next(): it fixes the sampler's start position now
            return self._expanded(iter(self._compact_loader))
        if not self.prefetch_batches:
            return super().__iter__()
        # iter(sampler) here, not in the thread: it fixes the start position before returning
        indices = iter(self.sampler)
        get_batch = self._batch_maker()
        if get_batch is not None:  # our own batches: read ahead, or in this thread when waiting
            prefetcher: Prefetcher | BatchReader = BatchReader(
                batch_indices(indices, self.batch_size, self.drop_last), get_batch,
                self.prefetch_batches, self.timeout)
        else:
            prefetcher = Prefetcher(self._read_batches(indices), self.prefetch_batches, self.timeout)
        self._prefetcher = weakref.ref(prefetcher)
        return prefetcher

    def _batch_maker(self) -> Any:
        """``indices -> batch`` for a TokenDataset/PackedDataset read whole (pinned if asked),
        or None where batches go through items and a collate_fn."""
        if not (self._use_get_batch and self.batch_size is not None and _batched_dataset(self.dataset)):
            return None
        get_batch = self.dataset.get_batch
        device = _pin_device() if self.pin_memory else None
        if device is None:
            return get_batch
        if (getattr(get_batch, "__func__", None) is TokenDataset.get_batch  # not overridden
                and not self.dataset.document_boundaries):  # widened straight into pinned tensors
            into, pinned = self.dataset._get_batch_into, _pinned_int64
            return lambda index: into(index, pinned)
        return lambda index: _pin_memory(get_batch(index), device)

    def _read_batches(self, indices: Iterator[int]) -> Iterator[Any]:
        """The batches of one iter(), as torch's single-process iterator makes them (run in the
        Prefetcher's thread): items through ``__getitems__`` or ``__getitem__``, then collate."""
        dataset, size = self.dataset, self.batch_size
        device = _pin_device() if self.pin_memory else None
        get_items = getattr(dataset, "__getitems__", None)
        next_batch = None if size is None else batch_indices(indices, size, self.drop_last)
        while True:
            if next_batch is None:
                index = next(indices, None)
                if index is None:
                    return
                batch = self.collate_fn(dataset[index])
            else:
                index = next_batch()
                if index is None:
                    return
                index = index.tolist() if isinstance(index, np.ndarray) else index
                batch = self.collate_fn(get_items(index) if get_items else [dataset[i] for i in index])
            yield batch if device is None else _pin_memory(batch, device)

    def _expanded(self, compact_batches: Iterator[Any]) -> Iterator[Any]:
        """The inner loader's compact batches, widened to the dataset's batches here."""
        device = _pin_device() if self.pin_memory else None
        return _Expanding(compact_batches, self.dataset.expand_batch, device)

    def _stop_live(self, reason: str) -> None:
        """Stop the live iterator (its ``next()`` then raises RuntimeError(``reason``)), its
        prefetch thread and the batches it read ahead (they were not received)."""
        prefetcher = self._prefetcher() if self._prefetcher is not None else None
        if prefetcher is not None:
            prefetcher.close()
        self._prefetcher = None
        live = self._live() if self._live is not None else None
        if live is not None:
            live.stop(reason)
        self._live = None

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields on this rank, from the consumed position.

        >>> len(tc.DataLoader(range(10), batch_size=4))  # doctest: +SKIP
        3
        """
        count = self.sampler.iteration_length(self.consumed)
        if count is None:
            raise TypeError("an infinite DataLoader without max_epochs/max_samples has no len()")
        return _num_batches(count, self._samples_per_batch(), self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: the consumed global position plus what must match.

        >>> state = loader.state_dict()  # doctest: +SKIP
        >>> state["consumed"], state["fingerprint"]  # doctest: +SKIP
        (320, '9c1f.../seq2048')
        """
        sampler = self.sampler
        consumed = self.consumed
        schedule = None
        if _edits_future(self.dataset):
            fingerprint = self.dataset.resume_fingerprint(consumed)
            schedule = self.dataset.resume_prefix(consumed)
        else:
            fingerprint = getattr(self.dataset, "fingerprint", None)
        if fingerprint is not None and not isinstance(fingerprint, (str, int)):
            fingerprint = str(fingerprint)
        return {
            "format": LOADER_STATE_FORMAT,
            "version": LOADER_STATE_VERSION,
            "algorithm": PERMUTATION_ALGORITHM,
            "counts": "consumed",
            "consumed": consumed,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "num_samples": None if sampler.growing else sampler.num_samples,
            "window": sampler.window,
            "fingerprint": fingerprint,
            "world_size": sampler.world_size,
            "batch_size": self.batch_size,
            "schedule": schedule,
            "content": self.dataset.content_identity if knows_content(self.dataset) else None,
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

        >>> loader.load_state_dict(json.loads(Path("loader.json").read_text()))  # doctest: +SKIP
        >>> batch = next(iter(loader))  # the batch after the last one the saved run received  # doctest: +SKIP
        """
        if isinstance(state, Mapping) and state.get("format") == "torchcache.sampler":
            raise ValueError(
                "this is a DistributedSampler state (it counts dispatched, not consumed, samples); "
                "save and load tc.DataLoader.state_dict() instead, or load it with "
                "sampler.load_state_dict()"
            )
        consumed = self._checked_state(state)["consumed"]
        self._stop_live(_LOADED)
        self._consumed = consumed
        self._generation += 1
        self._position_sampler(consumed)

    def _checked_state(self, state: Any) -> dict[str, Any]:
        """``state``'s fields, every one checked against this loader (as its version saved them)."""
        current = self.state_dict()
        version = state.get("version") if isinstance(state, Mapping) else None
        fields = _LOADER_FIELDS
        if type(version) is int and version in (1, 2):  # saved before "content" (and "schedule")
            current["version"] = version
            fields = _LOADER_FIELDS_V1 if version == 1 else _LOADER_FIELDS_V2
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
        self.dataset.check_resume(saved, checked["consumed"])
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


def _check_loader_args(*, batch_size: Any, shuffle: Any, num_workers: Any, pin_memory: Any,
                       drop_last: Any, timeout: Any, seed: Any, prefetch_batches: Any,
                       compact_transfer: Any) -> None:
    """Type and range of the loader's own and torch's plain arguments, so a wrong one fails
    here, named, instead of being taken as true (``shuffle="no"``) or failing inside torch."""
    optional_int_arg(batch_size, "batch_size", 1)
    if shuffle is not None:
        bool_arg(shuffle, "shuffle")
    int_arg(num_workers, "num_workers", 0)
    bool_arg(pin_memory, "pin_memory")
    bool_arg(drop_last, "drop_last")
    number_arg(timeout, "timeout", 0)
    optional_int_arg(seed, "seed", 0)
    optional_int_arg(prefetch_batches, "prefetch_batches", 0)
    bool_arg(compact_transfer, "compact_transfer")


def _edits_future(dataset: Any) -> bool:
    """A dataset (a MixtureDataset) whose saved states record only what was read before the
    saved position, so that its future may be edited (``resume_prefix``/``check_resume``)."""
    return all(callable(getattr(dataset, name, None))
               for name in ("resume_prefix", "resume_fingerprint", "check_resume"))


def _batched_dataset(dataset: Any) -> bool:
    """A TokenDataset or PackedDataset whose items are the standard ones (no subclass changed
    __getitems__): its batches are read whole (get_batch) or sent compact (compact_batch)."""
    return any(isinstance(dataset, kind) and type(dataset).__getitems__ is kind.__getitems__
               for kind in (TokenDataset, PackedDataset))


class _WorkerWindows(torch.utils.data.Dataset):
    """A TokenDataset (or PackedDataset) seen as its compact batches' rows: what workers read
    for compact transfer.

    Item ``i`` is window ``i`` in the cache's dtype (viewed as a signed torch type), with the
    document-boundary fields when the dataset has them. ``__getitems__`` is one batched read,
    returned as a list of rows as torch's fetcher expects; the default collate stacks them back
    into :meth:`TokenDataset.compact_batch`'s batch, which :meth:`TokenDataset.expand_batch`
    widens in the main process.
    """

    def __init__(self, dataset: TokenDataset | PackedDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        batch = self.dataset.compact_batch(indices)
        return [dict(zip(batch, row)) for row in zip(*batch.values())]


def _pin_device() -> str | None:
    """The accelerator type to pin batches for, or None where torch would not pin."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is None:
        return "cuda" if torch.cuda.is_available() else None
    device = accelerator.current_accelerator() if accelerator.is_available() else None
    return None if device is None or device.type == "mps" else device.type


def _pinned_int64(shape: tuple[int, ...]) -> torch.Tensor:
    """An int64 tensor in page-locked memory (for the current accelerator)."""
    return torch.empty(shape, dtype=torch.int64, pin_memory=True)


def _num_batches(count: int, batch_size: int, drop_last: bool) -> int:
    return count // batch_size if drop_last else -(-count // batch_size)


class _Expanding:
    """Widens an inner loader iterator's compact batches; the inner iterator's attributes
    (torch's ``_workers``, ...) stay reachable through it."""

    def __init__(self, inner: Iterator[Any], expand: Any, device: str | None) -> None:
        self._inner, self._expand, self._device = inner, expand, device

    def __iter__(self) -> "_Expanding":
        return self

    def __next__(self) -> Any:
        batch = self._expand(next(self._inner))
        return batch if self._device is None else _pin_memory(batch, self._device)

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


class _CountingIterator:
    """Wraps torch's loader iterator; advances ``loader._consumed`` as batches are returned."""

    def __init__(self, loader: DataLoader, inner: Iterator[Any], start: int, count: int | None,
                 generation: int) -> None:
        self._loader = loader
        self._inner = inner
        self._start = start
        self._count = count
        self._generation = generation
        self._world = loader.sampler.world_size
        self._batch = loader._samples_per_batch()
        self._received = 0  # samples of this rank returned so far
        self._stopped: str | None = None  # why the loader stopped this iterator
        self._done = False

    def stop(self, reason: str) -> None:
        """No more batches: ``next()`` raises RuntimeError(``reason``) (StopIteration once
        ended). Dropping the inner iterator releases its workers (persistent ones stay with the
        loader) and read-ahead."""
        if self._stopped is None:
            self._stopped = reason
            self._inner = iter(())

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if self._done:
            raise StopIteration
        if self._stopped is None:
            loader._adopt_sampler_moves()  # a sampler moved under this iterator stops it
        if self._stopped is not None:
            raise RuntimeError(self._stopped)
        try:
            batch = next(self._inner)
            if self._count is None and loader.sampler.growing is False:
                # a growing cache just completed: this loader epoch's length is known from now on
                self._count = loader.sampler.iteration_length(self._start)
        except StopIteration:
            self._done = True
            if self._count is None:
                self._count = loader.sampler.iteration_length(self._start)
            if self._count is not None and loader._generation == self._generation:
                loader._consumed = self._start + self._count * self._world
            raise
        size = self._batch
        if self._count is not None:
            size = min(size, self._count - self._received)
        self._received += size
        received = self._received
        if loader.drop_last and self._count is not None and self._count - received < self._batch:
            received = self._count  # the short remainder is dropped: this was the epoch's last batch
        if loader._generation == self._generation:
            loader._consumed = self._start + received * self._world
        return batch

    def __getattr__(self, name: str) -> Any:  # torch iterator internals stay reachable
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __len__(self) -> int:
        if self._count is None:
            raise TypeError("an infinite DataLoader iterator has no len()")
        return _num_batches(self._count, self._batch, self._loader.drop_last)
