"""Resume for samplers torchcache cannot position: count the batches received, skip as many.

A sampler or batch_sampler of the user's own (torch's ``RandomSampler``, a ``BatchSampler``, a
framework's wrapper...) yields, through :class:`torchcache.DataLoader`, exactly what it yields
through torch's DataLoader. Its loader state is the number of batches the training loop received
in the current pass, plus the random state that pass started from: torch's global generator and
every generator the pass may draw from (the loader's, the sampler's, the batch sampler's). A
loader given such a state makes the same pass again (its generators set back to where they
were, torch's global generator only while the pass starts) and skips that many batches without
reading any data, as torchdata's StatefulDataLoader does. Only
:class:`torchcache.DistributedSampler` positions itself in O(1), at any world size and worker
count; with a sampler of your own the resume is exact for the same sampler, batch size and
world size.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

__all__ = ["PassStart", "pass_generators", "sampler_name", "skip_batches"]

T = TypeVar("T")


def pass_generators(*owners: Any) -> list[torch.Generator]:
    """The torch generators a pass may draw from: each owner's ``generator`` (and, for a batch
    sampler, its ``sampler``'s), each once, in a fixed order."""
    found: list[torch.Generator] = []
    for owner in owners:
        for holder in (owner, getattr(owner, "sampler", None)):
            generator = getattr(holder, "generator", None)
            if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
                found.append(generator)
    return found


def sampler_name(sampler: Any) -> str:
    """What a state says of the sampler that made its batches (its class), so a state is not
    loaded into a loader whose batches come from another kind of sampler."""
    kind = type(sampler)
    inner = getattr(sampler, "sampler", None)
    name = f"{kind.__module__}.{kind.__qualname__}"
    if inner is not None and not isinstance(inner, (int, str)):
        name += f"({type(inner).__module__}.{type(inner).__qualname__})"
    return name


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: Any, name: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a base64 str, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError) as error:
        raise ValueError(f"{name} is not base64: {error}") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class PassStart:
    """The random state a pass started from: torch's global generator (None: not recorded, the
    pass starts from whatever it is then) and each of the pass's generators."""

    def __init__(self, global_state: torch.Tensor | None, states: list[torch.Tensor]) -> None:
        self.global_state, self.states = global_state, states

    @classmethod
    def now(cls, generators: list[torch.Generator], with_global: bool = True) -> "PassStart":
        return cls(torch.get_rng_state() if with_global else None, [g.get_state() for g in generators])

    def to_json(self) -> dict[str, Any]:
        return {"torch": None if self.global_state is None else _encode(self.global_state),
                "generators": [_encode(s) for s in self.states]}

    @classmethod
    def from_json(cls, saved: Any, count: int) -> "PassStart":
        """A saved :meth:`to_json` (``state['rng']``) for a loader whose passes draw from
        ``count`` generators; TypeError/ValueError naming the field otherwise."""
        if not isinstance(saved, dict) or set(saved) != {"torch", "generators"}:
            raise ValueError("state['rng'] must be a dict with 'torch' and 'generators', as "
                             "DataLoader.state_dict() saves it")
        states = saved["generators"]
        if not isinstance(states, list):
            raise TypeError(f"state['rng']['generators'] must be a list, got {type(states).__name__}")
        if len(states) != count:
            raise ValueError(f"state['rng']['generators'] holds {len(states)} generator states, "
                             f"this loader's passes draw from {count} (the sampler, batch sampler "
                             "or loader has another generator)")
        glob = None if saved["torch"] is None else _decode(saved["torch"], "state['rng']['torch']")
        return cls(glob, [_decode(s, f"state['rng']['generators'][{i}]") for i, s in enumerate(states)])

    def check(self, generators: list[torch.Generator]) -> None:
        """ValueError if a state does not fit these generators (or torch's global one)."""
        for i, (g, s) in enumerate(zip(generators, self.states)):
            if s.numel() != g.get_state().numel():
                raise ValueError(f"state['rng']['generators'][{i}] is not a state of this "
                                 "loader's generator (another device or kind)")
        if self.global_state is not None and self.global_state.numel() != torch.get_rng_state().numel():
            raise ValueError("state['rng']['torch'] is not a state of torch's global generator")

    def replay(self, generators: list[torch.Generator], start: Callable[[], T]) -> T:
        """``start()`` as it ran when this state was recorded: the generators set back to their
        states then, and torch's global generator too while it runs (put back as it is now
        afterwards: the training loop's own random numbers are the user's to restore)."""
        for g, s in zip(generators, self.states):
            g.set_state(s)
        if self.global_state is None:
            return start()
        current = torch.get_rng_state()
        torch.set_rng_state(self.global_state)
        try:
            return start()
        finally:
            torch.set_rng_state(current)


def skip_batches(batches: Iterator[Any], count: int) -> Iterator[Any]:
    """``batches`` past its first ``count`` (index lists: nothing is read); ValueError if the
    pass is shorter (the state was saved with another sampler or dataset)."""
    for skipped in range(count):
        if next(batches, _END) is _END:
            raise ValueError(f"cannot resume: the state counts {count} batches received in this "
                             f"pass, but the sampler's pass has only {skipped}; load it into a "
                             "loader with the same sampler, batch size and dataset")
    return batches


_END = object()
