"""Steps: `loader.step_samples(t)` is exactly what the loaders of all ranks yield at global step t,
through loader epochs with short last batches, resumes at other world and batch sizes, and skips;
`skip_steps` never trains on a range and resumes skip it too."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import torchcache as tc
from torchcache.order.steps import StepMap, StepSegment


def rank_loaders(n: int, world: int, batch: int, *, state: dict | None = None, drop_last: bool = False,
                 sampler_drop: bool = False, seed: int = 0) -> list[tc.DataLoader]:
    loaders = []
    for rank in range(world):
        sampler = tc.DistributedSampler(range(n), world, rank, shuffle=True, seed=seed,
                                        drop_last=sampler_drop)
        loader = tc.DataLoader(range(n), batch_size=batch, sampler=sampler, drop_last=drop_last)
        if state is not None:
            loader.load_state_dict(json.loads(json.dumps(state)))
        loaders.append(loader)
    return loaders


class Steps:
    """The global batches of a group of rank loaders, one step at a time, as a training loop
    on each rank would receive them (a new pass when a loader epoch ends)."""

    def __init__(self, loaders: list[tc.DataLoader]):
        self.loaders = loaders
        self.iterators = [iter(loader) for loader in loaders]

    def next(self) -> list[list[int]]:
        out = []
        for k, loader in enumerate(self.loaders):
            try:
                batch = next(self.iterators[k])
            except StopIteration:
                self.iterators[k] = iter(loader)
                batch = next(self.iterators[k])
            out.append(batch.tolist())
        return out


def interleaved(per_rank: list[list[int]]) -> list[int]:
    """The ranks' batches of one step as step_samples orders them (rank r: out[r::W])."""
    world = len(per_rank)
    out = [0] * sum(len(b) for b in per_rank)
    for rank, batch in enumerate(per_rank):
        out[rank::world] = batch
    return out


def test_step_samples_equal_every_ranks_batches_in_random_configurations():
    rng = random.Random(0)
    checked = 0
    while checked < 150:
        n, world, batch = rng.randint(1, 40), rng.randint(1, 4), rng.randint(1, 6)
        drop_last, sampler_drop = rng.random() < 0.3, rng.random() < 0.3 and n >= world
        epoch = world * (n // world if sampler_drop else -(-n // world))
        if drop_last and epoch // world < batch:
            continue
        start = rng.choice([0, rng.randint(0, 60)])
        state = None
        if start:
            state = rank_loaders(n, world, batch)[0].state_dict()
            state["consumed"] = start
            state.pop("steps"), state.pop("skips")
            state["version"] = 3  # an older state: its steps start at 0 with its own batching
        loaders = rank_loaders(n, world, batch, state=state, drop_last=drop_last,
                               sampler_drop=sampler_drop)
        steps = Steps(loaders)
        first = loaders[0].step
        for t in range(first, first + 20):
            assert loaders[0].step == t
            assert interleaved(steps.next()) == loaders[0].step_samples(t), (n, world, batch, t)
        checked += 1


def test_steps_survive_a_resume_at_another_world_and_batch_size():
    n = 50
    first = rank_loaders(n, 2, 3)
    steps = Steps(first)
    before = [interleaved(steps.next()) for _ in range(7)]
    state = first[0].state_dict()
    assert state["steps"] == [[0, 0, 2, 3, 50, False]]
    later = rank_loaders(n, 3, 2, state=state)
    assert later[0].step == 7
    assert [later[0].step_samples(t) for t in range(7)] == before  # the past, as it was
    steps = Steps(later)
    after = [interleaved(steps.next()) for _ in range(30)]  # crosses loader epochs
    assert [later[0].step_samples(t) for t in range(7, 37)] == after
    saved = later[0].state_dict()
    assert saved["steps"] == [[0, 0, 2, 3, 50, False], [7, 42, 3, 2, 51, False]]
    again = rank_loaders(n, 1, 6, state=saved)  # and back to one process: the record grows
    assert [again[0].step_samples(t) for t in range(37)] == before + after


def test_skipped_steps_are_never_yielded_and_stay_skipped_after_a_resume():
    n = 40
    loaders = rank_loaders(n, 2, 2)
    reference = loaders[0]
    expected = {t: reference.step_samples(t) for t in range(60)}
    for loader in loaders:
        loader.skip_steps(5, 9)
        loader.skip_steps(20, 23)
    steps = Steps(loaders)
    got = [interleaved(steps.next()) for _ in range(10)]
    assert got == [expected[t] for t in [0, 1, 2, 3, 4, 9, 10, 11, 12, 13]]
    state = loaders[0].state_dict()
    assert state["skips"] == [[5, 9], [20, 23]] and loaders[0].step == 14
    with pytest.raises(ValueError, match="already received"):
        loaders[0].skip_steps(12, 30)
    resumed = rank_loaders(n, 4, 1, state=state)  # another world size: the same skips
    steps = Steps(resumed)
    got = [interleaved(steps.next()) for _ in range(10)]
    assert got == [expected[t] for t in [14, 15, 16, 17, 18, 19, 23, 24, 25, 26]]
    assert resumed[0].skipped_steps == [(5, 9), (20, 23)]


def test_a_skip_reaching_into_the_next_loader_epoch_continues_there():
    loader = tc.DataLoader(range(10), batch_size=3, shuffle=True, seed=1)  # 4 steps per epoch
    expected = [loader.step_samples(t) for t in range(12)]
    loader.skip_steps(2, 6)
    got = [batch.tolist() for batch, _ in zip(loader, range(10))]  # one `for` over the loader
    assert got == [expected[t] for t in (0, 1, 6, 7)]  # then the epoch of steps 4..7 ends
    assert [b.tolist() for b in loader][:2] == [expected[8], expected[9]]


@pytest.mark.parametrize("workers", [0, 2])
def test_skips_with_workers_and_read_ahead(workers, tmp_path, gpt2_tokenizer_path, books):
    texts = [b["text"][:3000] for b in books]
    tc.build_cache(iter(texts), tmp_path / "c", gpt2_tokenizer_path, progress=False)
    ds = tc.TokenDataset(tmp_path / "c", 32)
    loader = tc.DataLoader(ds, batch_size=4, shuffle=True, seed=3, num_workers=workers)
    wanted = [t for t in range(12) if not 3 <= t < 7]
    loader.skip_steps(3, 7)
    got = [batch["input_ids"] for batch, _ in zip(loader, range(len(wanted)))]
    for t, ids in zip(wanted, got):
        rows = [ds[i]["input_ids"] for i in loader.step_samples(t)]
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(ids, rows))


def test_step_arguments_and_refusals():
    loader = tc.DataLoader(range(10), batch_size=2)
    with pytest.raises(ValueError):
        loader.skip_steps(3, 3)
    with pytest.raises(ValueError):
        loader.step_samples(-1)
    mine = tc.DataLoader(range(10), batch_size=2, sampler=list(range(10)))
    with pytest.raises(TypeError, match="sampler of your own"):
        mine.step_samples(0)


def test_a_step_map_checks_its_segments():
    with pytest.raises(ValueError, match="starts with a segment at step 0"):
        StepMap([StepSegment(3, 0, 1, 1, None)])
    with pytest.raises(ValueError, match="not a step segment"):
        StepSegment.from_list([0, 0, 0, 1, None, False], "steps[0]")
    state = tc.DataLoader(range(10), batch_size=2).state_dict()
    with pytest.raises(ValueError, match="sorted"):
        tc.DataLoader(range(10), batch_size=2).load_state_dict(dict(state, skips=[[5, 6], [1, 2]]))
