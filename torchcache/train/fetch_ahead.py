"""Batches a trainer's data fetcher took from a loader ahead of the training step.

Lightning's ``_PrefetchDataFetcher`` (used for every training loader without a length: an
infinite :class:`~torchcache.DistributedSampler`) takes one batch more than the training step
has received, to know in advance whether the next one is the last; it keeps the batches taken
ahead in its list ``batches`` and drops them when it is reset (at the end of ``fit``). Lightning
saves the loader's ``state_dict()`` while that batch is held, so a state that counts every batch
the loader yielded would resume one batch late. The loader asks :class:`FetchAhead` how many of
its latest batches are held, and leaves them out of its state: they are produced again.

Lightning is never imported: its fetcher is recognised on the call stack, by its module's name,
when it starts iterating the loader. torchdata's ``StatefulDataLoader`` gets no special handling
from Lightning (2.6) and counts the held batch as yielded.

One more Lightning case would resume wrong silently: when the train dataloader is set up before
the checkpoint is restored (``trainer.estimated_stepping_batches`` read in
``configure_optimizers``, Lightning issue #20550), Lightning keeps the loader's saved state in its
fit loop and never loads it, so the data stream would start over. The first batches handed to the
fetcher look for that on the stack and raise instead.

A loader iterated by Lightning's fetcher also meets two more of Lightning's expectations (see
DataLoader): ``len()`` is the whole loader epoch's batches, and a new loader's first iterator
starts at its first ``next()``, after Lightning's ``sampler.set_epoch``.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

__all__ = ["FetchAhead"]

#: Modules of the fetchers that take batches ahead (the ``lightning`` and the older
#: ``pytorch_lightning`` distribution).
_FETCHER_MODULES = frozenset({"lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers"})
#: How far up the stack the fetcher's frame may be: fetcher -> CombinedLoader -> its mode
#: iterator (-> a list comprehension) -> the loader's ``__iter__``.
_MAX_DEPTH = 12
#: Modules of Lightning's fit loop, which keeps a checkpoint's loader states until it loads them.
_FIT_LOOP_MODULES = frozenset({"lightning.pytorch.loops.fit_loop", "pytorch_lightning.loops.fit_loop"})
#: How far up the stack from a batch handed over the fit loop's frame may be (the loader's
#: iterators, the fetcher, CombinedLoader, the training epoch loop).
_FIT_LOOP_DEPTH = 32
#: Batches handed over that check the fit loop: Lightning's prefetch (possibly before the
#: checkpoint is restored) and the training step's first batch.
_CHECKED_BATCHES = 2


class FetchAhead:
    """The list of batches one fetcher holds ahead of the training step.

    ``took_batch()`` is called whenever the loader hands a batch to the fetcher (the fetcher
    appends it to its current list right after); ``held()`` is how many batches in that list
    the training step has not received. After the fetcher is reset, its old list still holds
    the batches it dropped, so ``held()`` keeps counting them: they were never trained on.
    """

    def __init__(self, fetcher: Any) -> None:
        self._fetcher = weakref.ref(fetcher)
        self._batches: list[Any] | None = None
        self._checks = _CHECKED_BATCHES

    @classmethod
    def of_caller(cls) -> FetchAhead | None:
        """The FetchAhead of the Lightning fetcher that is iterating the caller's caller (a
        loader's ``__iter__``), or None where no such fetcher is on the stack."""
        if not any(name in sys.modules for name in _FETCHER_MODULES):
            return None  # Lightning was never imported: nothing to look for
        frame = sys._getframe(2)
        for _ in range(_MAX_DEPTH):
            if frame is None:
                return None
            if frame.f_globals.get("__name__") in _FETCHER_MODULES:
                fetcher = frame.f_locals.get("self")
                if isinstance(getattr(fetcher, "batches", None), list):
                    return cls(fetcher)
                return None  # a fetcher that takes nothing ahead (dataloader_iter)
            frame = frame.f_back
        return None

    def took_batch(self) -> None:
        """The loader is handing a batch to the fetcher: it goes into the fetcher's list now."""
        fetcher = self._fetcher()
        if fetcher is not None:
            self._batches = fetcher.batches
        if self._checks:
            self._checks -= 1
            _refuse_a_state_left_unloaded()

    def held(self) -> int:
        """Batches handed to the fetcher that the training step has not received."""
        return 0 if self._batches is None else len(self._batches)

    def same_fetcher(self, other: FetchAhead) -> bool:
        """Whether ``other`` watches the same (live) fetcher as this one."""
        fetcher = self._fetcher()
        return fetcher is not None and fetcher is other._fetcher()


def _refuse_a_state_left_unloaded() -> None:
    """RuntimeError if Lightning's fit loop, resuming from a checkpoint, still holds the saved
    loader states it should have loaded before the loader was iterated (Lightning #20550)."""
    frame = sys._getframe(1)
    for _ in range(_FIT_LOOP_DEPTH):
        if frame is None:
            return
        if frame.f_globals.get("__name__") in _FIT_LOOP_MODULES:
            loop = frame.f_locals.get("self")
            pending = getattr(loop, "_combined_loader_states_to_load", None)
            if pending and getattr(loop, "restarting", False):
                raise RuntimeError(
                    "Lightning is resuming from a checkpoint but never loaded this DataLoader's "
                    "saved state (its fit loop still holds it): the train dataloader was set up "
                    "before the checkpoint was restored, usually because configure_optimizers "
                    "read trainer.estimated_stepping_batches (Lightning issue #20550). Training "
                    "on would start the data stream over instead of resuming it. Give the "
                    "scheduler its length without estimated_stepping_batches (from max_steps, or "
                    "len(train dataloader) * max_epochs), then resume again")
            return
        frame = frame.f_back
