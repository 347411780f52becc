"""Real torch.distributed (gloo, 2 processes): global steps, save at step k, resume with W = 2 and 1."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _helpers_resume as helpers  # noqa: E402

from torchcache.sample import DistributedSampler  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

TOTAL_STEPS = 20  # per-rank epoch of 30 samples in batches of 4: 8 steps per epoch, so 2.5 epochs
SAVE_AT = 5


def launch(world_size: int, workdir: str, mode: str, num_steps: int, timeout: float = 60.0) -> dict:
    """Run ``helpers.dist_worker`` on ``world_size`` spawned processes; -> rank 0's JSON result."""
    init_file = os.path.join(workdir, f"init-{mode}-{world_size}")
    ctx = mp.start_processes(
        helpers.dist_worker,
        args=(world_size, init_file, workdir, mode, num_steps, SAVE_AT),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed run ({mode}, world_size={world_size}) timed out")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    with open(os.path.join(workdir, f"{mode}_w{world_size}.json")) as f:
        return json.load(f)


def test_two_process_run_then_resume_with_two_and_one_ranks(tmp_path):
    workdir = str(tmp_path)
    reference = DistributedSampler(helpers.IdDataset(helpers.DIST_N), seed=helpers.DIST_SEED)

    fresh = launch(2, workdir, "fresh", TOTAL_STEPS)
    steps = fresh["steps"]
    assert len(steps) == TOTAL_STEPS
    # every global step is the next contiguous block of the global stream (8, or 4 at epoch ends)
    end = helpers.check_contiguous(steps, 0, reference)
    assert end == fresh["consumed"]
    assert [len(s) for s in steps[:8]] == [8] * 7 + [4]

    states = []
    for rank in range(2):
        with open(os.path.join(workdir, f"state_rank{rank}.json")) as f:
            states.append(json.load(f))
    assert states[0] == states[1]
    assert states[0]["consumed"] == SAVE_AT * helpers.DIST_GLOBAL_BATCH and states[0]["world_size"] == 2

    rest = [sorted(s) for s in steps[SAVE_AT:]]
    for world_size in (2, 1):
        resumed = launch(world_size, workdir, "resume", TOTAL_STEPS - SAVE_AT)
        assert resumed["start"] == states[0]["consumed"]
        assert [sorted(s) for s in resumed["steps"]] == rest, f"resume with world_size={world_size}"
        assert resumed["consumed"] == fresh["consumed"]
