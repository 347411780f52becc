"""tc.DataLoader: exact resume from the consumed counter, with workers, prefetch and elastic world size."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset, check_contiguous, ids, lockstep_steps, make_loader, run_until  # noqa: E402

from torchcache.train.loader import DataLoader  # noqa: E402
from torchcache.train.sampler import DistributedSampler  # noqa: E402

EPOCHS = 3


def run_epochs(loader: DataLoader, epochs: int = EPOCHS) -> list[list[int]]:
    return [ids(batch) for _ in range(epochs) for batch in loader]


def interrupted_stream(n: int, b: int, k: int, total: int, **kw) -> list[list[int]]:
    """Stop after k batches, save state through JSON, resume in a fresh loader, run to total."""
    first = make_loader(n, b, **kw)
    head = run_until(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["counts"] == "consumed"
    second = make_loader(n, b, **kw)
    second.load_state_dict(state)
    return head + run_until(second, total - k)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 90), b=st.integers(1, 9), drop_last=st.booleans(), data=st.data())
def test_resume_single_process_matches_uninterrupted(n, b, drop_last, data):
    full = run_epochs(make_loader(n, b, drop_last=drop_last))
    if len(full) < 2:
        return
    k = data.draw(st.integers(1, len(full) - 1), label="k")
    assert interrupted_stream(n, b, k, len(full), drop_last=drop_last) == full


@pytest.mark.parametrize(
    "kw, k",
    [
        ({"num_workers": 2}, 3),
        ({"num_workers": 2, "prefetch_factor": 4, "drop_last": True}, 7),
        ({"num_workers": 2, "persistent_workers": True}, 13),
    ],
    ids=["workers", "prefetch4-drop_last", "persistent"],
)
def test_resume_with_workers_matches_uninterrupted(kw, k):
    n, b = 37, 4  # 10 batches per epoch (9 with drop_last); k = 13 stops inside epoch 1
    full = run_epochs(make_loader(n, b, drop_last=kw.get("drop_last", False)))
    assert interrupted_stream(n, b, k, len(full), **kw) == full


def test_prefetched_batches_are_produced_again():
    """Breaking out of an epoch (workers prefetched ahead) and iterating again loses nothing."""
    n, b = 41, 3
    full = run_epochs(make_loader(n, b))
    loader = make_loader(n, b, num_workers=2, persistent_workers=True, prefetch_factor=3)
    got: list[list[int]] = []
    for stop_after in (2, 5):  # break out early twice, then finish the remaining epochs
        for batch in loader:
            got.append(ids(batch))
            if len(got) == stop_after:
                break
    got += run_until(loader, len(full) - len(got))
    assert got == full


def test_consumed_counts_received_batches_not_dispatched():
    loader = make_loader(20, 4, rank=1, world_size=2, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    next(it)
    next(it)
    assert loader.consumed == 2 * 4 * 2  # two batches of 4, in global positions (W = 2)
    assert loader.sampler.position > loader.consumed  # the workers ran ahead
    assert len(it) == 3 and len(loader) == 1  # 10 per rank: 4 + 4 + 2
    assert len(next(it)) == 2
    assert loader.consumed == 20  # the short last batch counts 2 samples per rank
    del it


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_exactly_at_an_epoch_end(drop_last):
    n, b = 10, 4  # batches per epoch: 4, 4, 2 (or 4, 4 with drop_last)
    per_epoch = 2 if drop_last else 3
    full = run_epochs(make_loader(n, b, drop_last=drop_last))
    loader = make_loader(n, b, drop_last=drop_last)
    head = run_until(loader, per_epoch)  # the last batch received, StopIteration not yet seen
    assert loader.consumed == n
    assert interrupted_stream(n, b, per_epoch, len(full), drop_last=drop_last) == full
    assert head == full[:per_epoch]


def test_epochs_too_small_for_one_batch_still_advance():
    loader = make_loader(3, 4, drop_last=True)
    assert list(loader) == [] and loader.consumed == 3
    assert list(loader) == [] and loader.consumed == 6


def test_drop_last_epoch_end_moves_consumed_to_the_end():
    loader = make_loader(10, 4, drop_last=True)  # one epoch: 4 + 4, the last 2 are dropped
    it = iter(loader)
    next(it)
    assert loader.consumed == 4
    next(it)
    assert loader.consumed == 10  # the last full batch: the remainder will never be yielded
    with pytest.raises(StopIteration):
        next(it)
    assert loader.consumed == 10 and len(loader) == 2


@pytest.mark.parametrize("n", [96, 100])
@pytest.mark.parametrize("old_world, new_world", [(2, 1), (1, 2)])
def test_world_size_change_keeps_global_steps(n, old_world, new_world):
    G, k, total = 8, 9, 30  # 30 steps cross two epochs
    infinite = n % G != 0  # epoch ends give short steps that depend on W unless G divides n
    kw = {"infinite": infinite}

    def loaders(world):
        return [make_loader(n, G // world, rank=r, world_size=world, **kw) for r in range(world)]

    reference = lockstep_steps(loaders(old_world), total)
    assert check_contiguous(reference, 0, loaders(1)[0].sampler) == sum(map(len, reference))
    same_global_batch = lockstep_steps(loaders(new_world), total)
    assert [sorted(s) for s in same_global_batch] == [sorted(s) for s in reference]

    old = loaders(old_world)
    head = lockstep_steps(old, k)
    states = [json.loads(json.dumps(l.state_dict())) for l in old]
    assert all(s == states[0] for s in states) and states[0]["consumed"] == k * G
    new = loaders(new_world)
    for l in new:
        l.load_state_dict(states[0])
    tail = lockstep_steps(new, total - k)
    assert [sorted(s) for s in head + tail] == [sorted(s) for s in reference]


def test_unaligned_elastic_resume_loses_and_repeats_nothing():
    """2 ranks x 3 -> 3 ranks x 2 mid-epoch: the stream goes on from the consumed position."""
    n = 31

    def loaders(world, b):
        return [make_loader(n, b, rank=r, world_size=world) for r in range(world)]

    old = loaders(2, 3)
    head = lockstep_steps(old, 4)  # consumed = 24
    state = old[0].state_dict()
    new = loaders(3, 2)
    for l in new:
        l.load_state_dict(state)
    tail = lockstep_steps(new, 25)  # crosses two loader epochs, starting unaligned
    sampler = new[0].sampler
    end = check_contiguous(head + tail, 0, sampler)
    assert end == new[0].consumed
    # no sample lost or repeated: the run read each sample once per permutation epoch, plus
    # a prefix of the next epoch without repeats
    counts = np.bincount([i for s in head + tail for i in s], minlength=n)
    assert set(counts.tolist()) <= {end // n, end // n + 1} and counts.sum() == end


def test_a_version_1_state_still_loads():
    """States saved before version 2 (which added "schedule") resume as they did."""
    loader = make_loader(50, 5)
    it = iter(loader)
    next(it), next(it)
    old = {k: v for k, v in loader.state_dict().items() if k not in ("schedule", "content", "steps", "skips")}
    old["version"] = 1
    fresh = make_loader(50, 5)
    fresh.load_state_dict(old)
    assert fresh.consumed == 10
    with pytest.raises(ValueError, match="unknown"):
        fresh.load_state_dict({**old, "schedule": None})


def _state(**changes):
    state = make_loader(50, 5).state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    "state, match",
    [
        (_state(fingerprint="another-cache"), "fingerprint"),
        (_state(version=99), "version"),
        (_state(format="something-else"), "format"),
        (_state(algorithm="affine-v0"), "algorithm"),
        (_state(num_samples=51), "num_samples"),
        (_state(seed=4), "seed"),
        (_state(shuffle=False), "shuffle"),
        (_state(consumed=-1), "consumed"),
        ({**make_loader(50, 5).sampler.state_dict()}, "dispatched"),
    ],
    ids=["fingerprint", "version", "format", "algorithm", "num_samples", "seed", "shuffle",
         "negative", "sampler-state"],
)
def test_mismatched_state_is_refused(state, match):
    loader = make_loader(50, 5)
    next(iter(loader))
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.consumed == 5  # unchanged: never silently restarted


def test_unknown_fingerprint_and_other_batch_size_are_accepted():
    saver = make_loader(50, 7, world_size=4)  # rank 0 of 4, batches of 7: a step is 28 positions
    next(iter(saver))
    state = dict(saver.state_dict(), fingerprint=None)
    assert state["consumed"] == 28
    loader = make_loader(50, 5)
    loader.load_state_dict(state)
    assert ids(next(iter(loader))) == loader.sampler.indices_for_positions(np.arange(28, 33)).tolist()


def test_resume_at_a_trillion_maps_only_the_needed_positions():
    asked: list[np.ndarray] = []

    class Recording(DistributedSampler):
        def indices_for_positions(self, positions):
            asked.append(np.asarray(positions).copy())
            return super().indices_for_positions(positions)

    ds = IdDataset(10**9)
    loader = DataLoader(ds, batch_size=4, sampler=Recording(ds, seed=1, rank=1, world_size=2))
    state = loader.state_dict()
    state["consumed"] = 10**12
    loader.load_state_dict(state)
    batch = ids(next(iter(loader)))
    want = Recording(ds, seed=1).indices_for_positions(10**12 + 1 + 2 * np.arange(4)).tolist()
    assert batch == want
    positions = np.concatenate(asked[:1])
    assert positions.min() >= 10**12 and positions.size <= 1024
    assert loader.consumed == 10**12 + 8


def test_constructor_checks():
    ds = IdDataset(10)
    with pytest.raises(ValueError, match="len\\(dataset\\)"):
        DataLoader(ds, sampler=DistributedSampler(IdDataset(11)))
    with pytest.raises(ValueError, match="shuffle"):
        DataLoader(ds, shuffle=False, sampler=DistributedSampler(ds))
    with pytest.raises(ValueError, match="in_order"):
        DataLoader(ds, num_workers=1, in_order=False)
    default = DataLoader(ds, batch_size=3, shuffle=False)
    assert isinstance(default.sampler, DistributedSampler) and not default.sampler.shuffle
    assert [ids(b) for b in default] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    unbatched = DataLoader(ds, batch_size=None, shuffle=False)  # no auto-batching: one sample each
    it = iter(unbatched)
    assert ids(next(it)) == [0] and ids(next(it)) == [1] and unbatched.consumed == 2


def test_explicit_sampler_moves_are_honoured():
    loader = make_loader(10, 2)
    loader.sampler.set_epoch(2)  # fresh sampler: jump to loader epoch 2
    assert loader.consumed == 20 and loader.state_dict()["consumed"] == 20 and len(loader) == 5
    first = ids(next(iter(loader)))
    assert first == loader.sampler.indices_for_positions(np.arange(20, 22)).tolist()
    assert loader.consumed == 22


def test_load_state_while_iterating_takes_effect_at_next_iter():
    loader = make_loader(30, 3)
    full = run_epochs(make_loader(30, 3), 1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    next(it)
    next(it)
    loader.load_state_dict(state)  # back to consumed = 3
    with pytest.raises(RuntimeError, match=r"call iter\(loader\) again"):
        next(it)  # the live iterator stops: never the old stream
    assert loader.consumed == 3
    assert [ids(b) for b in loader] == full[1:]
