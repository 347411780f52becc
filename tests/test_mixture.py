"""tc.MixtureDataset: exact per-block shares, schedules, re-permuted sources, O(1) indexing, resume."""

from __future__ import annotations

import json
import math
import os
import pickle
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, default_collate

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import lockstep_steps, run_until  # noqa: E402

import torchcache as tc  # noqa: E402
from torchcache.order.permutation import Permutation, derive_key  # noqa: E402
from torchcache.train.mix import MixtureDataset  # noqa: E402

BIG = 10**15  # sources this long never run out in these tests: local position = permuted index


class Src(Dataset):
    """Item ``i`` is ``torch.tensor([offset + i])``: a batch reveals source and index."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([self.offset + i])


class Batched(Src):
    """A source with ``__getitems__`` that records its calls."""

    def __init__(self, n: int, offset: int = 0) -> None:
        super().__init__(n, offset)
        self.calls: list[list[int]] = []

    def __getitems__(self, indices):
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class WholeBatches(Src):
    """A source that makes whole batches itself (get_batch), recording the indices asked."""

    def __init__(self, n: int, offset: int = 0) -> None:
        super().__init__(n, offset)
        self.batch_calls: list[list[int]] = []

    def get_batch(self, indices):
        self.batch_calls.append(np.asarray(indices).tolist())
        return torch.as_tensor(indices).reshape(-1, 1) + self.offset


def sources(n: int, big: bool = True) -> dict[str, Src]:
    return {f"s{k}": Src(BIG if big else 50 + k, 10**7 * k) for k in range(n)}


def local_positions(mix: MixtureDataset, indices) -> tuple[np.ndarray, np.ndarray]:
    """(source ids, source-local stream positions) for sources that do not wrap (epoch 0)."""
    src, local = mix.locate(np.asarray(indices, dtype=np.int64))
    pos = np.empty_like(local)
    for k, name in enumerate(mix.names):
        m = src == k
        if m.any():
            perm = Permutation(len(mix.datasets[name]), derive_key(mix.seed, f"mix-source:{name}", 0))
            pos[m] = perm.inverse(local[m])
    return src, pos


@st.composite
def mixtures(draw):
    k = draw(st.integers(2, 20))
    raw = draw(st.lists(st.one_of(st.integers(0, 40), st.fractions(0, 5, max_denominator=7)),
                        min_size=k, max_size=k))
    weights = [Fraction(w) for w in raw]
    if not any(weights):
        weights[draw(st.integers(0, k - 1))] = Fraction(1)
    total = sum(weights)
    min_block = max(math.ceil(total / w) for w in weights if w)
    B = draw(st.integers(min_block, min_block + 150))
    seed = draw(st.integers(0, 2**32))
    names = [f"s{i}" for i in range(k)]
    # give some as floats/ints to exercise the conversion (values that are exact in decimal)
    given_weights = {n: (int(w) if w.denominator == 1 and draw(st.booleans()) else w)
                     for n, w in zip(names, weights)}
    mix = MixtureDataset(sources(k), given_weights, seed=seed, block_size=B)
    return mix, [w / total for w in weights]


def floor_ceil(m: int, p: Fraction, got: int) -> bool:
    return math.floor(m * p) <= got <= math.ceil(m * p)


@settings(max_examples=60, deadline=None)
@given(case=mixtures(), data=st.data())
def test_blocks_hold_exact_shares_without_drift(case, data):
    mix, props = case
    B = mix.block_size
    names = mix.names
    far = data.draw(st.integers(0, 10**9), label="far block")
    blocks = list(range(4)) + [far, far + 1]
    for b in blocks:
        totals = mix.source_counts(0, b * B)
        after = mix.source_counts(0, (b + 1) * B)
        assert sum(totals.values()) == b * B
        for name, p in zip(names, props):  # no drift: floor or ceil of the exact share
            assert floor_ceil(b * B, p, totals[name]), (b, name, totals[name], b * B * p)
        src, pos = local_positions(mix, np.arange(b * B, (b + 1) * B))
        counts = np.bincount(src, minlength=len(names))
        assert counts.sum() == B
        assert counts.tolist() == [after[n] - totals[n] for n in names]
        assert counts.tolist() == list(mix.source_counts(b * B, (b + 1) * B).values())
        for k, name in enumerate(names):  # source-local positions continue the running total
            assert sorted(pos[src == k].tolist()) == list(range(totals[name], after[name]))
            if props[k] == 0:
                assert counts[k] == 0

    # source_counts over arbitrary ranges equals a brute-force count from locate
    start = data.draw(st.integers(0, 4 * B), label="start")
    stop = data.draw(st.integers(start, start + 3 * B), label="stop")
    src, _ = mix.locate(np.arange(start, stop))
    brute = np.bincount(src, minlength=len(names)).tolist()
    assert list(mix.source_counts(start, stop).values()) == brute


def test_largest_remainder_ties_go_to_the_first_source():
    mix = MixtureDataset({"a": Src(9), "b": Src(9), "c": Src(9)}, {"a": 1, "b": 1, "c": 1},
                         block_size=4)
    # 4 seats for three equal shares: 1 each, and the spare seat to "a" (listed first)
    assert mix.source_counts(0, 4) == {"a": 2, "b": 1, "c": 1}
    assert mix.source_counts(0, 8) == {"a": 3, "b": 3, "c": 2}
    assert mix.source_counts(0, 12) == {"a": 4, "b": 4, "c": 4}


def test_float_weights_are_taken_as_written():
    mix = MixtureDataset({"a": Src(9), "b": Src(9)}, {"a": 0.7, "b": 0.3}, block_size=10)
    assert mix.stages == ((0, {"a": Fraction(7, 10), "b": Fraction(3, 10)}),)
    for b in range(20):
        assert mix.source_counts(10 * b, 10 * b + 10) == {"a": 7, "b": 3}


def test_determinism_and_seed():
    def make(seed=5, **kw):
        return MixtureDataset(sources(3, big=False), {"s0": 5, "s1": 3, "s2": 2}, seed=seed,
                              block_size=20, **kw)

    idx = np.arange(0, 500)
    a, b = make(), make()
    assert all(np.array_equal(x, y) for x, y in zip(a.locate(idx), b.locate(idx)))
    assert a.fingerprint == b.fingerprint
    copy = pickle.loads(pickle.dumps(a))
    assert all(np.array_equal(x, y) for x, y in zip(a.locate(idx), copy.locate(idx)))
    # scattered single lookups agree with the batched ones
    for i in (0, 7, 19, 20, 333, 499):
        s, l = a.locate(i)
        assert (int(s), int(l)) == (int(a.locate(idx)[0][i]), int(a.locate(idx)[1][i]))
        assert a.source_of(i) == a.names[int(s)]
    other = make(seed=6)
    assert not np.array_equal(a.locate(idx)[0], other.locate(idx)[0])
    assert a.source_counts(0, 500) == other.source_counts(0, 500)  # same shares, other order
    assert other.fingerprint != a.fingerprint
    scaled = MixtureDataset(sources(3, big=False), {"s0": 10, "s1": 6, "s2": 4}, seed=5, block_size=20)
    assert scaled.fingerprint == a.fingerprint  # only the proportions matter


def test_schedule_stages_carry_totals():
    B = 10
    mix = MixtureDataset(
        sources(3),
        schedule=[(0, {"s0": 1, "s1": 1, "s2": 0}),
                  (100, {"s0": 1, "s1": 0, "s2": 3}),
                  (250, {"s0": 3, "s1": 1, "s2": 1})],
        seed=2, block_size=B)
    assert mix.source_counts(0, 100) == {"s0": 50, "s1": 50, "s2": 0}
    stage1 = mix.source_counts(100, 250)
    assert stage1["s1"] == 0 and stage1["s0"] + stage1["s2"] == 150
    for b in range(10, 25):  # s1 has weight 0 in stage 1: none of its samples there
        assert mix.source_counts(b * B, (b + 1) * B)["s1"] == 0
        since = mix.source_counts(100, (b + 1) * B)  # no drift inside the stage
        m = (b + 1) * B - 100
        assert floor_ceil(m, Fraction(1, 4), since["s0"]) and floor_ceil(m, Fraction(3, 4), since["s2"])
    src, _ = mix.locate(np.arange(0, 100))
    assert 2 not in src.tolist()
    # the first block of each stage continues each source's stream where it was
    for start in (100, 250):
        before = mix.source_counts(0, start)
        after = mix.source_counts(0, start + B)
        src, pos = local_positions(mix, np.arange(start, start + B))
        for k, name in enumerate(mix.names):
            got = sorted(pos[src == k].tolist())
            assert got == list(range(before[name], after[name]))
    # ... and over the whole run every source's local positions are 0, 1, 2, ... without gaps
    src, pos = local_positions(mix, np.arange(0, 400))
    for k in range(3):
        assert sorted(pos[src == k].tolist()) == list(range(int((src == k).sum())))
    # the stage-2 shares hold from its start on, on top of the carried totals
    m = 150
    since = mix.source_counts(250, 250 + m)
    assert since == {"s0": 90, "s1": 30, "s2": 30}
    assert [s for s, _ in mix.stages] == [0, 100, 250]


@st.composite
def schedules(draw):
    k = draw(st.integers(2, 6))
    names = [f"s{i}" for i in range(k)]
    num_stages = draw(st.integers(2, 3))
    stages_w = []
    for _ in range(num_stages):
        w = draw(st.lists(st.integers(0, 9), min_size=k, max_size=k))
        if not any(w):
            w[draw(st.integers(0, k - 1))] = 1
        stages_w.append(w)
    min_block = max(math.ceil(sum(w) / x) for w in stages_w for x in w if x)
    B = draw(st.integers(min_block, min_block + 40))
    gaps = draw(st.lists(st.integers(1, 6), min_size=num_stages - 1, max_size=num_stages - 1))
    starts = [0] + [B * g for g in np.cumsum(gaps).tolist()]
    schedule = [(s, dict(zip(names, w))) for s, w in zip(starts, stages_w)]
    mix = MixtureDataset(sources(k), schedule=schedule, seed=draw(st.integers(0, 99)), block_size=B)
    return mix, starts, [[Fraction(x, sum(w)) for x in w] for w in stages_w]


@settings(max_examples=40, deadline=None)
@given(case=schedules())
def test_schedule_property_stages_carry_totals(case):
    mix, starts, props = case
    B, names = mix.block_size, mix.names
    end = starts[-1] + 4 * B
    src, pos = local_positions(mix, np.arange(end))
    for k in range(len(names)):  # every source's stream goes on without gaps or repeats
        assert sorted(pos[src == k].tolist()) == list(range(int((src == k).sum())))
    bounds = starts + [end]
    for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        carried = mix.source_counts(0, lo)
        assert carried == {n: int((src[:lo] == k).sum()) for k, n in enumerate(names)}
        for m in range(B, hi - lo + 1, B):  # inside the stage: floor/ceil of the share since its start
            since = mix.source_counts(lo, lo + m)
            for n, p in zip(names, props[s]):
                assert floor_ceil(m, p, since[n]), (s, m, n)
                if p == 0:
                    assert since[n] == 0
        # the first block of the stage continues each source where it was
        first = mix.source_counts(0, lo + B)
        for k, n in enumerate(names):
            got = sorted(pos[lo:lo + B][src[lo:lo + B] == k].tolist())
            assert got == list(range(carried[n], first[n]))


@settings(max_examples=60, deadline=None)
@given(weights=st.lists(st.integers(0, 300), min_size=2, max_size=20), B=st.integers(1, 200))
def test_too_small_weight_is_an_error_with_a_block_size_that_works(weights, B):
    if not any(weights):
        weights[0] = 1
    ds = {f"s{i}": Src(5) for i in range(len(weights))}
    w = dict(zip(ds, weights))
    total = sum(weights)
    bad = [n for n, x in w.items() if x and B * x < total]
    if not bad:
        MixtureDataset(ds, w, block_size=B)
        return
    need = math.ceil(total / w[bad[0]])
    with pytest.raises(ValueError, match=rf"source '{bad[0]}' is too small.*block_size >= {need}\b"):
        MixtureDataset(ds, w, block_size=B)
    works = max(math.ceil(total / x) for x in weights if x)
    MixtureDataset(ds, w, block_size=works)


@pytest.mark.parametrize(
    "schedule, match",
    [
        ([(0, {"a": 1, "b": 1}), (150, {"a": 1, "b": 2})],
         r"150.*not a multiple of block_size=100.*100 or 200"),
        ([(100, {"a": 1, "b": 1})], "first schedule stage must start at sample 0"),
        ([(0, {"a": 1, "b": 1}), (200, {"a": 1, "b": 1}), (200, {"a": 1, "b": 2})], "increase"),
        ([], "empty"),
    ],
    ids=["unaligned", "first-not-zero", "not-increasing", "empty"],
)
def test_bad_schedules(schedule, match):
    with pytest.raises(ValueError, match=match):
        MixtureDataset({"a": Src(5), "b": Src(5)}, schedule=schedule, block_size=100)


def test_too_small_weight_names_source_and_working_block_size():
    ds = {"web": Src(100), "tiny": Src(100)}
    with pytest.raises(ValueError, match=r"source 'tiny'.*block_size >= 1001") as err:
        MixtureDataset(ds, {"web": 1000, "tiny": 1}, block_size=100)
    assert "raise its weight" in str(err.value)
    MixtureDataset(ds, {"web": 1000, "tiny": 1}, block_size=1001)  # the suggestion works
    with pytest.raises(ValueError, match=r"source 'tiny' in schedule stage 1 \(from sample 2000\)"):
        MixtureDataset(ds, schedule=[(0, {"web": 1, "tiny": 1}), (2000, {"web": 999, "tiny": 1})],
                       block_size=500)
    # exactly one sample per block on average is enough (B * p == 1)
    mix = MixtureDataset(ds, {"web": 99, "tiny": 1}, block_size=100)
    assert all(mix.source_counts(100 * b, 100 * b + 100)["tiny"] == 1 for b in range(10))


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (({"a": Src(5)}, {"a": 1, "zzz": 1}), {}, ValueError, r"unknown source.*'zzz'"),
        (({"a": Src(5), "b": Src(5)}, {"a": 1}), {}, ValueError, r"no entry.*'b'"),
        (({"a": Src(5), "b": Src(5)}, {"a": 1, "b": -0.5}), {}, ValueError, r"'b'.*>= 0"),
        (({"a": Src(5), "b": Src(5)}, {"a": 0, "b": 0.0}), {}, ValueError, "all weights are zero"),
        (({}, {}), {}, ValueError, "empty"),
        (({"a": Src(5)}, {"a": float("inf")}), {}, ValueError, "finite"),
        (({"a": Src(5)}, {"a": "1"}), {}, TypeError, "number"),
        (({"a": Src(5), "b": Src(0)}, {"a": 1, "b": 1}), {}, ValueError, "'b' is empty"),
        (({"a": Src(5)}, {"a": 1}), {"schedule": [(0, {"a": 1})]}, ValueError, "not both"),
        (({"a": Src(5)}, {"a": 1}), {"block_size": 0}, ValueError, "block_size"),
        (({"a": Src(5)}, {"a": 1}), {"seed": -1}, ValueError, "seed"),
    ],
    ids=["unknown", "missing", "negative", "all-zero", "no-datasets", "inf", "str", "empty-source",
         "both", "block-size", "seed"],
)
def test_clear_errors(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        MixtureDataset(*args, **kwargs)


def test_an_empty_source_is_refused_even_with_weight_zero_and_default_weights_follow_lengths():
    with pytest.raises(ValueError, match="'b' is empty"):
        MixtureDataset({"a": Src(5), "b": Src(0)}, {"a": 1, "b": 0})
    mix = MixtureDataset({"a": Src(30), "b": Src(10)}, block_size=4)
    assert mix.stages[0][1] == {"a": Fraction(3, 4), "b": Fraction(1, 4)}
    assert len(mix) == 40


def test_a_short_source_is_repermuted_every_pass():
    # B = 2 with equal weights: every block holds one sample of each, so the k-th "small" sample
    # in mixture order is its local position k
    mix = MixtureDataset({"small": Src(7), "big": Src(BIG)}, {"small": 1, "big": 1}, seed=3,
                         block_size=2)
    src, local = mix.locate(np.arange(2 * 7 * 6))
    small = local[src == 0].reshape(6, 7)  # six passes over the 7 samples
    for row in small:
        assert sorted(row.tolist()) == list(range(7))  # every sample once per pass
    orders = {tuple(row.tolist()) for row in small}
    assert len(orders) > 1 and tuple(small[0]) != tuple(small[1])
    # with a block size where the ranks inside a block are shuffled too: after 7 blocks of 10 the
    # source has had 21 samples = 3 whole passes, each sample exactly 3 times
    mix = MixtureDataset({"small": Src(7), "big": Src(BIG)}, {"small": 3, "big": 7}, seed=1,
                         block_size=10)
    src, local = mix.locate(np.arange(70))
    assert np.bincount(local[src == 0], minlength=7).tolist() == [3] * 7
    src, pos = mix.schedule.positions(np.arange(140))  # local stream positions
    small_pos = np.sort(pos[src == 0])
    assert small_pos.tolist() == list(range(42))
    s2, loc2 = mix.locate(np.arange(140))
    by_pos = dict(zip(pos[src == 0].tolist(), loc2[s2 == 0].tolist()))
    passes = [[by_pos[7 * e + j] for j in range(7)] for e in range(6)]
    assert all(sorted(p) == list(range(7)) for p in passes)
    assert len({tuple(p) for p in passes}) > 1


@pytest.mark.parametrize("lengths,weights,B", [
    ({"a": 20_000, "b": 2_174}, None, 1024),  # runs of a source's permutation cross its epochs
    ({"a": 9_000, "b": 50, "c": 300_000}, {"a": 4, "b": 1, "c": 3}, 256),
])
def test_a_whole_period_locates_as_each_index_alone(lengths, weights, B):
    # dense reads (a loader's periods) use cached runs of each source's permutation; one index
    # alone is permuted directly: both must give the same stream, in every period
    mix = MixtureDataset({name: Src(n) for name, n in lengths.items()}, weights, seed=5, block_size=B)
    for period in list(range(0, 60, 7)) + [10**9]:
        indices = np.arange(period * B, (period + 1) * B)
        src, local = mix.locate(indices)
        alone = [MixtureDataset({name: Src(n) for name, n in lengths.items()}, weights, seed=5,
                                block_size=B).schedule.locate_one(int(i)) for i in indices[::37]]
        assert list(zip(src[::37].tolist(), local[::37].tolist())) == alone


def test_getitems_reads_each_source_once_in_order():
    a, b = Batched(40, 0), Batched(40, 1000)
    plain = Src(40, 2000)  # no __getitems__: read per index
    mix = MixtureDataset({"a": a, "b": b, "c": plain}, {"a": 2, "b": 1, "c": 1}, block_size=8)
    idx = [5, 77, 3, 1000, 2, 64, 64]
    items = mix.__getitems__(idx)
    assert [int(x) for x in items] == [int(mix[i]) for i in idx]
    a.calls.clear()
    b.calls.clear()
    mix.__getitems__(idx)
    src, local = mix.locate(idx)
    for k, ds in enumerate((a, b)):
        wanted = local[src == k].tolist()
        assert ds.calls == ([wanted] if wanted else [])
    with pytest.raises(IndexError, match="negative"):
        mix[-1]
    with pytest.raises(IndexError, match="negative"):
        mix.locate([3, -2])
    with pytest.raises(TypeError):
        mix[1.5]


def test_get_batch_reads_each_source_once_and_equals_the_collated_items():
    a, b, plain = WholeBatches(40, 0), Batched(40, 1000), Src(40, 2000)
    mix = MixtureDataset({"a": a, "b": b, "c": plain}, {"a": 2, "b": 1, "c": 1}, block_size=8)
    idx = np.array([5, 77, 3, 1000, 2, 64, 64, 9, 10, 11])
    b.calls.clear()
    batch = mix.get_batch(idx)
    assert torch.equal(batch, default_collate(mix.__getitems__(idx.tolist())))
    src, local = mix.locate(idx)
    assert set(src.tolist()) == {0, 1, 2}  # the batch mixes all three sources
    assert a.batch_calls == [local[src == 0].tolist()]  # one call per source, with a get_batch...
    assert b.calls[0] == local[src == 1].tolist()  # ...or its __getitems__
    only_a = np.flatnonzero(mix.locate(np.arange(64))[0] == 0)[:3]
    assert torch.equal(mix.get_batch(only_a), a.get_batch(mix.locate(only_a)[1]))
    nested = MixtureDataset({"mix": mix, "z": WholeBatches(10, 300)}, {"mix": 1, "z": 1}, block_size=4)
    assert torch.equal(nested.get_batch(np.arange(12)),
                       default_collate(nested.__getitems__(list(range(12)))))


class CompactRows(Src):
    """A batched source whose compact batches (int32 rows) any source of its format expands."""

    compact_format = "rows of int32 values"

    def __init__(self, n: int, offset: int = 0) -> None:
        super().__init__(n, offset)
        self.expanded = 0

    def get_batch(self, indices):
        return self.expand_batch(self.compact_batch(indices))

    def compact_batch(self, indices):
        return {"values": torch.as_tensor(indices, dtype=torch.int32) + self.offset}

    def expand_batch(self, compact):
        self.expanded += 1
        return compact["values"].to(torch.int64).reshape(-1, 1)


def test_sources_of_one_compact_format_are_expanded_once_per_batch():
    a, b = CompactRows(40, 0), CompactRows(30, 1000)
    mix = MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=4)
    idx = np.arange(3, 19)
    batch = mix.get_batch(idx)
    assert torch.equal(batch, default_collate(mix.__getitems__(idx.tolist())))
    assert set(mix.locate(idx)[0].tolist()) == {0, 1} and a.expanded + b.expanded == 1
    b.compact_format = "another format"  # (on the instance: the mixture made now sees it)
    other = MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=4)
    assert torch.equal(other.get_batch(idx), batch) and a.expanded + b.expanded == 3


def test_get_batch_of_sources_with_dicts_and_differing_shapes():
    wide = [torch.tensor([i, i]) for i in range(10)]
    mix = MixtureDataset({"narrow": Src(10), "wide": wide}, block_size=4, allow_mixed_items=True)
    with pytest.raises(ValueError, match="collate_fn"):
        mix.get_batch(np.arange(8))
    named = [{"ids": torch.tensor([i]), "name": f"n{i}"} for i in range(10)]
    other = [{"ids": torch.tensor([100 + i]), "name": f"o{i}"} for i in range(10)]
    both = MixtureDataset({"n": named, "o": other}, block_size=4)
    want = default_collate(both.__getitems__(list(range(8))))
    got = both.get_batch(np.arange(8))
    assert torch.equal(got["ids"], want["ids"]) and got["name"] == want["name"]


def test_the_loader_reads_a_mixture_with_get_batch():
    a, b = WholeBatches(23, 0), WholeBatches(11, 1000)
    mix = MixtureDataset({"a": a, "b": b}, {"a": 2, "b": 1}, seed=4, block_size=6, num_samples=40)
    loader = tc.DataLoader(mix, batch_size=4)
    assert loader.prefetch_batches == 4  # the in-process fast path, as for its sources
    got = [batch.flatten().tolist() for batch in loader]
    assert got == [[int(x) for x in mix.__getitems__(list(range(i, i + 4)))] for i in range(0, 40, 4)]
    assert len(a.batch_calls) + len(b.batch_calls) <= 2 * len(got)


def test_nested_mixture():
    inner = MixtureDataset({"x": Src(5, 100), "y": Src(3, 200)}, {"x": 1, "y": 1}, block_size=2,
                           num_samples=8)
    outer = MixtureDataset({"inner": inner, "z": Src(10, 300)}, {"inner": 1, "z": 3}, block_size=4)
    items = [int(t) for t in outer.__getitems__(list(range(40)))]
    assert sum(100 <= v < 300 for v in items) == 10 and sum(v >= 300 for v in items) == 30
    assert len(outer) == 18
    inner2 = MixtureDataset({"x": Src(5, 100), "y": Src(3, 200)}, {"x": 2, "y": 1}, block_size=3,
                            num_samples=8)
    outer2 = MixtureDataset({"inner": inner2, "z": Src(10, 300)}, {"inner": 1, "z": 3}, block_size=4)
    assert outer2.fingerprint != outer.fingerprint  # the inner mixture's identity is part of it


def test_far_indices_are_valid():
    mix = MixtureDataset({"a": Src(1000), "b": Src(7), "c": Src(10**9)}, {"a": 5, "b": 1, "c": 4},
                         seed=9, block_size=64)
    far = 10**12
    src, local = mix.locate(np.arange(far, far + 64))
    for k, n in enumerate((1000, 7, 10**9)):
        assert ((local[src == k] >= 0) & (local[src == k] < n)).all()
    assert np.bincount(src, minlength=3).sum() == 64
    s, l = mix.locate([far])
    assert s.shape == (1,) and 0 <= int(l[0]) < (1000, 7, 10**9)[int(s[0])]
    assert sum(mix.source_counts(far, far + 1000).values()) == 1000
    assert int(mix[2**62]) >= 0


def test_token_and_document_sources(tmp_path, books, gpt2_tokenizer_path):
    from conftest import paragraphs, write_jsonl
    src = write_jsonl(tmp_path / "d.jsonl", paragraphs(books, 120))
    tc.build_cache(src, tmp_path / "cache", gpt2_tokenizer_path, block_tokens=2000, progress=False)
    a = tc.TokenDataset(tmp_path / "cache", 16)
    b = tc.TokenDataset(tmp_path / "cache", 16, labels="same")
    mix = tc.MixtureDataset({"a": a, "b": b}, {"a": 3, "b": 1}, seed=1, block_size=8)
    items = mix.__getitems__(list(range(16)))
    src, local = mix.locate(np.arange(16))
    for item, k, i in zip(items, src.tolist(), local.tolist()):
        want = (a, b)[k][i]
        assert torch.equal(item["input_ids"], want["input_ids"])
        assert torch.equal(item["labels"], want["labels"])
    batch = mix.get_batch(np.arange(16))
    collated = default_collate(items)
    assert batch.keys() == collated.keys()
    assert all(torch.equal(batch[key], collated[key]) for key in batch)
    docs = tc.MixtureDataset({"docs": tc.DocumentDataset(tmp_path / "cache"), "toks": a},
                             {"docs": 1, "toks": 1}, block_size=2, allow_mixed_items=True)
    assert len(docs) == len(a) + tc.TokenCache(tmp_path / "cache").num_documents


# -- through tc.DistributedSampler and tc.DataLoader ---------------------------------------------

def make_mix() -> MixtureDataset:
    return MixtureDataset({"a": Src(23, 0), "b": Src(11, 1000)}, {"a": 2, "b": 1}, seed=4,
                          block_size=6, num_samples=40)


def stream(mix: MixtureDataset, start: int, stop: int) -> list[int]:
    return [int(x) for x in mix.__getitems__(list(range(start, stop)))]


def mix_loader(batch_size, *, rank=0, world_size=1, **kw) -> tc.DataLoader:
    mix = make_mix()
    sampler = tc.DistributedSampler(mix, seed=0, rank=rank, world_size=world_size,
                                    **{k: kw.pop(k) for k in ("shuffle", "infinite") if k in kw})
    return tc.DataLoader(mix, batch_size=batch_size, sampler=sampler, **kw)


def test_sampler_reads_the_mixture_in_order():
    mix = make_mix()
    for shuffle in (True, False):
        sampler = tc.DistributedSampler(mix, seed=7, shuffle=shuffle, rank=1, world_size=3)
        assert sampler.indices_for_positions(np.arange(100, 110)).tolist() == list(range(100, 110))
        assert list(iter(sampler))[:3] == [1, 4, 7]
    with pytest.raises(ValueError, match="window"):
        tc.DistributedSampler(mix, window=8)


def test_resume_with_workers_continues_the_stream():
    mix = make_mix()
    b, epochs = 4, 3  # 10 batches per loader epoch (40 samples); later epochs continue the stream
    reference = [stream(mix, i, i + b) for i in range(0, 40 * epochs, b)]
    first = mix_loader(b, num_workers=2)
    head = run_until(first, 13)  # inside loader epoch 1
    assert head == reference[:13]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["consumed"] == 52 and state["fingerprint"] == mix.resume_fingerprint(52)
    prefix = mix.resume_prefix(52)  # (a state lists the sources, sorted by name)
    assert state["schedule"] == dict(prefix, sources=[[n, *v] for n, v in sorted(prefix["sources"].items())])
    second = mix_loader(b, num_workers=2)
    second.load_state_dict(state)
    assert head + run_until(second, len(reference) - 13) == reference
    older = {k: v for k, v in state.items() if k not in ("steps", "skips")}  # version 3: sources
    older.update(version=3, schedule=prefix)                                 # as a mapping
    third = mix_loader(b)
    third.load_state_dict(older)
    assert head + run_until(third, len(reference) - 13) == reference
    fast = mix_loader(b, prefetch_batches=2)  # the loader's read-ahead thread, no workers
    assert run_until(fast, 12) == reference[:12]


def test_world_size_change_keeps_global_steps():
    G, k, total = 8, 7, 14  # 40 samples per loader epoch: 14 steps cross two epoch ends
    mix = make_mix()

    def loaders(world, **kw):
        return [mix_loader(G // world, rank=r, world_size=world, **kw) for r in range(world)]

    reference = lockstep_steps(loaders(2), total)
    assert [sorted(s) for s in reference] == [sorted(stream(mix, G * t, G * t + G)) for t in range(total)]
    old = loaders(2)
    head = lockstep_steps(old, k)
    state = json.loads(json.dumps(old[0].state_dict()))
    assert state == json.loads(json.dumps(old[1].state_dict())) and state["consumed"] == k * G
    new = loaders(1, num_workers=2)
    new[0].load_state_dict(state)
    tail = lockstep_steps(new, total - k)
    assert [sorted(s) for s in head + tail] == [sorted(s) for s in reference]


def test_loader_refuses_a_state_from_other_weights():
    loader = mix_loader(4)
    next(iter(loader))
    state = loader.state_dict()
    other = MixtureDataset({"a": Src(23, 0), "b": Src(11, 1000)}, {"a": 1, "b": 1}, seed=4,
                           block_size=6, num_samples=40)
    fresh = tc.DataLoader(other, batch_size=4, sampler=tc.DistributedSampler(other))
    with pytest.raises(ValueError, match="first differ at mixture index 0"):
        fresh.load_state_dict(state)


def test_the_schedule_alone_maps_indices_as_the_mixture_does():
    srcs = {"a": Src(7), "b": Src(BIG), "c": Src(30)}
    stages = [(0, {"a": 1, "b": 2, "c": 1}), (40, {"a": 0, "b": 1, "c": 3})]
    mix = MixtureDataset(srcs, schedule=stages, seed=5, block_size=8)
    schedule = tc.MixtureSchedule({n: len(d) for n, d in srcs.items()}, schedule=stages, seed=5,
                                  block_size=8)
    idx = np.arange(300)
    for got, want in zip(schedule.locate(idx), mix.locate(idx)):
        assert np.array_equal(got, want)
    assert schedule.stages == mix.stages and schedule.names == mix.names
    assert schedule.source_counts(3, 250) == mix.source_counts(3, 250)
    assert [schedule.locate_one(i) for i in range(20)] == [
        (int(k), int(i)) for k, i in zip(*mix.locate(np.arange(20)))]
    assert [mix[i] for i in range(20)] == [
        srcs[schedule.names[k]][i] for k, i in (schedule.locate_one(j) for j in range(20))]
    # positions: each source's own stream, consumed in order over whole blocks
    source, pos = schedule.positions(np.arange(320).reshape(10, 32))
    assert source.shape == pos.shape == (10, 32)
    counts = schedule.source_counts(0, 320)
    for k, name in enumerate(schedule.names):
        assert sorted(pos[source == k].tolist()) == list(range(counts[name]))
    clone = pickle.loads(pickle.dumps(schedule))
    assert np.array_equal(clone.locate(idx)[1], schedule.locate(idx)[1])
    assert "MixtureSchedule(a=0.25, b=0.5, c=0.25, 2 stages" in repr(schedule)


@pytest.mark.parametrize("block_size", [8, 100, 1024])
def test_blocks_read_in_order_map_as_indices_read_one_by_one(block_size):
    """A loader reads the mixture in order, a batch at a time: the schedule then maps whole
    blocks at once (and keeps them); indices read one at a time, far apart, are mapped alone.
    Both give the same sources and samples."""
    lengths = {"a": 7, "b": 10**9, "c": 300}
    stages = [(0, {"a": 1, "b": 2, "c": 1}), (4 * block_size, {"a": 0, "b": 1, "c": 3})]
    def schedule():
        return tc.MixtureSchedule(lengths, schedule=stages, seed=2, block_size=block_size)
    dense = schedule()
    start = 3 * block_size + 5  # batches of 16 across blocks and the stage change
    for first in range(start, start + 3 * block_size, 16):
        batch = np.arange(first, first + 16)
        got = dense.locate(batch)
        want = [schedule().locate_one(int(i)) for i in batch]  # each alone, in a fresh schedule
        assert list(zip(got[0].tolist(), got[1].tolist())) == want


def test_schedule_argument_errors():
    for kwargs, error, match in [
        (dict(lengths=[3]), TypeError, "lengths must be a dict"),
        (dict(lengths={}), ValueError, "lengths is empty"),
        (dict(lengths={1: 3}), TypeError, "source names"),
        (dict(lengths={"a": -1}), ValueError, r"lengths\['a'\]"),
        (dict(lengths={"a": 3}, weights={"b": 1}), ValueError, "unknown source"),
        (dict(lengths={"a": 3}, seed=-1), ValueError, "seed"),
    ]:
        with pytest.raises(error, match=match):
            tc.MixtureSchedule(**kwargs)
