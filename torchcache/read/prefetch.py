"""Reading a DataLoader's batches ahead of the training loop, in a thread of the same process.

:class:`BatchReader` yields batches in order and stops cleanly (``close()``, or when dropped).
While the training loop is busy between batches (a GPU step), a thread reads the next batches
ahead. While the loop asks for batches faster than they are read, handing each batch over from
a thread costs more than it saves (both threads need the GIL), so the loop's own thread reads
the next batch instead. Which thread reads a batch never changes the batch: batch ``k`` is
always the ``k``-th claim of indices.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["BatchReader", "batch_indices"]

_THREAD_NAME = "torchcache-prefetch"
#: readers whose thread may still run: stopped at interpreter exit (see _close_all)
_LIVE: weakref.WeakSet[BatchReader] = weakref.WeakSet()


def _close_all() -> None:
    """At exit, stop every reader's thread before the interpreter finalizes: a daemon thread
    stopped in the middle of a torch or numpy call aborts the process ("terminate called
    without an active exception"), e.g. when a training script ends before its epoch does."""
    for reader in list(_LIVE):
        reader.close(timeout=5.0)


atexit.register(_close_all)


class _Failure:
    """An exception raised while reading a batch, on its way to the training loop."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _stopped_error() -> RuntimeError:
    return RuntimeError("this DataLoader iterator was stopped: a new iter() or load_state_dict() "
                        "of its loader replaced it")


def _wait(cond: threading.Condition, ready: Callable[[], bool], timeout: float,
          thread: threading.Thread) -> None:
    """Wait on ``cond`` (held) until ``ready()``; RuntimeError after ``timeout`` s (0: never)
    or if the reading thread died without delivering."""
    step = min(1.0, timeout) if timeout else 1.0
    waited = 0.0
    while not ready():
        if not cond.wait(step):
            waited += step
            if ready():
                return
            if not thread.is_alive():
                raise RuntimeError("the DataLoader prefetch thread ended unexpectedly")
            if timeout and waited >= timeout:
                raise RuntimeError(f"DataLoader timed out after {timeout} seconds")


# ---------------------------------------------------------------- the reader

class _ReaderState:
    """The claims and results a BatchReader shares with its thread."""

    def __init__(self, take: Callable[[], Any], read: Callable[[Any], Any], depth: int,
                 clock: Callable[[], float]) -> None:
        lock = threading.Lock()
        self.cond = threading.Condition(lock)  # the loop waits here for a batch
        self.work = threading.Condition(lock)  # the thread waits here for something to read
        self.take, self.read, self.depth, self.clock = take, read, depth, clock
        self.claimed = 0  # batches whose indices were taken (numbered in that order)
        self.wanted = 0  # the next batch the loop receives
        self.end: int | None = None  # number of batches, once the indices ran out
        self.claiming = False  # someone is taking indices (outside the lock)
        self.results: dict[int, Any] = {}
        self.ahead = True  # the thread reads ahead (the loop is busy between batches)
        self.read_s = 0.0  # recent time to read a batch
        self.stop = False
        self.loop_waits = False  # the loop waits on cond (nobody else does): notify it then only

    def wake_loop(self) -> None:
        if self.loop_waits:
            self.cond.notify_all()

    def drop(self) -> None:
        self.results.clear()
        self.cond.notify_all()
        self.work.notify_all()

    def claim(self) -> tuple[int, Any] | None:
        """Take the next batch's indices (lock held on entry and exit, released while taking)."""
        self.claiming = True
        self.cond.release()
        try:
            index = self.take()
        finally:
            self.cond.acquire()
            self.claiming = False
            self.wake_loop()
            if self.ahead:
                self.work.notify()
        if index is None:
            self._ran_out()
            return None
        k = self.claimed
        self.claimed += 1
        return k, index

    def claim_and_read(self) -> tuple[bool, Any]:
        """Take the next batch's indices and read the batch in this thread, releasing the lock
        once for both (lock held on entry and exit): ``(True, batch)`` (the batch is numbered
        ``claimed - 1`` and kept nowhere), or ``(False, None)`` at the end. An error taking the
        indices is raised; one reading them is returned as a _Failure."""
        self.claiming = True
        self.cond.release()
        try:
            index = self.take()
            if index is not None:
                item = self._timed_read(index)
        finally:
            self.cond.acquire()
            self.claiming = False
        if index is None:
            self._ran_out()
            return False, None
        self.claimed += 1
        if self.ahead:
            self.work.notify()
        return True, item

    def _ran_out(self) -> None:
        """No more indices (lock held): the batches end where the claims stopped, and the thread,
        with nothing more to read, ends."""
        if self.end is None:
            self.end = self.claimed
        self.work.notify()

    def fill(self, k: int, index: Any) -> None:
        """Read batch ``k`` (lock held on entry and exit, released while reading)."""
        self.cond.release()
        try:
            item = self._timed_read(index)
        finally:
            self.cond.acquire()
        self.results[k] = item
        self.wake_loop()

    def _timed_read(self, index: Any) -> Any:
        """``read(index)``, or the _Failure it raised; updates the recent read time (the
        attribute is only a hint for the ahead decision: written without the lock)."""
        start = self.clock()
        try:
            item: Any = self.read(index)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            item = _Failure(e)
        spent = self.clock() - start
        self.read_s = spent if not self.read_s else 0.8 * self.read_s + 0.2 * spent
        return item


def _read_ahead(state: _ReaderState) -> None:
    with state.cond:
        while True:
            while not state.stop and state.end is None and (
                    not state.ahead or state.claiming or state.claimed - state.wanted >= state.depth):
                state.work.wait()
            if state.stop or state.end is not None:
                return
            try:
                job = state.claim()
            except BaseException as e:  # noqa: BLE001 - taking indices failed: the loop gets it
                state.results[state.claimed] = _Failure(e)  # in order, as the next batch
                state.claimed += 1
                state.end = state.claimed
                state.wake_loop()
                return
            if job is None:
                return
            state.fill(*job)


class BatchReader:
    """Batches ``read(take())``, in order: read ahead in a thread while the loop is busy
    between batches, and in the loop's own thread while it waits for them (see the module).

    ``take()`` gives the next batch's indices, or None at the end; it is only ever called by one
    thread at a time, in batch order. ``read(indices)`` may run in either thread. ``clock``
    measures the loop's time between batches and the reads (tests give a fake one).
    """

    #: Read ahead in the thread while the loop spends more than this share of a batch's read
    #: time between two next() calls; below it the loop reads itself.
    AHEAD_SHARE = 0.5

    def __init__(self, take: Callable[[], Any], read: Callable[[Any], Any], depth: int,
                 timeout: float = 0, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._state = _ReaderState(take, read, depth, clock)
        self._timeout = timeout
        self._finished = False
        self._returned_at: float | None = None
        self._busy_s = 0.0  # recent time the loop spends between next() calls
        self._thread = threading.Thread(target=_read_ahead, args=(self._state,), name=_THREAD_NAME,
                                        daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and drop the batches it read ahead."""
        state = self._state
        with state.cond:
            state.stop = True
            state.drop()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __del__(self) -> None:
        try:
            self.close(timeout=1.0)
        except Exception:
            pass

    def __iter__(self) -> BatchReader:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        now = self._clock()
        state = self._state
        with state.cond:
            if state.stop:
                raise _stopped_error()
            if self._returned_at is not None:
                busy = now - self._returned_at
                self._busy_s = busy if not self._busy_s else 0.8 * self._busy_s + 0.2 * busy
                ahead = self._busy_s > self.AHEAD_SHARE * state.read_s
                if ahead != state.ahead:
                    state.ahead = ahead
                    state.work.notify()
            k = state.wanted
            while k not in state.results:
                if state.end is not None and k >= state.end:
                    self._finish()
                    raise StopIteration
                if state.claimed == k and not state.claiming:  # nobody reads it: read it here
                    try:
                        read, item = state.claim_and_read()
                    except BaseException:
                        self._finish()
                        raise
                    if read:
                        state.results[k] = item
                    continue
                state.loop_waits = True
                try:
                    _wait(state.cond, lambda: k in state.results or state.stop or (
                        state.end is not None and k >= state.end) or (
                        state.claimed == k and not state.claiming), self._timeout, self._thread)
                finally:
                    state.loop_waits = False
                if state.stop:
                    raise _stopped_error()
            item = state.results.pop(k)
            state.wanted = k + 1
            # wake the thread when half the read-ahead is used: it then reads in bursts, and
            # competes for the GIL with this thread's return to the loop less often
            if state.ahead and state.claimed - state.wanted <= state.depth // 2:
                state.work.notify()
        if isinstance(item, _Failure):  # a batch that could not be read: the next ones follow,
            raise item.error  # as with torch's loader (a failure to take indices ended it above)
        self._returned_at = self._clock()
        return item

    def _finish(self) -> None:
        """No more batches (the end, or an error): the thread stops (lock held)."""
        self._finished = True
        self._state.stop = True
        self._state.drop()


def batch_indices(indices: Iterator[int], size: int | None,
                  drop_last: bool) -> Callable[[], np.ndarray | list | int | None]:
    """``take()`` for a BatchReader: the next ``size`` indices of a sampler iterator (an array
    where the iterator has ``take``), None at the end (or before a short batch with drop_last).
    ``size=None`` (no batching): the next index itself.

    >>> take = batch_indices(iter(range(5)), 2, drop_last=True)
    >>> take(), take(), take()
    ([0, 1], [2, 3], None)
    """
    if size is None:
        return lambda: next(indices, None)
    take = getattr(indices, "take", None)

    def next_batch() -> Any:
        index = take(size) if take is not None else list(itertools.islice(indices, size))
        if not len(index) or drop_last and len(index) < size:
            return None
        return index
    return next_batch
