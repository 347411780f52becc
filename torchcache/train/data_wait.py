"""How long a training loop waited for its data, pass by pass.

A loader's iterator adds to one :class:`PassWait` the time spent inside ``iter(loader)`` and
each ``next()``: what the loop (and the GPU it feeds) waited for the next batch, as opposed to
the time of the loop's own step between two ``next()`` calls. That difference is what tells a
user whether data loading holds training back; see ``DataLoader.data_wait_seconds``.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["PassWait", "clock"]

clock = time.perf_counter  # what a pass is timed with


class PassWait:
    """The data wait of one pass of a loader (one ``for batch in loader`` loop): seconds spent
    in ``iter()`` and ``next()`` (``wait``), batches received, and the time from ``iter()`` to
    the end of its latest ``next()`` (``seconds``). Two clock reads a batch: nothing measurable.
    """

    __slots__ = ("epoch", "batches", "wait", "started", "last")

    def __init__(self, epoch: int | None, started: float) -> None:
        self.epoch = epoch
        self.batches = 0
        self.wait = 0.0
        self.started = self.last = started

    def waited(self, began: float) -> None:
        """The loop waited from ``began`` until now (without a batch: ``iter()``)."""
        self.last = now = clock()
        self.wait += now - began

    def as_dict(self) -> dict[str, Any]:
        """What ``DataLoader.stats()`` shows of this pass."""
        seconds = self.last - self.started
        return {"epoch": self.epoch, "batches": self.batches, "data_wait_seconds": self.wait,
                "seconds": seconds, "wait_fraction": self.wait / seconds if seconds > 0 else 0.0}
