"""A torch DataLoader whose state is the number of samples the training loop received.

Samplers and workers run ahead of the training loop (prefetching), so "what the sampler
dispatched" overstates progress. This loader counts batches as they are handed to the caller and
stores that count in global stream positions; on resume it restarts the sampler there, so
prefetched-but-unreceived batches are simply produced again.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch.utils.data

from torchcache._permutation import PERMUTATION_ALGORITHM
from torchcache.sample import DistributedSampler, _check_state, _int_arg

__all__ = ["DataLoader"]

LOADER_STATE_FORMAT = "torchcache.loader"
LOADER_STATE_VERSION = 1


class DataLoader(torch.utils.data.DataLoader):
    """``torch.utils.data.DataLoader`` with exact, elastic resume via :meth:`state_dict`.

    All of torch's arguments work (num_workers, prefetch_factor, persistent_workers,
    pin_memory, collate_fn, drop_last, multiprocessing_context, ...). The sampler must be a
    :class:`torchcache.DistributedSampler`; if none is given one is built with
    ``shuffle`` (default True) and the keyword ``seed`` (default 0). ``batch_sampler`` and
    ``in_order=False`` are refused: counting needs known batch sizes in order.

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
    """

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
        **kwargs: Any,
    ) -> None:
        if sampler is None:
            sampler = DistributedSampler(
                dataset, seed=0 if seed is None else seed, shuffle=True if shuffle is None else shuffle
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
            if shuffle is not None and bool(shuffle) != sampler.shuffle:
                raise ValueError(
                    f"shuffle={shuffle} contradicts sampler.shuffle={sampler.shuffle}; "
                    "set shuffle on the DistributedSampler only"
                )
        if sampler.num_samples != len(dataset):
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
        self._consumed = 0
        self._generation = 0  # bumped per iter() and load_state_dict(); stale iterators stop counting
        self._sampler_moves = sampler._moves

    @property
    def consumed(self) -> int:
        """Global stream positions the training loop has received so far (all ranks together)."""
        self._adopt_sampler_moves()
        return self._consumed

    def _samples_per_batch(self) -> int:
        return 1 if self.batch_size is None else self.batch_size

    def _adopt_sampler_moves(self) -> None:
        """If the user moved the sampler explicitly (set_position, set_epoch on a fresh sampler,
        sampler.load_state_dict), take its position as what has been consumed."""
        sampler = self.sampler
        if sampler._moves != self._sampler_moves:
            self._sampler_moves = sampler._moves
            self._consumed = sampler.position
            self._generation += 1

    def _start(self) -> tuple[int, int | None, int]:
        """Move the sampler to the consumed position for a new iterator; -> (start, k, generation)."""
        self._adopt_sampler_moves()
        self.sampler._move_to(self._consumed)
        self._generation += 1
        return self._consumed, self.sampler.iteration_length(self._consumed), self._generation

    def __iter__(self) -> Iterator[Any]:
        start, count, generation = self._start()
        return _CountingIterator(self, super().__iter__(), start, count, generation)

    def __len__(self) -> int:
        """Batches the next ``iter()`` yields on this rank, from the consumed position."""
        count = self.sampler.iteration_length(self.consumed)
        if count is None:
            raise TypeError("an infinite DataLoader without max_epochs/max_samples has no len()")
        return _num_batches(count, self._samples_per_batch(), self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-serialisable state: the consumed global position plus what must match."""
        sampler = self.sampler
        fingerprint = getattr(self.dataset, "fingerprint", None)
        if fingerprint is not None and not isinstance(fingerprint, (str, int)):
            fingerprint = str(fingerprint)
        return {
            "format": LOADER_STATE_FORMAT,
            "version": LOADER_STATE_VERSION,
            "algorithm": PERMUTATION_ALGORITHM,
            "counts": "consumed",
            "consumed": self.consumed,
            "seed": sampler.seed,
            "shuffle": sampler.shuffle,
            "num_samples": None if sampler.growing else sampler.num_samples,
            "window": sampler.window,
            "fingerprint": fingerprint,
            "world_size": sampler.world_size,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the next ``iter()`` starts at its consumed position.

        Refuses (ValueError) a state of another format, version, permutation algorithm, dataset
        (fingerprint or sample count), seed or shuffle. World size and batch size may differ:
        the global stream simply continues. A live iterator keeps yielding its old stream but no
        longer counts; the loaded state takes effect at the next ``iter()``.
        """
        if isinstance(state, Mapping) and state.get("format") == "torchcache.sampler":
            raise ValueError(
                "this is a DistributedSampler state (it counts dispatched, not consumed, samples); "
                "save and load tc.DataLoader.state_dict() instead, or load it with "
                "sampler.load_state_dict()"
            )
        current = self.state_dict()
        expected = {k: current[k] for k in ("format", "version", "algorithm", "num_samples",
                                            "fingerprint", "seed", "shuffle", "window")}
        _check_state(
            state,
            expected,
            "DataLoader",
            "Resume with the same dataset/cache, seed, shuffle and torchcache version that wrote "
            "the state; to train on different data, start a new run instead of loading it.",
        )
        consumed = _int_arg(state.get("consumed"), "state['consumed']", 0)
        self._consumed = consumed
        self._generation += 1
        self.sampler._move_to(consumed)
        self._sampler_moves = self.sampler._moves


def _num_batches(count: int, batch_size: int, drop_last: bool) -> int:
    return count // batch_size if drop_last else -(-count // batch_size)


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

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        try:
            batch = next(self._inner)
            if self._count is None and loader.sampler.growing is False:
                # a growing cache just completed: this loader epoch's length is known from now on
                self._count = loader.sampler.iteration_length(self._start)
        except StopIteration:
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
