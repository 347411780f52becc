"""Saved training states (of a sampler, its iterator, a loader): every field checked when loaded.

A state is a small JSON dict. Loading one checks it completely, at once, not at the next batch:
its format and version first, then every field's type and range, then that it belongs to this
dataset, seed and shuffle. :class:`torchcache.DistributedSampler` and :class:`torchcache.DataLoader`
both load through :func:`check_state`. No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from .._util.args import bool_arg, int_arg, optional_int_arg, position_arg
from .steps import StepMap, StepSegment, merge_skips

__all__ = ["check_state"]


def _text_field(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return value


def _count_field(value: Any, name: str) -> int:
    return int_arg(value, name, minimum=0)


def _positive_field(value: Any, name: str) -> int:
    return int_arg(value, name, minimum=1)


def _optional_count_field(value: Any, name: str) -> int | None:
    return optional_int_arg(value, name, minimum=0)


def _optional_positive_field(value: Any, name: str) -> int | None:
    return optional_int_arg(value, name, minimum=1)


def _fingerprint_field(value: Any, name: str) -> str | int | None:
    """A dataset fingerprint as :meth:`torchcache.DataLoader.state_dict` saves it: str, int or None."""
    if value is None or isinstance(value, str):
        return value
    return int_arg(value, name, minimum=None)


def _optional_mapping_field(value: Any, name: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict or null, got {type(value).__name__}")
    return dict(value)


#: How each field a state may hold is checked (a TypeError/ValueError naming ``state[field]``).
def _steps_field(value: Any, name: str) -> list[StepSegment]:
    """A loader's step segments (see torchcache.order.steps), in order."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of step segments, got {value!r}")
    segments = [StepSegment.from_list(item, f"{name}[{k}]") for k, item in enumerate(value)]
    StepMap(segments)  # checks the order
    return segments


def _skips_field(value: Any, name: str) -> list[tuple[int, int]]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of [start, end] step ranges, got {value!r}")
    merged = merge_skips(value, name)
    if merged != [tuple(x) for x in value]:
        raise ValueError(f"{name} must be sorted, non-overlapping [start, end] ranges, got {value!r}")
    return merged


_STATE_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "format": _text_field,
    "version": _count_field,
    "algorithm": _text_field,
    "counts": _text_field,
    "seed": _count_field,
    "shuffle": bool_arg,
    # len(dataset) (DistributedSampler.dataset_size), not torch's per-rank num_samples: the
    # saved name predates that attribute and stays, so that saved states keep their meaning.
    "num_samples": _optional_count_field,
    "window": _optional_positive_field,
    "fingerprint": _fingerprint_field,
    "world_size": _positive_field,
    "batch_size": _optional_positive_field,
    "position": position_arg,
    "consumed": position_arg,
    "remaining": _optional_count_field,
    "schedule": _optional_mapping_field,
    "content": _optional_mapping_field,
    # a loader over a sampler of the user's own: batches received in the pass, the sampler's
    # class, and the random state the pass started from (torchcache.train.counted)
    "batches": _count_field,
    "sampler": _text_field,
    "rng": _optional_mapping_field,
    "steps": _steps_field,
    "skips": _skips_field,
}

_IDENTITY = ("fingerprint", "num_samples")  # what says which dataset a state belongs to


def check_state(state: Any, expected: Mapping[str, Any], fields: Collection[str], what: str,
                hint: str) -> dict[str, Any]:
    """Validate a saved ``state`` of ``what`` completely; return its checked fields.

    ``fields`` are the keys the state must have, no more (``expected``'s among them). In order:
    a state of another format or version is refused first (ValueError; its other fields mean
    something else); then every field's type and range (TypeError/ValueError naming it); then
    one ValueError listing every field that differs from ``expected`` (``hint`` says what to do
    instead). A null ``"fingerprint"`` or ``"num_samples"`` (a dataset without a fingerprint, a
    cache still being built) matches anything, but not both at once for a dataset they would
    identify: see :func:`_identity_problems`.

    >>> expected = {"format": "torchcache.sampler", "version": 1, "seed": 7}
    >>> fields = ("format", "version", "seed", "consumed")
    >>> saved = {"format": "torchcache.sampler", "version": 1, "seed": 7, "consumed": 4096}
    >>> check_state(saved, expected, fields, "Sampler", "Resume with the same seed.")["consumed"]
    4096
    >>> check_state(dict(saved, seed=8), expected, fields, "Sampler", "Resume with the same seed.")
    Traceback (most recent call last):
    ValueError: cannot load this state into Sampler: seed: saved 8, this Sampler has 7. ...
    >>> check_state(dict(saved, consumed=-1), expected, fields, "Sampler", "")
    Traceback (most recent call last):
    ValueError: state['consumed'] must be >= 0, got -1
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a dict from {what}.state_dict(), got {type(state).__name__}")
    _refuse(_differences(state, expected, ("format", "version"), what), what, hint)
    checked = _checked_fields(state, fields, what)
    _refuse(_differences(checked, expected, expected, what)
            + _identity_problems(checked, expected, what), what, hint)
    return checked


def _checked_fields(state: Mapping[str, Any], fields: Collection[str], what: str) -> dict[str, Any]:
    """Each field of ``state`` through its :data:`_STATE_FIELDS` check; missing or unknown ones refused."""
    missing = [key for key in fields if key not in state]
    unknown = [key for key in state if key not in fields]
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise ValueError(f"cannot load this state into {what}: fields " + ", ".join(parts) +
                         f"; a {what} state has exactly {sorted(fields)}")
    return {key: _STATE_FIELDS[key](state[key], f"state[{key!r}]") for key in fields}


def _differences(state: Mapping[str, Any], expected: Mapping[str, Any], keys: Collection[str],
                 what: str) -> list[str]:
    """One line per key of ``keys`` whose value in ``state`` is not the expected one."""
    problems = []
    for key in keys:
        if key not in state:
            problems.append(f"{key!r} is missing")
            continue
        got, want = state[key], expected[key]
        if key in _IDENTITY and (got is None or want is None):
            continue
        if got != want or type(got) is bool and type(want) is not bool:
            problems.append(f"{key}: saved {got!r}, this {what} has {want!r}")
    return problems


def _identity_problems(state: Mapping[str, Any], expected: Mapping[str, Any],
                       what: str) -> list[str]:
    """Why nothing in ``state`` ties it to this dataset, although no field differs; or [].

    This library saves a null ``num_samples`` only while a quick-start sampler (``window``)
    trains on a cache still being built, and a null ``fingerprint`` only for a dataset that has
    none. A state that identifies nothing (both null where this dataset has a fingerprint, or
    each side knowing a different half) would load into any dataset: refused.
    """
    problems = []
    if "num_samples" in expected and state["num_samples"] is None and state["window"] is None:
        problems.append("num_samples: saved null without a window (only a quick-start state, "
                        "saved while its cache was still being built, has a null num_samples)")
    if "fingerprint" not in expected:
        return problems
    known = [key for key in _IDENTITY if state[key] is not None and expected[key] is not None]
    if not known and state["fingerprint"] != expected["fingerprint"]:
        problems.append(
            f"fingerprint and num_samples: the state has fingerprint {state['fingerprint']!r} and "
            f"num_samples {state['num_samples']!r}, this {what} has {expected['fingerprint']!r} "
            f"and {expected['num_samples']!r}, so nothing shows that the state belongs to this "
            "dataset")
    return problems


def _refuse(problems: list[str], what: str, hint: str) -> None:
    if problems:
        raise ValueError(f"cannot load this state into {what}: " + "; ".join(problems) + f". {hint}")
