"""Steps: which global stream positions each global batch (a training step) reads.

A step is one global batch: every rank's j-th batch together. A loader at global position ``p``
with ``W`` ranks and ``B`` samples per rank yields steps of ``G = W * B`` consecutive positions,
up to the end of its loader epoch, where the last step may be short (or, with the loader's
``drop_last``, left out); the next epoch's steps follow. A run whose world size or batch size
changed is a list of segments, each from the step and position where the change took effect.
So the positions of any step, past or future, follow from a few numbers in the loader's state:
O(1) per step, nothing read. Skipped steps keep their numbers and positions: the loader jumps
over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["StepMap", "StepSegment", "check_state_steps", "merge_skips"]


@dataclass(frozen=True)
class StepSegment:
    """Steps from `step` on read from global position `position`, `world_size` x `batch_size`
    samples each, in loader epochs of `epoch_size` positions (None: one endless epoch)."""

    step: int
    position: int
    world_size: int
    batch_size: int
    epoch_size: int | None
    drop_last: bool = False

    def as_list(self) -> list[Any]:
        return [self.step, self.position, self.world_size, self.batch_size, self.epoch_size,
                self.drop_last]

    @classmethod
    def from_list(cls, value: Any, where: str) -> "StepSegment":
        if not (isinstance(value, (list, tuple)) and len(value) == 6):
            raise ValueError(f"{where}: a step segment is [step, position, world_size, batch_size, "
                             f"epoch_size, drop_last], got {value!r}")
        step, position, world, batch, epoch, drop = value
        ints = (step, position, world, batch) + ((epoch,) if epoch is not None else ())
        if not all(type(x) is int for x in ints) or type(drop) is not bool or step < 0 \
                or position < 0 or world < 1 or batch < 1 or (epoch is not None and epoch < world):
            raise ValueError(f"{where}: {value!r} is not a step segment")
        return cls(step, position, world, batch, epoch, drop)

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    def _first_epoch(self) -> tuple[int, int]:
        """(positions per rank, steps) of the loader epoch the segment starts in."""
        end = (self.position // self.epoch_size + 1) * self.epoch_size
        per_rank = -(-(end - self.position) // self.world_size)
        return per_rank, self._steps_of(per_rank)

    def _steps_of(self, per_rank: int) -> int:
        whole, part = divmod(per_rank, self.batch_size)
        return whole + (part > 0 and not self.drop_last)

    def positions(self, step: int) -> tuple[int, int]:
        """[start, stop) of step `step` (>= self.step) of this segment."""
        j, G, W = step - self.step, self.global_batch, self.world_size
        if self.epoch_size is None:
            return self.position + j * G, self.position + (j + 1) * G
        first_rank, first_steps = self._first_epoch()
        if j < first_steps:
            start = self.position + j * G
            return start, min(start + G, self.position + first_rank * W)
        per_rank = self.epoch_size // W  # every later epoch: a whole epoch's worth (see module)
        steps = self._steps_of(per_rank)
        if steps == 0:
            raise ValueError(f"a loader epoch of {self.epoch_size} positions holds no whole global "
                             f"batch of {G} with drop_last")
        epoch, j = divmod(j - first_steps, steps)
        base = self.position + first_rank * W + epoch * self.epoch_size
        start = base + j * G
        return start, min(start + G, base + per_rank * W)

    def step_at(self, position: int) -> int:
        """The step that starts at `position` (>= self.position), or the first one after it."""
        offset, G, W = position - self.position, self.global_batch, self.world_size
        if self.epoch_size is None:
            return self.step - (-offset // G)
        first_rank, first_steps = self._first_epoch()
        if offset <= first_rank * W:
            return self.step + min(-(-offset // G), first_steps)
        per_rank = self.epoch_size // W
        steps = self._steps_of(per_rank)
        epoch, into = divmod(offset - first_rank * W, self.epoch_size)
        return self.step + first_steps + epoch * steps + min(-(-into // G), steps)


class StepMap:
    """The positions of every step of a run, from its segments (sorted by step)."""

    def __init__(self, segments: Sequence[StepSegment]):
        if not segments or segments[0].step != 0:
            raise ValueError("a step map starts with a segment at step 0")
        for a, b in zip(segments, segments[1:]):
            if b.step < a.step or b.position < a.position:
                raise ValueError(f"step segments out of order: {a.as_list()} then {b.as_list()}")
        self.segments = list(segments)

    def _segment(self, step: int) -> StepSegment:
        found = self.segments[0]
        for segment in self.segments[1:]:
            if segment.step > step:
                break
            found = segment
        return found

    def positions(self, step: int) -> tuple[int, int]:
        """[start, stop) of global positions that step `step` reads."""
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        return self._segment(step).positions(step)

    def step_at(self, position: int) -> int:
        """The step that starts at global `position` (or the first one after it)."""
        found = self.segments[0]
        for segment in self.segments[1:]:
            if segment.position > position:
                break
            found = segment
        return found.step_at(position)

    def continued(self, step: int, position: int, world_size: int, batch_size: int,
                  epoch_size: int | None, drop_last: bool) -> "StepMap":
        """This map, read on from step `step` at global `position` by a loader batching as
        given: unchanged if that is how the map goes on from there, else with a new segment
        there. Segments before `step` stay (they say how the past was read); later ones, a
        future that was never read, go."""
        current = self._segment(step)
        same = (current.world_size, current.batch_size, current.epoch_size, current.drop_last) == \
            (world_size, batch_size, epoch_size, drop_last)
        if same and current.positions(step)[0] == position:
            return StepMap([s for s in self.segments if s.step <= current.step])
        kept = [s for s in self.segments if s.step < step]
        return StepMap(kept + [StepSegment(step, position, world_size, batch_size, epoch_size,
                                           drop_last)])


def check_state_steps(steps: StepMap, consumed: int, world_size: int, batch_size: int | None,
                      num_samples: int | None, where: str = "state") -> None:
    """ValueError unless a loader state's step segments agree with its other fields: the
    segment in effect at `consumed` batches `world_size` ranks x `batch_size` samples (when the
    state has one), `consumed` falls where a step starts or ends (a loader counts whole global
    batches received), and each segment's loader epoch is that of `num_samples` samples at its
    world size (rounded up, or down with drop_last). A state edited in one field but not the
    other would otherwise resume, and name (step_samples, skips, trace) other data than it read."""
    step = steps.step_at(consumed)
    segment = steps._segment(step)
    fix = "the state was edited or is damaged; resume from the state the loader saved"
    if (segment.world_size, segment.batch_size if batch_size is not None else None) != \
            (world_size, batch_size):
        raise ValueError(f"{where}['steps'] reads step {step} (position {consumed}) with world_size "
                         f"{segment.world_size} and batch_size {segment.batch_size}, but "
                         f"{where}['world_size'] is {world_size} and {where}['batch_size'] "
                         f"{batch_size}; {fix}")
    bounds = {steps.positions(step)[0]} | ({steps.positions(step - 1)[1]} if step > 0 else set())
    if consumed not in bounds:
        raise ValueError(f"{where}['consumed'] is {consumed}, inside global step {step - 1} "
                         f"(positions {steps.positions(step - 1)[0]}-{steps.positions(step - 1)[1]}) "
                         f"of {where}['steps'], not where a step starts or ends; {fix}")
    for k, s in enumerate(steps.segments):
        if num_samples is None or s.epoch_size is None:
            continue
        W = s.world_size
        allowed = (W * -(-num_samples // W), W * (num_samples // W))
        if s.epoch_size not in allowed:
            raise ValueError(f"{where}['steps'][{k}] has loader epochs of {s.epoch_size} positions, "
                             f"but {where}['num_samples'] {num_samples} at world size {s.world_size} "
                             f"gives {allowed[0]} (or {allowed[1]} with drop_last); {fix}")


def merge_skips(skips: Sequence[Sequence[int]], where: str = "skips") -> list[tuple[int, int]]:
    """Skip ranges [start, end) of steps, checked, sorted and merged."""
    out: list[tuple[int, int]] = []
    for item in skips:
        if not (isinstance(item, (list, tuple)) and len(item) == 2
                and all(type(x) is int for x in item) and 0 <= item[0] < item[1]):
            raise ValueError(f"{where}: {item!r} is not a step range [start, end) with "
                             "0 <= start < end")
        out.append((item[0], item[1]))
    out.sort()
    merged: list[tuple[int, int]] = []
    for start, end in out:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
