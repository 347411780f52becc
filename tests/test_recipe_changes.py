"""Changing the training recipe mid-run without losing or repeating data.

1. Mixture schedule edits on resume: a DataLoader state (version 2) keeps the schedule prefix up
   to the consumed position, so stages at or after it may change (weights edited, stages added,
   moved or removed, sources added) and the resumed run reads exactly what a fresh run of the
   new schedule reads; an edit before the saved position is refused, naming the first mixture
   index where the two schedules differ.
2. Batch-size and world-size changes: the state is one global stream position, so any
   W x batch on resume continues the same stream (each index once per permutation epoch).
3. Per-source accounting: ``source_epochs`` and ``max_epochs_per_source``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset, ids, lockstep_steps, run_until  # noqa: E402

import torchcache as tc  # noqa: E402
from torchcache.train.mix import MixtureDataset  # noqa: E402

OFF = 10**6  # item value = OFF * (source number) + local index: an item names its source and index
SOURCE_NUMBER = {"a": 0, "b": 1, "c": 2, "d": 3}
LENGTHS = {"a": 23, "b": 11, "c": 7}
B = 6  # block size of every mixture here
BATCH = 4
TOTAL = 45  # batches in every run: 180 mixture samples, 4.5 loader epochs of 40


class Src(Dataset):
    """Item ``i`` of source ``name`` is ``tensor([OFF * number + i])``."""

    def __init__(self, name: str, n: int | None = None) -> None:
        self.name, self.n = name, LENGTHS[name] if n is None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([OFF * SOURCE_NUMBER[self.name] + i])


class OtherSrc(Src):
    """The same items as Src under another identity (another dataset class)."""


def decode(item: int) -> tuple[str, int]:
    """(source name, local index) of an item."""
    number, local = divmod(int(item), OFF)
    return "abcd"[number], local


def make(schedule, names=("a", "b"), seed=4, block_size=B, num_samples=40, **kw) -> MixtureDataset:
    """A mixture of ``names`` (Src unless a source is given by name in ``kw``); other ``kw`` go
    to MixtureDataset."""
    datasets = {n: kw.pop(n) if n in kw else Src(n) for n in names}
    return MixtureDataset(datasets, schedule=schedule, seed=seed, block_size=block_size,
                          num_samples=num_samples, **kw)


def loader(mix, batch_size=BATCH, *, rank=0, world_size=1, **kw) -> tc.DataLoader:
    sampler = tc.DistributedSampler(mix, seed=0, rank=rank, world_size=world_size)
    return tc.DataLoader(mix, batch_size=batch_size, sampler=sampler, **kw)


def flat(batches) -> list[int]:
    return [int(x) for b in batches for x in b]


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def largest_remainder(props: list[Fraction], m: int) -> list[int]:
    """Independent largest-remainder apportionment of ``m`` seats (ties to the first listed)."""
    quotas = [m * p for p in props]
    seats = [math.floor(q) for q in quotas]
    order = sorted(range(len(props)), key=lambda k: (-(quotas[k] - seats[k]), k))
    for k in order[:m - sum(seats)]:
        seats[k] += 1
    return seats


# -- 1. schedule edits on resume ------------------------------------------------------------------

OLD = [(0, {"a": 2, "b": 1}), (60, {"a": 1, "b": 1})]

# id: (datasets order of the new mixture, new schedule, batches before the save, edit point S,
#      workers of the resumed loader). The saved position is BATCH * k (52: mid-block; 48 and 60:
#      block starts, where the edited stage starts exactly at the saved position).
EDITS = {
    "future-weights": (("a", "b"), [(0, {"a": 2, "b": 1}), (60, {"a": 1, "b": 2})], 13, 60, 0),
    "edited-stage-starts-at-saved-position": (("a", "b"), [(0, {"a": 2, "b": 1}),
                                                           (60, {"a": 1, "b": 2})], 15, 60, 0),
    "stage-added": (("a", "b"), [(0, {"a": 2, "b": 1}), (54, {"a": 5, "b": 1}),
                                 (60, {"a": 1, "b": 1})], 13, 54, 2),
    "future-stage-removed": (("a", "b"), [(0, {"a": 2, "b": 1})], 13, 60, 0),
    "future-stage-moved-later": (("a", "b"), [(0, {"a": 2, "b": 1}), (72, {"a": 1, "b": 1})],
                                 13, 60, 0),
    "stage-at-saved-position": (("a", "b"), [(0, {"a": 2, "b": 1}), (48, {"a": 1, "b": 3}),
                                             (60, {"a": 1, "b": 1})], 12, 48, 0),
    # a new source inserted in the middle of the dict; ties between c and b (equal weights) go to
    # c, listed first; 6 * 3/7 and 6 * 2/7 are not whole, so remainders matter
    "source-inserted": (("a", "c", "b"), [(0, {"a": 2, "b": 1}), (60, {"a": 3, "c": 2, "b": 2})],
                        13, 60, 2),
    "source-first-at-saved-position": (("c", "a", "b"), [(0, {"a": 2, "b": 1}),
                                                         (48, {"c": 1, "a": 1, "b": 1})], 12, 48, 0),
}


def resume_with_edit(case: str):
    """Old run saved after k batches, state through JSON, resumed over the edited mixture.

    -> (old mixture, new mixture, saved position, edit point, resumed stream, old reference,
        new reference); streams are flat item lists of TOTAL batches.
    """
    names, schedule, k, edit, workers = EDITS[case]
    old_mix, new_mix = make(OLD), make(schedule, names)
    old_ref = run_until(loader(make(OLD)), TOTAL)
    new_ref = run_until(loader(make(schedule, names)), TOTAL)
    first = loader(old_mix)
    head = run_until(first, k)
    state = roundtrip(first.state_dict())
    position = BATCH * k
    assert state["version"] >= 2 and state["consumed"] == position
    prefix = old_mix.resume_prefix(position)  # (a state lists the sources, sorted by name)
    assert state["schedule"] == dict(prefix, sources=[[n, *v] for n, v in sorted(prefix["sources"].items())])
    second = loader(new_mix, num_workers=workers)
    second.load_state_dict(state)
    assert second.consumed == position
    tail = run_until(second, TOTAL - k)
    assert head + tail == new_ref  # batch by batch: exactly a fresh run of the new schedule
    return old_mix, new_mix, position, edit, flat(head + tail), flat(old_ref), flat(new_ref)


@pytest.mark.parametrize("case", list(EDITS))
def test_future_edit_resumes_exactly(case):
    old_mix, new_mix, position, edit, got, old_ref, new_ref = resume_with_edit(case)
    assert position <= edit
    assert got[:edit] == old_ref[:edit]  # up to the edit point: the old schedule exactly
    assert got[edit:] == new_ref[edit:]  # from it on: the new schedule exactly
    assert got[edit:] != old_ref[edit:]  # (the edit does change what is read)
    # the streams are the mixtures' own: item j is what locate() says mixture index j is
    assert got == [int(x) for x in new_mix.__getitems__(list(range(len(got))))]
    old_src, old_local = old_mix.locate(np.arange(edit))
    new_src, new_local = new_mix.locate(np.arange(edit))
    assert [old_mix.names[k] for k in old_src.tolist()] == [new_mix.names[k] for k in new_src.tolist()]
    assert np.array_equal(old_local, new_local)


@pytest.mark.parametrize("case", ["stage-added", "stage-at-saved-position", "source-inserted",
                                  "source-first-at-saved-position", "future-weights"])
def test_exact_shares_after_the_edit(case):
    _, new_mix, _, edit, got, _, _ = resume_with_edit(case)
    starts = [s for s, _ in new_mix.stages]
    s = starts.index(edit)
    end = min(starts[s + 1] if s + 1 < len(starts) else len(got), len(got)) // B * B
    assert end - edit >= B
    props = list(new_mix.stages[s][1].values())  # in datasets order: the tie-break order
    names = [decode(x)[0] for x in got]
    for m in range(B, end - edit + 1, B):  # whole blocks since the stage started
        counts = [names[edit:edit + m].count(n) for n in new_mix.names]
        assert counts == largest_remainder(props, m), (m, counts)
        for c, p in zip(counts, props):
            assert math.floor(m * p) <= c <= math.ceil(m * p)
        assert counts == list(new_mix.source_counts(edit, edit + m).values())


@pytest.mark.parametrize("case", list(EDITS))
def test_no_repeat_or_skip_within_a_source_pass_across_the_edit(case):
    old_mix, new_mix, position, edit, got, _, _ = resume_with_edit(case)
    indices = np.arange(len(got))
    src, local = new_mix.locate(indices)
    read = [decode(x) for x in got]
    assert read == [(new_mix.names[k], i) for k, i in zip(src.tolist(), local.tolist())]
    # before the saved position the old mixture read the same (source, index) pairs
    old_src, old_local = old_mix.locate(np.arange(position))
    assert read[:position] == [(old_mix.names[k], i) for k, i in zip(old_src.tolist(),
                                                                       old_local.tolist())]
    _, stream_pos = new_mix.schedule.positions(indices)  # each source's own stream position
    straddling = 0
    for name in new_mix.names:
        n = LENGTHS[name]
        mine = [(int(L), r[1], j) for j, (r, L) in enumerate(zip(read, stream_pos)) if r[0] == name]
        mine.sort()
        assert [L for L, _, _ in mine] == list(range(len(mine)))  # no stream position skipped or repeated
        for p in range(len(mine) // n + 1):  # pass p: stream positions [p*n, (p+1)*n)
            this = mine[p * n:(p + 1) * n]
            served = [i for _, i, _ in this]
            if len(this) == n:
                assert sorted(served) == list(range(n)), (name, p)  # a completed pass: each once
            else:
                assert len(set(served)) == len(served), (name, p)  # the current one: no repeat
            at = [j for _, _, j in this]
            straddling += bool(at) and min(at) < position <= max(at)
    assert straddling  # some pass was begun before the save and finished after it


def test_schedule_edit_with_world_size_change_and_workers():
    """2 ranks x 2 under the old schedule -> 1 rank x 4 with 2 workers under the edited one."""
    names, schedule, _, edit, _ = EDITS["source-inserted"]
    new_ref = run_until(loader(make(schedule, names)), TOTAL)
    old = [loader(make(OLD), 2, rank=r, world_size=2) for r in range(2)]
    head = lockstep_steps(old, 13)
    states = [roundtrip(l.state_dict()) for l in old]
    assert states[0] == states[1] and states[0]["consumed"] == 52 and states[0]["world_size"] == 2
    new = loader(make(schedule, names), num_workers=2)
    new.load_state_dict(states[0])
    tail = run_until(new, TOTAL - 13)
    assert [sorted(s) for s in head] == [sorted(b) for b in new_ref[:13]]
    assert tail == new_ref[13:]
    assert new.consumed == BATCH * TOTAL > edit


# The saved run: sources a, b, c; c joins at 48; saved at 64; a future stage at 72.
PAST = [(0, {"a": 2, "b": 1}), (48, {"a": 1, "b": 1, "c": 1}), (72, {"a": 1, "b": 2})]
SAVED_AT = 64

# id: (new schedule, make() keyword changes, the first differing mixture index named)
REFUSED = {
    "past-stage-weights": ([(0, {"a": 2, "b": 1}), (48, {"a": 1, "b": 2, "c": 1}),
                            (72, {"a": 1, "b": 2})], {}, 48),
    "first-stage-weights": ([(0, {"a": 1, "b": 1}), (48, {"a": 1, "b": 1, "c": 1}),
                             (72, {"a": 1, "b": 2})], {}, 0),
    "past-stage-moved-later": ([(0, {"a": 2, "b": 1}), (54, {"a": 1, "b": 1, "c": 1}),
                                (72, {"a": 1, "b": 2})], {}, 48),
    "past-stage-moved-earlier": ([(0, {"a": 2, "b": 1}), (42, {"a": 1, "b": 1, "c": 1}),
                                  (72, {"a": 1, "b": 2})], {}, 42),
    "future-stage-moved-before-save": ([(0, {"a": 2, "b": 1}), (48, {"a": 1, "b": 1, "c": 1}),
                                        (60, {"a": 1, "b": 2})], {}, 60),
    "stage-inserted-in-the-past": ([(0, {"a": 2, "b": 1}), (30, {"a": 1, "b": 1}),
                                    (48, {"a": 1, "b": 1, "c": 1}), (72, {"a": 1, "b": 2})], {}, 30),
    "past-stage-removed": ([(0, {"a": 2, "b": 1}), (72, {"a": 1, "b": 2, "c": 1})], {}, 48),
    "seed": (PAST, {"seed": 5}, 0),
    "block-size": (PAST, {"block_size": 3}, 0),
    "sources-reordered": (PAST, {"names": ("b", "a", "c")}, 0),
    "source-used-from-0-replaced": (PAST, {"b": Src("b", 12)}, 0),
    "source-used-from-48-replaced": (PAST, {"c": Src("c", 8)}, 48),
    "source-used-from-48-other-identity": (PAST, {"c": OtherSrc("c")}, 48),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_edit_before_the_saved_position_is_refused(case):
    schedule, changes, index = REFUSED[case]
    changes = dict(changes)
    names = changes.pop("names", ("a", "b", "c"))
    old_mix = make(PAST, ("a", "b", "c"))
    first = loader(old_mix)
    run_until(first, SAVED_AT // BATCH)
    state = roundtrip(first.state_dict())
    new_mix = make(schedule, names, **changes)
    second = loader(new_mix)
    it = iter(second)
    before = [next(it) for _ in range(3)]  # the new loader has consumed 12 of its own
    assert second.consumed == 12
    with pytest.raises(ValueError, match=rf"first differ at mixture index {index} \("):
        second.load_state_dict(state)
    assert second.consumed == 12  # unchanged: the refused state took no effect
    assert flat(before + [next(it)]) == [int(x) for x in new_mix.__getitems__(list(range(16)))]
    assert second.consumed == 16  # and the live iterator still counts
    # the index named is sound: both mixtures read every index before it alike ...
    src_old, local_old = old_mix.locate(np.arange(index))
    src_new, local_new = new_mix.locate(np.arange(index))
    assert [old_mix.names[k] for k in src_old.tolist()] == [new_mix.names[k] for k in src_new.tolist()]
    assert np.array_equal(local_old, local_new)
    if case != "source-used-from-48-other-identity":  # (same items, other identity)
        # ... and they really differ somewhere between it and the saved position
        src_old, local_old = old_mix.locate(np.arange(index, SAVED_AT))
        src_new, local_new = new_mix.locate(np.arange(index, SAVED_AT))
        old_read = [(old_mix.names[k], i) for k, i in zip(src_old.tolist(), local_old.tolist())]
        new_read = [(new_mix.names[k], i) for k, i in zip(src_new.tolist(), local_new.tolist())]
        assert old_read != new_read


def test_the_same_edits_load_when_saved_earlier():
    """The edits refused above at 64 change nothing before 42: a state saved at 40 loads."""
    old_mix = make(PAST, ("a", "b", "c"))
    first = loader(old_mix)
    run_until(first, 10)
    state = roundtrip(first.state_dict())
    for case in ("past-stage-weights", "past-stage-moved-later", "past-stage-moved-earlier",
                 "future-stage-moved-before-save", "past-stage-removed",
                 "source-used-from-48-replaced", "source-used-from-48-other-identity"):
        schedule, changes, _ = REFUSED[case]
        new_mix = make(schedule, ("a", "b", "c"), **changes)
        second = loader(new_mix)
        second.load_state_dict(state)
        assert second.consumed == 40
        assert flat(run_until(second, 3)) == [int(x) for x in new_mix.__getitems__(list(range(40, 52)))]


def test_a_tampered_schedule_in_the_state_is_refused():
    names, schedule, _, _, _ = EDITS["future-weights"]
    first = loader(make(OLD))
    run_until(first, 13)
    state = roundtrip(first.state_dict())
    state["schedule"]["stages"][0][1] = [["a", "1/2"], ["b", "1/2"]]
    with pytest.raises(ValueError, match="first differ at mixture index 0"):
        loader(make(schedule, names)).load_state_dict(state)
    plain = roundtrip(first.state_dict())
    plain["schedule"] = None
    with pytest.raises(ValueError, match="schedule is null"):
        loader(make(schedule, names)).load_state_dict(plain)


def test_a_source_in_no_stage_or_without_data_is_refused():
    with pytest.raises(ValueError, match=r"\['c'\] are named in no stage"):
        make([(0, {"a": 2, "b": 1}), (60, {"a": 1, "b": 1})], ("a", "c", "b"))
    with pytest.raises(ValueError, match=r"source 'c' is empty"):
        make([(0, {"a": 2, "b": 1}), (60, {"a": 1, "b": 1, "c": 1})], ("a", "c", "b"),
             c=Src("c", 0))
    with pytest.raises(ValueError, match=r"source 'c' is empty"):  # even if only used later
        make([(0, {"a": 2, "b": 1}), (600, {"c": 1})], ("a", "b", "c"), c=Src("c", 0))
    # a stage that does not name a source gives it weight 0
    mix = make([(0, {"a": 1}), (12, {"b": 1})])
    assert mix.stages[0][1] == {"a": 1, "b": 0} and mix.source_counts(0, 12) == {"a": 12, "b": 0}


def test_a_version_1_mixture_state_still_loads():
    mix = make(OLD)
    first = loader(mix)
    run_until(first, 13)
    state = first.state_dict()
    v1 = {k: v for k, v in state.items() if k not in ("schedule", "content", "steps", "skips")}
    v1.update(version=1, fingerprint=mix.fingerprint)  # what version 1 saved for a mixture
    second = loader(make(OLD))
    second.load_state_dict(v1)
    assert second.consumed == 52


# -- 2. batch size and world size changes ---------------------------------------------------------

def run_phase(n: int, world: int, batch: int, num_steps: int, state=None, **kw):
    """``num_steps`` global steps of ``world`` lockstep ranks over range(n) (shuffled, seed 0),
    after loading ``state`` into every rank; each rank's batch checked position by position.

    -> (global positions read, dataset indices read, consumed at each iter() end, rank 0's state)
    """
    loaders = []
    for r in range(world):
        ds = IdDataset(n)
        sampler = tc.DistributedSampler(ds, num_replicas=world, rank=r, shuffle=True, seed=0)
        loaders.append(tc.DataLoader(ds, batch_size=batch, sampler=sampler, **kw))
        if state is not None:
            loaders[-1].load_state_dict(state)
    stream = loaders[0].sampler
    positions: list[int] = []
    read: list[int] = []
    ends: list[int] = []
    iters = [iter(l) for l in loaders]
    steps = 0
    while steps < num_steps:
        before = {l.consumed for l in loaders}
        assert len(before) == 1
        start = before.pop()
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            assert not ends or ends[-1] != start, "an iter() yielded nothing"
            ends.append(start)
            iters = [iter(l) for l in loaders]
            continue
        assert all(b is not None for b in batches), "ranks ended their epoch at different steps"
        sizes = {len(ids(b)) for b in batches}
        assert len(sizes) == 1
        size = sizes.pop()
        for r, b in enumerate(batches):  # rank r's item t is global position start + r + W*t
            pos = start + r + world * np.arange(size)
            assert ids(b) == stream.indices_for_positions(pos).tolist()
            positions += pos.tolist()
            read += ids(b)
        assert {l.consumed for l in loaders} == {start + world * size}
        steps += 1
    states = [roundtrip(l.state_dict()) for l in loaders]
    assert all(s == states[0] for s in states)
    return positions, read, ends, states[0]


def check_union(n: int, positions: list[int], read: list[int], end: int) -> None:
    """The phases together read global positions [0, end) once each, and so each dataset index
    exactly once per permutation epoch (the last one, partial, without repeats)."""
    assert sorted(positions) == list(range(end))
    by_epoch: dict[int, list[int]] = {}
    for p, i in zip(positions, read):
        by_epoch.setdefault(p // n, []).append(i)
    for e, got in sorted(by_epoch.items()):
        if e < end // n:
            assert sorted(got) == list(range(n)), f"permutation epoch {e}"
        else:
            assert len(set(got)) == len(got) and len(got) == end % n
    assert end // n >= 1  # at least one epoch boundary crossed


def test_world_and_batch_size_changes_continue_the_stream():
    """W=2 x 8 -> W=1 x 32 -> W=4 x 2, n = 90: every index of every epoch once."""
    n = 90
    p1, r1, _, s1 = run_phase(n, 2, 8, 5)
    assert s1["consumed"] == 80
    p2, r2, ends2, s2 = run_phase(n, 1, 32, 3, s1)
    assert ends2 == [90]  # W=1: the loader epoch ends at E = 90 (a short batch of 10 before it)
    assert s2["consumed"] == 154 and s2["world_size"] == 1 and s2["batch_size"] == 32
    p3, r3, ends3, s3 = run_phase(n, 4, 2, 10, s2, num_workers=2)
    # W=4: E = 92; started at 154 (not a multiple of 4) the iter() ends at the first row end
    # past 184: 154 + 4 * ceil((184 - 154) / 4) = 186
    assert ends3 == [186] and s3["consumed"] == 234
    check_union(n, p1 + p2 + p3, r1 + r2 + r3, 234)


def test_batch_size_ramp_continues_the_stream():
    """Batch 4, then 8 (with workers), then 16, via new loaders loading the previous state."""
    n = 90
    p1, r1, _, s1 = run_phase(n, 2, 4, 5)
    p2, r2, ends2, s2 = run_phase(n, 2, 8, 4, s1, num_workers=2)
    assert s1["consumed"] == 40 and ends2 == [] and s2["consumed"] == 90  # 8, 8, 8 and 1 per rank
    p3, r3, ends3, s3 = run_phase(n, 2, 16, 4, s2)
    assert ends3 == [180] and s3["consumed"] == 212  # 16, 16, 13 per rank to the epoch end, 16
    check_union(n, p1 + p2 + p3, r1 + r2 + r3, 212)


def test_world_size_change_mid_epoch_with_n_not_divisible_by_w():
    """n = 50: W=4 (loader epoch E = 52) then W=3 (E = 51), resumed mid-epoch at 32.

    What happens: the state is the global position 32; the stream of global positions just goes
    on (position p reads permutation epoch p // 50, offset p % 50, whatever W is). An iter()
    ends at the loader-epoch end E = W * ceil(n / W) computed with the *current* W, rounded up to
    whole rows of W from its start: from 32 with W=3 that is 32 + 3 * ceil((51 - 32) / 3) = 53
    (with W=4 it would have been 52), so positions 50-52 (epoch 1's first three) are read at the
    end of that iter(); the next iter() starts at 53, in loader epoch 53 // 51 = 1, and ends at
    53 + 3 * ceil((102 - 53) / 3) = 104. Loader epochs no longer line up with permutation epochs,
    but no position of the stream is lost or read twice.
    """
    n = 50
    p1, r1, _, s1 = run_phase(n, 4, 2, 4)
    assert s1["consumed"] == 32
    check = tc.DistributedSampler(IdDataset(n), num_replicas=4, rank=0)
    assert check.iteration_length(32) == 5  # W=4 would end this loader epoch at 32 + 4 * 5 = 52
    p2, r2, ends2, s2 = run_phase(n, 3, 2, 16, s1)
    assert ends2 == [53, 104]
    assert s2["consumed"] == 122
    check_union(n, p1 + p2, r1 + r2, 122)


# -- 3. per-source accounting ---------------------------------------------------------------------

def accounting_mix(**kw) -> MixtureDataset:
    return make([(0, {"a": 2, "b": 1}), (48, {"a": 1, "b": 1, "c": 1}), (96, {"c": 1})],
                ("a", "b", "c"), **kw)


def test_source_epochs_match_the_items_read():
    mix = accounting_mix()
    batches = run_until(loader(mix), 40)
    names = [decode(x)[0] for x in flat(batches)]
    for position in range(0, 161, 4):
        got = mix.source_epochs(position)
        want = {n: names[:position].count(n) / LENGTHS[n] for n in mix.names}
        assert got == want, position
        assert mix.schedule.source_epochs(position) == want
    assert mix.source_epochs(160)["c"] > 8  # many passes over the 7 samples of c


def first_read_beyond(mix: MixtureDataset, name: str, allowed: int, stop: int) -> int | None:
    """Brute force over locate(): the index reading the source's sample number allowed + 1."""
    src, _ = mix.locate(np.arange(stop))
    hits = np.flatnonzero(src == mix.names.index(name))
    return int(hits[allowed]) if hits.size > allowed else None


# at 150 samples: a 48 of 23 (2.09 passes), b 32 of 11 (2.91), c 70 of 7 (10)
@pytest.mark.parametrize("cap, name", [(3, "c"), (9.5, "c"), ({"a": 1.5}, "a"),
                                       ({"b": Fraction(5, 2), "c": 11}, "b"), ({"c": 2}, "c"),
                                       ({"a": None, "b": 0.2}, "b")])
def test_max_epochs_per_source_names_the_source_and_index(cap, name):
    total = 150
    base = accounting_mix()
    allowed = math.floor(Fraction(str(cap[name]) if isinstance(cap, dict) else str(cap))
                         * LENGTHS[name])
    index = first_read_beyond(base, name, allowed, total)
    assert index is not None
    stage = [s for s, (start, _) in enumerate(base.stages) if start <= index][-1]
    caps = cap if isinstance(cap, dict) else {n: cap for n in base.names}
    assert all(first_read_beyond(base, other, math.floor(Fraction(str(c)) * LENGTHS[other]), total)
               is None for other, c in caps.items() if other != name and c is not None)
    with pytest.raises(ValueError, match=rf"source '{name}' \({LENGTHS[name]} samples\).*mixture "
                                         rf"index {index} in schedule stage {stage} .*sample number "
                                         rf"{allowed + 1}\b"):
        accounting_mix(max_epochs_per_source=cap, total_samples=total)


def test_max_epochs_per_source_passes_under_the_cap():
    total = 150
    counts = accounting_mix().source_counts(0, total)
    exact = {n: Fraction(c, LENGTHS[n]) for n, c in counts.items()}
    accounting_mix(max_epochs_per_source=exact, total_samples=total)  # exactly at the caps
    accounting_mix(max_epochs_per_source=100, total_samples=total)
    for n in counts:  # one sample fewer allowed: refused at that source's last read
        lower = dict(exact, **{n: Fraction(counts[n] - 1, LENGTHS[n])})
        index = first_read_beyond(accounting_mix(), n, counts[n] - 1, total)
        with pytest.raises(ValueError, match=rf"source '{n}'.*mixture index {index} "):
            accounting_mix(max_epochs_per_source=lower, total_samples=total)
    # the cap only looks at the first total_samples: c, read from index 48 on, may have cap 0
    accounting_mix(max_epochs_per_source={"c": Fraction(counts_at(48)["c"], 7)}, total_samples=48)


def test_max_epochs_per_source_reports_the_earliest_violation():
    mix = accounting_mix()
    first = {n: first_read_beyond(mix, n, math.floor(Fraction(3, 2) * LENGTHS[n]), 150)
             for n in mix.names}
    assert first == {"a": 54, "b": 49, "c": 78}  # b's cap is the first one exceeded
    with pytest.raises(ValueError, match=r"source 'b' .*mixture index 49 "):
        accounting_mix(max_epochs_per_source=1.5, total_samples=150)


def counts_at(stop: int) -> dict[str, int]:
    return accounting_mix().source_counts(0, stop)


def test_max_epochs_per_source_argument_errors():
    with pytest.raises(ValueError, match="needs total_samples"):
        accounting_mix(max_epochs_per_source=2)
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['zzz'\]"):
        accounting_mix(max_epochs_per_source={"zzz": 1}, total_samples=10)
    with pytest.raises(ValueError, match="total_samples"):
        accounting_mix(max_epochs_per_source=2, total_samples=0)
