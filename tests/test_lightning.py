"""Lightning 2.x: a tc.DataLoader returned from `train_dataloader` is saved in Lightning's
checkpoints and restored from them exactly, with Lightning's default settings (DESIGN.md §9.4).

tc.DistributedSampler is a `torch.utils.data.DistributedSampler` subclass, so Lightning's
`use_distributed_sampler=True` (the default) leaves it in place under DDP instead of wrapping it
in a DistributedSamplerWrapper (which would split each rank's share a second time), and the
fit loop saves the loader's `state_dict()` in every checkpoint (`"combined_loader"`).

The training script is a plain script, run as one process and under
`torchrun --nproc_per_node 2` (gloo, CPU). A run interrupted at step 6 of 12 and resumed from
its checkpoint in a fresh process (`fit(ckpt_path=...)`) must see, step by step, the batches of
the uninterrupted run; each rank gets exactly its share; a checkpoint of 2 ranks resumes on 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchcache as tc
from conftest import paragraphs

pytest.importorskip("lightning")

SEQ, BATCH, SEED, STEPS, SAVE_AT = 16, 3, 7, 12, 6

SCRIPT = textwrap.dedent(f"""\
    import hashlib
    import json
    import os
    import sys
    import time

    import lightning as L
    import torch

    import torchcache as tc

    cache, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    devices = int(os.environ.get("WORLD_SIZE", "1"))


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear({SEQ}, 1)
            self.rows, self.hashes, self.times = [], [], {{}}

        def train_dataloader(self):
            # made here, after Lightning set up the process group: the sampler takes its rank
            ds = tc.TokenDataset(cache, seq_len={SEQ})
            sampler = tc.DistributedSampler(ds, shuffle=True, seed={SEED})
            return tc.DataLoader(ds, batch_size={BATCH}, sampler=sampler)

        def on_train_start(self):
            self.times["start"] = time.perf_counter()

        def training_step(self, batch, batch_idx):
            self.times.setdefault("first_batch", time.perf_counter())
            ids = batch["input_ids"]
            self.rows.append(ids.tolist())
            self.hashes.append(hashlib.sha1(ids.numpy().tobytes()).hexdigest())
            return self.layer(ids.float() / 50000).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)


    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps={SAVE_AT} if phase == "first" else {STEPS},
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False)
    model = Model()
    ckpt = os.path.join(out, "half.ckpt")
    trainer.fit(model, ckpt_path=ckpt if phase.startswith("resume") else None)
    if phase == "first":
        trainer.save_checkpoint(ckpt)
    loader = trainer.train_dataloader
    result = {{"rows": model.rows, "hashes": model.hashes, "world_size": trainer.world_size,
              "sampler": type(loader.sampler).__module__ + "." + type(loader.sampler).__name__,
              "consumed": loader.consumed, "global_step": trainer.global_step,
              "first_batch_s": model.times["first_batch"] - model.times["start"]}}
    with open(os.path.join(out, f"{{phase}}-rank{{trainer.global_rank}}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as in test_accelerate: gloo may abort in the interpreter's teardown
""")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    """23 samples of 16 tokens: loader epochs of 8 batches of 3 (the last one short) on one
    rank, 4 per rank with 2 ranks, so 12 steps cross loader (and Lightning) epochs, and step 6
    is inside one."""
    out = tmp_path_factory.mktemp("lightning") / "cache"
    tc.build_cache(iter(paragraphs(books, 14)), out, gpt2_tokenizer_path, progress=False)
    return str(out)


def expected_rows(cache: str, rank: int, world_size: int, start: int = 0,
                  steps: int = STEPS) -> list[list[list[int]]]:
    """Our loader's first ``steps`` batches for ``rank`` of ``world_size`` from global
    position ``start``, without Lightning, across loader epochs."""
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    sampler = tc.DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)
    loader = tc.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    sampler.set_position(start)  # a move after the loader is made: its next iter() starts there
    rows: list = []
    while len(rows) < steps:
        rows += [batch["input_ids"].tolist() for batch in loader]
    return rows[:steps]


def run_script(tmp_path: Path, cache: str, phase: str, world_size: int) -> list[dict]:
    """Run the training script (torchrun with ``world_size`` > 1) -> each rank's result."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(script), cache, str(tmp_path), phase]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    results = [json.loads((tmp_path / f"{phase}-rank{r}.json").read_text()) for r in range(world_size)]
    assert [r["world_size"] for r in results] == [world_size] * world_size
    for r in results:  # Lightning left our sampler in place (no DistributedSamplerWrapper)
        assert r["sampler"] == "torchcache.train.sampler.DistributedSampler"
    return results


def hashes(rows: list) -> list[str]:
    return [hashlib.sha1(torch.tensor(b).numpy().tobytes()).hexdigest() for b in rows]


def check_fresh_half_and_resume(tmp_path: Path, cache: str, world_size: int) -> list[dict]:
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    per_rank_epoch = -(-(-(-len(ds) // world_size)) // BATCH)  # batches
    assert len(ds) == 23 and per_rank_epoch % SAVE_AT
    assert SAVE_AT < STEPS and per_rank_epoch < STEPS  # the run crosses a loader epoch
    fresh = run_script(tmp_path, cache, "fresh", world_size)
    for rank, result in enumerate(fresh):
        # every batch our loader makes for this rank, in order, none lost and none added
        assert result["rows"] == expected_rows(cache, rank, world_size), f"rank {rank}"
        assert result["global_step"] == STEPS and len(result["hashes"]) == STEPS
    # the ranks together read each sample of the first loader epoch once
    first_epoch = [tuple(row) for r in fresh for batch in r["rows"][:per_rank_epoch] for row in batch]
    everything = {tuple(row) for row in ds.get_batch(range(len(ds)))["input_ids"].tolist()}
    assert set(first_epoch) == everything

    half = run_script(tmp_path, cache, "first", world_size)
    ckpt = torch.load(tmp_path / "half.ckpt", weights_only=False)
    [state] = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]  # our state_dict(), in the checkpoint
    assert state["format"] == "torchcache.loader" and state["consumed"] == SAVE_AT * BATCH * world_size
    resumed = run_script(tmp_path, cache, "resume", world_size)
    for rank, (h, f, r) in enumerate(zip(half, fresh, resumed)):
        assert h["hashes"] == f["hashes"][:SAVE_AT], f"rank {rank} before the checkpoint"
        assert r["hashes"] == f["hashes"][SAVE_AT:], f"rank {rank} after fit(ckpt_path=...)"
        assert r["global_step"] == STEPS and r["consumed"] == f["consumed"]
    return resumed


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_ddp_two_processes_with_lightning_defaults_keep_our_sampler_and_resume(tmp_path, cache):
    check_fresh_half_and_resume(tmp_path, cache, world_size=2)
    # the checkpoint of 2 ranks, resumed on 1: the stream continues where the 2 ranks stopped
    one = run_script(tmp_path, cache, "resume_on_one", world_size=1)[0]
    start = SAVE_AT * BATCH * 2
    assert one["hashes"] == hashes(expected_rows(cache, 0, 1, start, len(one["rows"])))
    assert one["consumed"] == start + sum(len(batch) for batch in one["rows"])  # a short batch at the epoch end
    assert one["global_step"] == STEPS


@pytest.mark.slow
def test_one_process_resumes_exactly(tmp_path, cache):
    check_fresh_half_and_resume(tmp_path, cache, world_size=1)


def test_resume_reads_only_the_batch_it_yields(cache):
    """Resume is O(1): the loader restarts its sampler at the saved position and reads only the
    batch it yields, nothing replayed (at step 6, and 10**9 samples into the stream)."""

    class Counting(tc.TokenDataset):
        rows = 0

        def get_batch(self, indices):
            Counting.rows += len(indices)
            return super().get_batch(indices)

    ds = Counting(cache, seq_len=SEQ)

    def rows_read_for_first_batch(state: dict | None) -> int:
        loader = tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=SEED),
                               prefetch_batches=0)
        if state is not None:
            loader.load_state_dict(state)
        Counting.rows = 0
        next(iter(loader))
        return Counting.rows

    ref = tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=SEED))
    it = iter(ref)
    for _ in range(SAVE_AT):
        next(it)
    at_step = ref.state_dict()
    far = dict(at_step, consumed=10**9)
    assert [rows_read_for_first_batch(s) for s in (None, at_step, far)] == [BATCH] * 3


def test_torchcache_does_not_import_lightning(cache):
    """Lightning is an optional extra: reading and loading never import it."""
    code = ("import sys, torchcache as tc\n"
            f"ds = tc.TokenDataset({cache!r}, seq_len={SEQ})\n"
            "next(iter(tc.DataLoader(ds, batch_size=2)))\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
