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

from torchcache.train.sampler import DistributedSampler  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

TOTAL_STEPS = 20  # per-rank epoch of 30 samples in batches of 4: 8 steps per epoch, so 2.5 epochs
SAVE_AT = 5


def launch(world_size: int, workdir: str, mode: str, num_steps: int, timeout: float = 300.0) -> dict:
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


EARLY_SAMPLER_SCRIPT = """
import json, os, sys
import torch.distributed as dist
import torchcache as tc

sampler = tc.DistributedSampler(range(100), shuffle=False)  # before the process group: rank 0 of 1
dist.init_process_group("gloo")
try:
    first = next(iter(tc.DataLoader(range(100), batch_size=4, sampler=sampler)))
    outcome = {"batch": first.tolist()}
except RuntimeError as error:
    outcome = {"error": str(error)}
explicit = tc.DistributedSampler(range(100), num_replicas=1, rank=0, shuffle=False)
outcome["explicit"] = list(explicit)[:3]
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(outcome, f)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_sampler_made_before_the_process_group_refuses_to_read_the_whole_stream(tmp_path):
    """A plain torchrun script (no main guard) that makes the sampler before
    init_process_group would read every sample on every rank: its iter() says so instead."""
    import subprocess
    script = tmp_path / "early.py"
    script.write_text(EARLY_SAMPLER_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "batch" not in outcome
        assert "made before torch.distributed was initialised" in outcome["error"]
        assert f"this is rank {rank}" in outcome["error"]
        assert outcome["explicit"] == [0, 1, 2]  # explicit num_replicas/rank are the user's choice
