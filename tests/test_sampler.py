"""DistributedSampler: coverage per epoch, equal rank counts, world-size independence, limits, state."""

from __future__ import annotations

import itertools
import math
import os
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset, interleave  # noqa: E402

import torchcache.train.sampler as sample_mod  # noqa: E402
from torchcache.order.permutation import PERMUTATION_ALGORITHM, Permutation  # noqa: E402
from torchcache.train.sampler import DistributedSampler  # noqa: E402

WORLD_SIZES = st.sampled_from([1, 2, 3, 8])
FAST = settings(max_examples=40, deadline=None)


class Sized:
    """A dataset stand-in with only a length (no items are ever read)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def samplers(n: int, world: int, **kw) -> list[DistributedSampler]:
    return [DistributedSampler(Sized(n), rank=r, world_size=world, **kw) for r in range(world)]


def one_pass(ranks: list[DistributedSampler]) -> list[list[int]]:
    return [list(s) for s in ranks]


@FAST
@given(n=st.integers(1, 300), world=WORLD_SIZES, seed=st.integers(0, 2**32), loader_epochs=st.integers(1, 3))
def test_loader_epochs_cover_every_sample_once_per_permutation_epoch(n, world, seed, loader_epochs):
    ranks = samplers(n, world, seed=seed)
    E = world * math.ceil(n / world)
    stream = []
    for e in range(loader_epochs):
        assert [len(s) for s in ranks] == [math.ceil(n / world)] * world
        per_rank = one_pass(ranks)
        assert {len(p) for p in per_rank} == {math.ceil(n / world)}
        stream += interleave(per_rank)
        assert all(s.position == (e + 1) * E for s in ranks)
    assert len(stream) == loader_epochs * E
    # the interleaved stream is exactly the global position stream 0, 1, 2, ...
    assert stream == ranks[0].indices_for_positions(np.arange(len(stream))).tolist()
    for e in range(len(stream) // n):  # every complete permutation epoch is a permutation
        assert sorted(stream[e * n:(e + 1) * n]) == list(range(n))
    rest = stream[(len(stream) // n) * n:]
    assert len(set(rest)) == len(rest) and all(0 <= i < n for i in rest)


@FAST
@given(n=st.integers(1, 200), steps=st.integers(1, 30), seed=st.integers(0, 1000))
def test_global_steps_do_not_depend_on_world_size(n, steps, seed):
    G = 24
    reference = None
    for world in (1, 2, 3, 8):
        ranks = samplers(n, world, seed=seed, infinite=True)
        per_rank = [list(itertools.islice(iter(s), steps * G // world)) for s in ranks]
        step_sets = [
            sorted(i for p in per_rank for i in p[t * G // world:(t + 1) * G // world]) for t in range(steps)
        ]
        if reference is None:
            reference = step_sets
            stream = ranks[0].indices_for_positions(np.arange(steps * G)).tolist()
            assert reference == [sorted(stream[t * G:(t + 1) * G]) for t in range(steps)]
        assert step_sets == reference, f"world_size={world} changes the global steps"


def test_each_epoch_uses_a_new_permutation():
    n = 64
    s = DistributedSampler(Sized(n), seed=5, world_size=1, rank=0)
    epochs = [list(s) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(n))
    assert epochs[0] != list(range(n))
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
    other_seed = list(DistributedSampler(Sized(n), seed=6, world_size=1, rank=0))
    assert other_seed != epochs[0]


def test_no_shuffle_is_stream_order():
    s = DistributedSampler(Sized(7), shuffle=False, rank=1, world_size=3)
    assert list(s) == [1, 4, 0]  # positions 1, 4, 7 -> indices p % 7
    assert list(s) == [3, 6, 2]  # positions 10, 13, 16 (E = 9)


@FAST
@given(n=st.integers(1, 100), world=WORLD_SIZES, cut=st.integers(0, 50))
def test_positions_continue_across_iter_calls(n, world, cut):
    ranks = samplers(n, world, seed=1)
    infinite = samplers(n, world, seed=1, infinite=True)
    for s, inf in zip(ranks, infinite):
        first = list(itertools.islice(iter(s), cut))  # abandon an iterator part-way
        assert s.position == min(cut, len(first)) * world
        got = first + [i for _ in range(3) for i in s]
        assert got == list(itertools.islice(iter(inf), len(got)))


@FAST
@given(n=st.integers(1, 100), world=WORLD_SIZES, start=st.integers(0, 500))
def test_unaligned_start_keeps_ranks_equal_and_stream_continuous(n, world, start):
    ranks = samplers(n, world, seed=2)
    for s in ranks:
        s.set_position(start)
    E = ranks[0].epoch_size
    end = (start // E + 1) * E
    per_rank = one_pass(ranks)
    assert {len(p) for p in per_rank} == {math.ceil((end - start) / world)}
    stream = interleave(per_rank)
    assert stream == ranks[0].indices_for_positions(np.arange(start, start + len(stream))).tolist()
    assert {s.position for s in ranks} == {start + len(stream)}


def test_set_position_detaches_a_live_iterator():
    s = DistributedSampler(Sized(50), seed=1, rank=0, world_size=2)
    it = iter(s)
    first = next(it)
    s.set_position(20)
    second = next(it)  # the live iterator keeps its own stream ...
    assert [first, second] == s.indices_for_positions(np.array([0, 2])).tolist()
    assert s.position == 20  # ... but no longer moves the sampler
    assert next(iter(s)) == s.indices_for_positions(np.array([20]))[0]


def test_infinite_mode_never_ends_and_tracks_position():
    s = DistributedSampler(Sized(10), seed=4, rank=2, world_size=3, infinite=True)
    got = list(itertools.islice(iter(s), 100))
    assert s.position == 100 * 3
    assert got == s.indices_for_positions(2 + 3 * np.arange(100)).tolist()
    with pytest.raises(TypeError, match="infinite"):
        len(s)


def test_max_epochs_and_max_samples():
    # max_epochs counts loader epochs: stop at max_epochs * E, E = W * ceil(n / W) = 12
    ranks = samplers(10, 3, max_epochs=2)
    assert [len(list(s)) for s in ranks] == [4, 4, 4]
    assert [len(list(s)) for s in ranks] == [4, 4, 4]
    assert [len(s) for s in ranks] == [0, 0, 0]
    assert [list(s) for s in ranks] == [[], [], []]
    # infinite + max_epochs: one iterator up to the limit
    ranks = samplers(10, 3, max_epochs=2, infinite=True)
    assert [len(list(s)) for s in ranks] == [8, 8, 8]
    # max_samples: each rank gets floor((L - P) / W); no position >= L is served
    ranks = samplers(10, 3, max_samples=25, infinite=True)
    assert [len(s) for s in ranks] == [8, 8, 8]
    stream = interleave(one_pass(ranks))
    assert stream == ranks[0].indices_for_positions(np.arange(24)).tolist()
    # ... also from an unaligned start, and inside loader epochs
    ranks = samplers(10, 3, max_samples=20)
    for s in ranks:
        s.set_position(1)
    assert [len(list(s)) for s in ranks] == [4, 4, 4]  # positions 1..12, the loader epoch (+1 spill)
    assert [len(list(s)) for s in ranks] == [2, 2, 2]  # positions 13..18; 19 is left out
    assert [list(s) for s in ranks] == [[], [], []]
    # both: the smaller limit wins
    assert DistributedSampler(Sized(10), max_epochs=5, max_samples=7, infinite=True).stop_position == 7


def _counting_permutation(monkeypatch):
    calls = []

    class Counting(Permutation):
        def __call__(self, index):
            assert isinstance(index, np.ndarray), "permutation called per index"
            calls.append(index.size)
            return super().__call__(index)

    monkeypatch.setattr(sample_mod, "Permutation", Counting)
    return calls


def test_indices_for_huge_positions_are_vectorised_and_valid(monkeypatch):
    calls = _counting_permutation(monkeypatch)
    n = 10**9
    s = DistributedSampler(Sized(n), seed=9, rank=3, world_size=8)
    positions = 10**12 - 2048 + np.arange(4096)  # crosses the boundary of epoch 1000
    idx = s.indices_for_positions(positions)
    assert idx.dtype == np.int64 and idx.shape == (4096,)
    assert ((idx >= 0) & (idx < n)).all()
    before, after = idx[:2048], idx[2048:]
    assert len(set(before.tolist())) == 2048 and len(set(after.tolist())) == 2048
    assert calls == [2048, 2048]  # one vectorised call per epoch, not one per position
    single = s.indices_for_positions(np.array([10**12 + 5]))
    assert single[0] == after[5]

    calls.clear()
    s.set_position(10**12)
    it = iter(s)
    first = [next(it) for _ in range(3)]
    assert first == s.indices_for_positions(10**12 + 3 + 8 * np.arange(3)).tolist()
    assert sum(calls) <= 2 * 1024 + 1  # only the positions near 10**12 were ever mapped
    assert s.position == 10**12 + 3 * 8


def test_rank_defaults_and_argument_errors():
    s = DistributedSampler(Sized(5))
    assert (s.rank, s.world_size) == (0, 1)
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(Sized(5), rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        DistributedSampler(Sized(5), world_size=0)
    with pytest.raises(ValueError, match="empty"):
        DistributedSampler(Sized(0))
    with pytest.raises(ValueError, match="position"):
        s.set_position(-1)


def test_set_epoch_compatibility():
    n, world = 10, 3  # E = 12
    fresh = DistributedSampler(Sized(n), rank=1, world_size=world)
    fresh.set_epoch(2)  # fresh sampler: jump to loader epoch 2
    assert fresh.position == 24
    assert list(fresh) == fresh.indices_for_positions(25 + 3 * np.arange(4)).tolist()
    fresh.set_epoch(3)  # agrees with the position: nothing to do
    assert fresh.position == 36

    s = DistributedSampler(Sized(n), rank=0, world_size=world)
    for epoch in range(2):  # the classic loop works unchanged
        s.set_epoch(epoch)
        assert s.position == epoch * 12
        list(s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s.set_epoch(7)  # disagrees on a used sampler: warn, keep the position
    assert s.position == 24 and any("ignored" in str(w.message) for w in caught)


def test_sampler_state_dict_counts_dispatched_positions():
    s = DistributedSampler(IdDataset(20), seed=7, rank=0, world_size=2)
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    assert state["counts"] == "dispatched" and state["position"] == 6
    assert state["algorithm"] == PERMUTATION_ALGORITHM
    other = DistributedSampler(IdDataset(20), seed=7, rank=0, world_size=1)
    other.load_state_dict(state)  # another world size continues the same global stream
    assert other.position == 6
    assert list(other)[:2] == other.indices_for_positions(np.array([6, 7])).tolist()
    with pytest.raises(ValueError, match="seed"):
        DistributedSampler(IdDataset(20), seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="num_samples"):
        DistributedSampler(IdDataset(21), seed=7).load_state_dict(state)
