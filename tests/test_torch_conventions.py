"""What a PyTorch user expects: torch's DistributedSampler argument order, DataLoader(ds) in order."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.utils.data

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset, ids  # noqa: E402

import torchcache as tc  # noqa: E402


def torch_indices(n: int, *args, epochs: int = 1) -> list[int]:
    sampler = torch.utils.data.DistributedSampler(IdDataset(n), *args)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out += list(sampler)
    return out


def tc_indices(n: int, *args, epochs: int = 1) -> list[int]:
    sampler = tc.DistributedSampler(IdDataset(n), *args)
    return [i for _ in range(epochs) for i in sampler]


@pytest.mark.parametrize("n", [2, 10, 64, 1000])
@pytest.mark.parametrize("rank", [0, 1])
def test_positional_arguments_mean_what_they_mean_in_torch(n, rank):
    args = (2, rank, False, 0)  # num_replicas, rank, shuffle, seed
    assert tc_indices(n, *args, epochs=3) == torch_indices(n, *args, epochs=3)


@pytest.mark.parametrize("n, world", [(7, 2), (10, 3), (5, 8), (1, 4)])
def test_first_epoch_without_shuffle_equals_torch_for_any_size(n, world):
    # torch pads the last positions with the first indices; the continuing stream does the same
    for rank in range(world):
        assert tc_indices(n, world, rank, False) == torch_indices(n, world, rank, False)


def test_positional_binding_and_the_world_size_alias():
    ds = IdDataset(10)
    s = tc.DistributedSampler(ds, 2, 1)
    assert (s.num_replicas, s.world_size, s.rank, s.shuffle, s.seed) == (2, 2, 1, True, 0)
    s = tc.DistributedSampler(ds, 4, 3, False, 7)
    assert (s.world_size, s.rank, s.shuffle, s.seed) == (4, 3, False, 7)
    assert tc.DistributedSampler(ds, world_size=3, rank=2).num_replicas == 3
    assert tc.DistributedSampler(ds, 3, world_size=3).world_size == 3
    with pytest.raises(ValueError, match="num_replicas=2 and world_size=3"):
        tc.DistributedSampler(ds, 2, world_size=3)
    with pytest.raises(ValueError, match="num_replicas"):
        tc.DistributedSampler(ds, 0)
    with pytest.raises(ValueError, match="rank"):
        tc.DistributedSampler(ds, 2, 2)
    assert tc.DistributedSampler(ds, 2, 1, False, 0, True).drop_last  # torch's order: drop_last 6th
    with pytest.raises(TypeError):  # everything after drop_last is keyword-only
        tc.DistributedSampler(ds, 2, 1, False, 0, False, 3)


def test_a_loader_without_a_sampler_reads_in_order_like_torch():
    ds = IdDataset(23)
    assert [ids(b) for b in tc.DataLoader(ds)] == [[i] for i in range(23)]
    batches = [ids(b) for b in tc.DataLoader(ds, batch_size=4)]
    assert batches == [ids(b) for b in torch.utils.data.DataLoader(ds, batch_size=4)]
    assert tc.DataLoader(ds).state_dict()["shuffle"] is False
    shuffled = [i for b in tc.DataLoader(ds, batch_size=4, shuffle=True) for i in ids(b)]
    assert sorted(shuffled) == list(range(23)) and shuffled != list(range(23))


def test_the_loader_positions_its_sampler_through_public_methods():
    ds = IdDataset(20)
    sampler = tc.DistributedSampler(ds, shuffle=False)
    loader = tc.DataLoader(ds, batch_size=2, sampler=sampler)
    version = sampler.position_version
    it = iter(loader)
    assert ids(next(it)) == [0, 1]
    next(it)
    assert sampler.position_version == version + 1  # iter() moved it once; iterating does not
    sampler.set_position(10)  # a move by someone else: the loader takes it as consumed
    assert loader.consumed == 10
    assert ids(next(iter(loader))) == [10, 11]
