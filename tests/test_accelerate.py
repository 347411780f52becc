"""accelerate: `accelerator.prepare(tc.DataLoader(...))` keeps our per-rank batches, and
`save_state`/`load_state` carry the loader's state (DESIGN.md §9.4).

The training script is a plain script, as users write them, run under
`torchrun --nproc_per_node 2` (gloo, CPU) and as one plain process. Each rank must yield exactly
the batches our loader yields without accelerate, and a run restarted from `save_state` must
continue with exactly the batches the uninterrupted run received after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import torchcache as tc
from conftest import paragraphs

pytest.importorskip("accelerate")

SEQ, BATCH, SEED, SAVE_AT = 16, 4, 7, 5

SCRIPT = textwrap.dedent(f"""\
    import json
    import os
    import sys

    import torch
    from accelerate import Accelerator

    import torchcache as tc

    cache, out, phase, workers, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear({SEQ}, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    ds = tc.TokenDataset(cache, seq_len={SEQ})
    sampler = tc.DistributedSampler(ds, shuffle=True, seed={SEED})
    loader = tc.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rows = []


    def step(batch):
        rows.append(batch["input_ids"].tolist())
        loss = model(batch["input_ids"].float() / 50000).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


    if phase == "fresh":
        for batch in loader:  # loader epoch 0
            step(batch)
        for i, batch in enumerate(loader):  # loader epoch 1, saved after {SAVE_AT} batches
            step(batch)
            if i + 1 == {SAVE_AT}:
                accelerator.save_state(out + "/checkpoint")
    else:
        accelerator.load_state(out + "/checkpoint")
        for batch in loader:  # the rest of loader epoch 1
            step(batch)
    result = {{"rows": rows, "num_processes": accelerator.num_processes}}
    with open(f"{{out}}/{{phase}}-rank{{accelerator.process_index}}.json", "w") as f:
        json.dump(result, f)
    accelerator.end_training()  # destroys the process group (gloo may abort at exit otherwise)
    # Leave without the interpreter's teardown: after accelerator.load_state(), torch + gloo
    # abort at exit now and then ("terminate called without an active exception"), with or
    # without torchcache (a plain TensorDataset script did so 3 times in 8 under torchrun).
    # Everything this test checks is written above.
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    """About 100 samples of 16 tokens: 13 batches of 4 per rank and loader epoch with 2 ranks."""
    out = tmp_path_factory.mktemp("accelerate") / "cache"
    tc.build_cache(iter(paragraphs(books, 60)), out, gpt2_tokenizer_path, progress=False)
    return str(out)


def expected_rows(cache: str, rank: int, world_size: int) -> list[list[list[int]]]:
    """Two loader epochs of our loader for ``rank`` of ``world_size``, without accelerate."""
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    sampler = tc.DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = tc.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    return [batch["input_ids"].tolist() for _ in range(2) for batch in loader]


def run_script(tmp_path: Path, cache: str, phase: str, workers: int, world_size: int,
               batch: int = BATCH) -> list[dict]:
    """Run the training script (torchrun with ``world_size`` > 1) -> each rank's result."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(script), cache, str(tmp_path), phase, str(workers), str(batch)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    results = [json.loads((tmp_path / f"{phase}-rank{r}.json").read_text()) for r in range(world_size)]
    assert [r["num_processes"] for r in results] == [world_size] * world_size
    return results


def check_run_and_resume(tmp_path: Path, cache: str, workers: int, world_size: int) -> None:
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    epoch = -(-len(ds) // world_size) // BATCH + bool(-(-len(ds) // world_size) % BATCH)
    assert epoch > SAVE_AT
    fresh = run_script(tmp_path, cache, "fresh", workers, world_size)
    for rank, result in enumerate(fresh):
        # every batch our loader makes for this rank, in order, none lost and none added
        assert result["rows"] == expected_rows(cache, rank, world_size), f"rank {rank}"
    every_sample = {tuple(row) for r in fresh for batch in r["rows"][:epoch] for row in batch}
    assert every_sample == {tuple(row) for row in ds.get_batch(range(len(ds)))["input_ids"].tolist()}

    resumed = run_script(tmp_path, cache, "resume", workers, world_size)
    for rank, (before, after) in enumerate(zip(fresh, resumed)):
        assert after["rows"] == before["rows"][epoch + SAVE_AT:], f"rank {rank} after load_state"


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
@pytest.mark.parametrize("workers", [0, 2])
def test_torchrun_two_processes_keep_our_batches_and_resume(tmp_path, cache, workers):
    check_run_and_resume(tmp_path, cache, workers, world_size=2)


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_a_two_process_checkpoint_resumes_on_one_process(tmp_path, cache):
    """save_state under torchrun (2 ranks x 4), load_state in one process (1 x 8, the same global
    batch): the run continues with the global stream's next samples, none lost or repeated."""
    run_script(tmp_path, cache, "fresh", 0, 2)  # saves its checkpoint
    resumed = run_script(tmp_path, cache, "resume", 0, 1, batch=2 * BATCH)
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    ranks = [tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(
        ds, num_replicas=2, rank=r, shuffle=True, seed=SEED)) for r in range(2)]
    for loader in ranks:  # where the 2-rank run saved: loader epoch 1, after SAVE_AT batches
        list(loader)
        it = iter(loader)
        for _ in range(SAVE_AT):
            next(it)
    single = tc.DataLoader(ds, batch_size=2 * BATCH, sampler=tc.DistributedSampler(
        ds, num_replicas=1, rank=0, shuffle=True, seed=SEED))
    single.load_state_dict(ranks[0].state_dict())
    expected = [batch["input_ids"].tolist() for batch in single]
    assert resumed[0]["rows"] == expected and len(expected) > 1


@pytest.mark.slow
def test_one_process_keeps_our_loader_and_resumes(tmp_path, cache):
    check_run_and_resume(tmp_path, cache, workers=0, world_size=1)


def test_torchcache_does_not_import_accelerate(cache):
    """accelerate is an optional extra: reading and loading never import it."""
    code = ("import sys, torchcache as tc\n"
            f"ds = tc.TokenDataset({cache!r}, seq_len={SEQ})\n"
            "next(iter(tc.DataLoader(ds, batch_size=2)))\n"
            "assert 'accelerate' not in sys.modules, 'accelerate was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
