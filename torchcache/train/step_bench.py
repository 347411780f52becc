"""Would the GPU wait for data? A loader read under a simulated training step.

``torchcache bench`` reads batches of a dataset through a :class:`~torchcache.DataLoader` with a
sleep of the given step time after each one (a stand-in for the GPU's step: sleeping releases
the GIL, as a CUDA step does), and reports the loader's own measure of the time the loop waited
for data (``loader.data_wait_seconds``). The first batch is reported apart: its wait holds the
one-time start (worker processes, first remote reads), which a long run pays once.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .._util.args import int_arg, number_arg

__all__ = ["KEEPS_UP", "StepBench", "bench_steps"]

#: A wait below this share of the loop's time (after the first batch) is "data keeps up".
KEEPS_UP = 0.02


@dataclasses.dataclass(frozen=True)
class StepBench:
    """What :func:`bench_steps` measured. ``seconds``: from ``iter()`` to the end of the last
    step; ``first_wait_seconds``: the wait for the first batch, ``iter()`` included;
    ``data_wait_seconds``: the whole wait (the first batch's included)."""

    batches: int
    tokens: int
    step_seconds: float
    seconds: float
    first_wait_seconds: float
    data_wait_seconds: float

    @property
    def steady_seconds(self) -> float:
        """The time after the first batch came: ``batches - 1`` waits and ``batches`` steps."""
        return self.seconds - self.first_wait_seconds

    @property
    def steady_wait_seconds(self) -> float:
        """The wait for every batch but the first."""
        return self.data_wait_seconds - self.first_wait_seconds

    @property
    def wait_per_step(self) -> float:
        """Mean wait for one batch after the first."""
        return self.steady_wait_seconds / (self.batches - 1)

    @property
    def wait_fraction(self) -> float:
        """The share of the loop's time (after the first batch) spent waiting for data."""
        return self.steady_wait_seconds / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def batches_per_second(self) -> float:
        """Batches a second after the first batch (the training pace, steps included)."""
        return (self.batches - 1) / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.batches_per_second * self.tokens / self.batches

    @property
    def keeps_up(self) -> bool:
        return self.wait_fraction < KEEPS_UP

    def verdict(self) -> str:
        """One line: whether the GPU would wait at this step time, and how much."""
        ms = self.step_seconds * 1e3
        if self.step_seconds == 0:
            return (f"no step (--step-ms 0): the loader alone gives "
                    f"{self.batches_per_second:,.1f} batches/s")
        if self.keeps_up:
            return (f"data keeps up at a {ms:g} ms step (the loop waited "
                    f"{self.wait_fraction:.1%} of the time)")
        batch_ms = self.steady_seconds / (self.batches - 1) * 1e3
        return (f"the GPU would wait {self.wait_fraction:.0%} of the time at a {ms:g} ms step "
                f"(a batch every {batch_ms:.1f} ms here; steps of about that or longer would "
                "not wait)")


def _tokens(batch: Any) -> int:
    """Tokens in a batch: its ``input_ids`` (or the batch itself, a tensor)."""
    ids = batch["input_ids"] if isinstance(batch, dict) else batch
    return int(ids.numel())


def bench_steps(loader: Any, step_seconds: float, batches: int) -> StepBench:
    """Read ``batches`` batches from a new iterator of ``loader`` (a :class:`torchcache.DataLoader`
    over a sampler that yields at least that many, e.g. ``infinite=True``), sleeping
    ``step_seconds`` after each, and measure its data wait.

    >>> import torch
    >>> loader = tc.DataLoader(torch.arange(64), batch_size=4)
    >>> bench = bench_steps(loader, 0.001, 8)
    >>> bench.batches, bench.tokens, bench.steady_seconds >= 7 * 0.001
    (8, 32, True)
    """
    step_seconds = float(number_arg(step_seconds, "step_seconds", 0))
    batches = int_arg(batches, "batches", minimum=2)
    tokens = received = 0
    first_wait = 0.0
    started = time.perf_counter()
    iterator = iter(loader)
    for batch in iterator:
        received += 1
        tokens += _tokens(batch)
        if received == 1:
            first_wait = loader.data_wait_seconds
        time.sleep(step_seconds)
        if received == batches:
            break
    seconds = time.perf_counter() - started
    if received < batches:
        raise ValueError(f"the loader ended after {received} batches, before the {batches} asked "
                         "for; ask for fewer batches, or read over an infinite sampler")
    return StepBench(batches=received, tokens=tokens, step_seconds=step_seconds, seconds=seconds,
                     first_wait_seconds=first_wait, data_wait_seconds=loader.data_wait_seconds)
