"""Shared helpers for the sampler / loader / distributed tests (importable by spawned workers)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from torchcache.train.loader import DataLoader
from torchcache.train.sampler import DistributedSampler


class IdDataset(Dataset):
    """Item ``i`` is ``torch.tensor([i])``: batches reveal exactly which samples were read."""

    def __init__(self, n: int, fingerprint: str | None = "ids-v1") -> None:
        self.n = n
        self.fingerprint = None if fingerprint is None else f"{fingerprint}-{n}"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([i])


def ids(batch: torch.Tensor) -> list[int]:
    return batch.flatten().tolist()


def run_until(loader: DataLoader, num_batches: int) -> list[list[int]]:
    """Iterate loader epochs until ``num_batches`` batches were received (an epoch loop)."""
    out: list[list[int]] = []
    while len(out) < num_batches:
        before = len(out)
        for batch in loader:
            out.append(ids(batch))
            if len(out) == num_batches:
                break
        assert len(out) > before, "an iter() yielded nothing before the end"
    return out


def interleave(per_rank: Sequence[Sequence[int]]) -> list[int]:
    """Global stream from per-rank streams: rank r's j-th item is global item j*W + r."""
    lengths = {len(s) for s in per_rank}
    assert len(lengths) == 1, f"ranks yielded different counts: {[len(s) for s in per_rank]}"
    return [int(x) for row in zip(*per_rank) for x in row]


def lockstep_steps(loaders: Sequence[DataLoader], num_steps: int | None,
                   keys: Callable[[Any], list] | None = None) -> list[list]:
    """Run one loader per simulated rank in lock-step; each step's ids (``keys(batch)``, default
    the batch's ids) from all ranks. ``num_steps=None``: until the loaders' current epoch ends.

    A new ``iter()`` is started on every rank when their iterators end (all at once).
    """
    keys = keys or ids
    steps: list[list] = []
    iters = [iter(l) for l in loaders]
    empty_epochs = 0
    while num_steps is None or len(steps) < num_steps:
        batches = [next(it, None) for it in iters]
        if all(b is None for b in batches):
            if num_steps is None:
                break
            empty_epochs += 1
            assert empty_epochs < 3, "loaders keep yielding empty epochs"
            iters = [iter(l) for l in loaders]
            continue
        assert all(b is not None for b in batches), "ranks ended their epoch at different steps"
        empty_epochs = 0
        steps.append([i for b in batches for i in keys(b)])
    return steps


def check_contiguous(steps: Sequence[Sequence[int]], start: int, sampler: DistributedSampler) -> int:
    """Assert each global step holds the next contiguous block of stream positions; -> end."""
    pos = start
    for t, step in enumerate(steps):
        want = sampler.indices_for_positions(np.arange(pos, pos + len(step), dtype=np.int64))
        assert sorted(step) == sorted(want.tolist()), f"global step {t} (positions from {pos}) differs"
        pos += len(step)
    return pos


def make_loader(n: int, batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 3,
                **kwargs) -> DataLoader:
    sampler_kw = {k: kwargs.pop(k) for k in ("infinite", "max_epochs", "max_samples", "shuffle")
                  if k in kwargs}
    ds = IdDataset(n)
    sampler = DistributedSampler(ds, seed=seed, rank=rank, world_size=world_size, **sampler_kw)
    return DataLoader(ds, batch_size=batch_size, sampler=sampler, **kwargs)


# -- real torch.distributed workers (spawned by tests/test_distributed.py) ----------------------

DIST_N = 60
DIST_SEED = 11
DIST_GLOBAL_BATCH = 8


def dist_worker(rank: int, world_size: int, init_file: str, workdir: str, mode: str,
                num_steps: int, save_at: int) -> None:
    """One rank: run ``num_steps`` global steps, all_gather each, rank 0 writes them to JSON.

    mode "fresh" saves each rank's loader state after ``save_at`` steps; mode "resume" loads
    rank 0's saved state first (the states of all ranks are identical).
    """
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        ds = IdDataset(DIST_N)
        sampler = DistributedSampler(ds, seed=DIST_SEED)  # rank and world size from torch.distributed
        assert (sampler.rank, sampler.world_size) == (rank, world_size)
        loader = DataLoader(ds, batch_size=DIST_GLOBAL_BATCH // world_size, sampler=sampler)
        if mode == "resume":
            with open(os.path.join(workdir, "state_rank0.json")) as f:
                loader.load_state_dict(json.load(f))
        start = loader.consumed
        steps = []
        it = iter(loader)
        while len(steps) < num_steps:
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                continue
            gathered = [torch.empty_like(batch) for _ in range(world_size)]
            dist.all_gather(gathered, batch)
            steps.append([i for b in gathered for i in ids(b)])
            if mode == "fresh" and len(steps) == save_at:
                with open(os.path.join(workdir, f"state_rank{rank}.json"), "w") as f:
                    json.dump(loader.state_dict(), f)
        if rank == 0:
            with open(os.path.join(workdir, f"{mode}_w{world_size}.json"), "w") as f:
                json.dump({"start": start, "steps": steps, "consumed": loader.consumed}, f)
    finally:
        dist.destroy_process_group()
