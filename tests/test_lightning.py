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

Also step-based runs (an infinite sampler: Lightning fetches one batch ahead of the training
step), epoch-based runs (checkpoints mid-epoch and at an epoch's end), with 0 and 2 workers and
under DDP, each batch compared by a hash of its input_ids, step for step; and, in-process, with
Lightning's own fetcher and CombinedLoader.
"""

from __future__ import annotations

import functools
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
                  steps: int = STEPS, infinite: bool = False) -> list[list[list[int]]]:
    """Our loader's first ``steps`` batches for ``rank`` of ``world_size`` from global
    position ``start``, without Lightning, across loader epochs."""
    ds = tc.TokenDataset(cache, seq_len=SEQ)
    sampler = tc.DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED,
                                    infinite=infinite)
    loader = tc.DataLoader(ds, batch_size=BATCH, sampler=sampler)
    sampler.set_position(start)  # a move after the loader is made: its next iter() starts there
    rows: list = []
    while len(rows) < steps:
        rows += [batch["input_ids"].tolist() for _, batch in zip(range(steps - len(rows)), loader)]
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
    far = dict(at_step, consumed=10**9 // len(ds) * len(ds))  # ~10**9: where a loader epoch starts
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


# ---------------------------------------------------------------- step-based runs (issue 31 #10)
# Lightning's fetcher takes one batch ahead of the training step when the loader has no len()
# (an infinite sampler) and Lightning saves the loader's state while it holds that batch; the
# state must leave it out, or the resumed run starts one batch late. Checkpoints are written
# the way users write them: by ModelCheckpoint(every_n_train_steps) during training, and by
# trainer.save_checkpoint after fit(max_steps) returned.
STEP_SCRIPT = textwrap.dedent(f"""\
    import hashlib
    import json
    import os
    import sys

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    import torchcache as tc

    cache, out, label, cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    devices = int(os.environ.get("WORLD_SIZE", "1"))


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear({SEQ}, 1)
            self.steps, self.rows = [], []

        def train_dataloader(self):
            ds = tc.TokenDataset(cache, seq_len={SEQ})
            sampler = tc.DistributedSampler(ds, shuffle=True, seed={SEED}, infinite=cfg["infinite"])
            return tc.DataLoader(ds, batch_size={BATCH}, sampler=sampler, num_workers=cfg["workers"])

        def training_step(self, batch, batch_idx):
            ids = batch["input_ids"]
            digest = hashlib.sha1(ids.numpy().tobytes()).hexdigest()
            self.steps.append([self.global_step + 1, digest])
            self.rows.append(ids.tolist())
            return self.layer(ids.float() / 50000).mean()

        def configure_optimizers(self):
            if cfg["estimated_stepping_batches"]:  # as for OneCycleLR(total_steps=...)
                print("estimated_stepping_batches", self.trainer.estimated_stepping_batches)
            return torch.optim.SGD(self.parameters(), lr=0.01)


    callbacks = [ModelCheckpoint(dirpath=out, filename=f"every{{n}}-{{{{step}}}}", every_n_train_steps=n,
                                 save_top_k=-1) for n in cfg["save_every"]]
    if cfg["save_epoch_ends"]:  # at each epoch's end, in on_train_epoch_end
        callbacks.append(ModelCheckpoint(dirpath=out, filename="end-{{step}}", every_n_epochs=1,
                                         save_on_train_epoch_end=True, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        max_steps=cfg["max_steps"], max_epochs=cfg["max_epochs"], logger=False, callbacks=callbacks,
        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False)
    model = Model()
    resume = cfg["resume"] and os.path.join(out, cfg["resume"])
    trainer.fit(model, ckpt_path=resume)
    if cfg["save_after_fit"]:
        trainer.save_checkpoint(os.path.join(out, cfg["save_after_fit"]))
    loader = trainer.train_dataloader
    result = {{"steps": model.steps, "rows": model.rows, "world_size": trainer.world_size,
              "sampler": type(loader.sampler).__module__ + "." + type(loader.sampler).__name__,
              "consumed": loader.consumed, "global_step": trainer.global_step}}
    with open(os.path.join(out, f"{{label}}-rank{{trainer.global_rank}}.json"), "w") as f:
        json.dump(result, f)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""")


def launch_steps(tmp_path: Path, cache: str, label: str, world_size: int = 1, *, infinite: bool,
                 workers: int, max_steps: int = STEPS, max_epochs: int | None = None,
                 save_every: tuple[int, ...] = (), save_after_fit: str | None = None,
                 save_epoch_ends: bool = False, resume: str | None = None,
                 estimated_stepping_batches: bool = False) -> subprocess.CompletedProcess:
    """Run STEP_SCRIPT in fresh processes (torchrun with ``world_size`` > 1)."""
    script = tmp_path / "steps.py"
    script.write_text(STEP_SCRIPT)
    config = {"infinite": infinite, "workers": workers, "max_steps": max_steps,
              "max_epochs": max_epochs, "save_every": list(save_every),
              "save_after_fit": save_after_fit, "save_epoch_ends": save_epoch_ends, "resume": resume,
              "estimated_stepping_batches": estimated_stepping_batches}
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(script), cache, str(tmp_path), label, json.dumps(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def run_steps(tmp_path: Path, cache: str, label: str, world_size: int = 1, **config) -> list[dict]:
    """Run STEP_SCRIPT (see launch_steps) -> each rank's result: ``steps`` is [global step,
    sha1 of input_ids] per training step."""
    proc = launch_steps(tmp_path, cache, label, world_size, **config)
    assert proc.returncode == 0, f"{proc.args} failed:\n{proc.stdout}\n{proc.stderr}"
    results = [json.loads((tmp_path / f"{label}-rank{r}.json").read_text()) for r in range(world_size)]
    for r in results:  # Lightning left our sampler in place (no DistributedSamplerWrapper)
        assert r["world_size"] == world_size
        assert r["sampler"] == "torchcache.train.sampler.DistributedSampler"
    return results


def saved_loader_state(path: Path) -> dict:
    """Our loader's state_dict() as Lightning saved it in the checkpoint at ``path``."""
    ckpt = torch.load(path, weights_only=False)
    [state] = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert state["format"] == "torchcache.loader"
    return state


def check_resumed(fresh: list[dict], resumed: list[dict], at: int, steps: int = STEPS) -> None:
    """Each rank's resumed run trains, step for step, the batches of the uninterrupted one."""
    for rank, (f, r) in enumerate(zip(fresh, resumed)):
        assert [s for s, _ in r["steps"]] == list(range(at + 1, steps + 1)), f"rank {rank}"
        assert r["steps"] == f["steps"][at:], f"rank {rank}: resumed at step {at}"
        assert r["global_step"] == steps and r["consumed"] == f["consumed"]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_step_based_infinite_sampler_resumes_exactly(tmp_path, cache, workers):
    """max_steps=12 over an infinite sampler: checkpoints at step 6 (by ModelCheckpoint while
    Lightning holds step 7's batch, and by save_checkpoint after fit(max_steps=6)) resume with
    step 7's batch, not step 8's."""
    run = functools.partial(run_steps, tmp_path, cache, infinite=True, workers=workers)
    [fresh] = run("fresh", save_every=(SAVE_AT,))
    assert [s for s, _ in fresh["steps"]] == list(range(1, STEPS + 1))
    assert fresh["rows"] == expected_rows(cache, 0, 1, infinite=True)
    [half] = run("half", max_steps=SAVE_AT, save_after_fit="half.ckpt")
    assert half["steps"] == fresh["steps"][:SAVE_AT]
    for name in (f"every{SAVE_AT}-step={SAVE_AT}.ckpt", "half.ckpt"):
        check_resumed([fresh], run(f"resume-{name}", resume=name), SAVE_AT)
        assert saved_loader_state(tmp_path / name)["consumed"] == SAVE_AT * BATCH, name
    assert fresh["consumed"] == STEPS * BATCH  # step 13's batch, taken ahead, is not counted


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_resume_exactly_mid_epoch_and_at_epoch_end(tmp_path, cache, workers):
    """A sized sampler (loader epochs of 8 batches, the last one short): checkpoints at step 6
    (mid-epoch) and 8 (the epoch's end) resume exactly into the next epochs."""
    epoch = len(tc.DataLoader(tc.TokenDataset(cache, seq_len=SEQ), batch_size=BATCH))
    assert epoch == 8 and SAVE_AT < epoch < STEPS
    [fresh] = run_steps(tmp_path, cache, "fresh", infinite=False, workers=workers,
                        save_every=(SAVE_AT, epoch))
    assert fresh["rows"] == expected_rows(cache, 0, 1)
    for at, consumed in ((SAVE_AT, SAVE_AT * BATCH), (epoch, 23)):
        name = f"every{at}-step={at}.ckpt"
        assert saved_loader_state(tmp_path / name)["consumed"] == consumed, name
        resumed = run_steps(tmp_path, cache, f"resume{at}", infinite=False, workers=workers,
                            resume=name)
        check_resumed([fresh], resumed, at)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_based_run_resumes_mid_epoch_and_from_an_epoch_end_checkpoint(tmp_path, cache, workers):
    """max_epochs=2 (16 steps). A checkpoint at step 6 (mid-epoch): Lightning reads len(loader)
    after loading its state, as the length of every epoch, so the resumed run must still train
    both epochs whole (steps 7..16). A checkpoint at the end of epoch 0 (on_train_epoch_end):
    Lightning loads no loader state then and calls sampler.set_epoch(1) on the new loader after
    it has started iterating it; the resumed run trains epoch 1's batches, not epoch 0's again."""
    run = functools.partial(run_steps, tmp_path, cache, infinite=False, workers=workers,
                            max_steps=-1, max_epochs=2)
    [fresh] = run("fresh", save_every=(SAVE_AT,), save_epoch_ends=True)
    epoch = len(fresh["steps"]) // 2
    assert epoch == 8 and fresh["rows"] == expected_rows(cache, 0, 1, steps=2 * epoch)
    for name, at, consumed in ((f"every{SAVE_AT}-step={SAVE_AT}.ckpt", SAVE_AT, SAVE_AT * BATCH),
                               (f"end-step={epoch}.ckpt", epoch, 23)):
        assert saved_loader_state(tmp_path / name)["consumed"] == consumed, name
        check_resumed([fresh], run(f"resume{at}", resume=name), at, 2 * epoch)


@pytest.mark.slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_ddp_step_based_resumes_exactly_with_lightning_defaults(tmp_path, cache):
    """Two processes (gloo, CPU), Lightning's default DDP settings, an infinite sampler: each
    rank reads its share, and the checkpoint of step 6 resumes every rank at step 7."""
    run = functools.partial(run_steps, tmp_path, cache, world_size=2, infinite=True, workers=0)
    fresh = run("fresh", save_every=(SAVE_AT,))
    for rank, result in enumerate(fresh):
        assert result["rows"] == expected_rows(cache, rank, 2, infinite=True), f"rank {rank}"
    name = f"every{SAVE_AT}-step={SAVE_AT}.ckpt"
    assert saved_loader_state(tmp_path / name)["consumed"] == SAVE_AT * BATCH * 2
    check_resumed(fresh, run("resume", resume=name), SAVE_AT)


class _EndlessOrder(torch.utils.data.Sampler):
    """A sampler of the user's own with no len(): a seeded random order, forever."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self):
        generator = torch.Generator().manual_seed(SEED)
        while True:
            yield from torch.randperm(self.size, generator=generator).tolist()


@pytest.mark.parametrize("own_sampler", [False, True], ids=["tc_sampler", "own_sampler"])
def test_batches_lightnings_fetcher_holds_ahead_are_not_in_the_state(cache, own_sampler):
    """In-process, with Lightning's own CombinedLoader and _PrefetchDataFetcher (what the fit
    loop uses for a loader without len()): after the training step received 6 batches the
    fetcher holds the 7th, and the state counts 6, before and after the fetcher is torn down
    (end of fit); loaded into a new loader, it starts with the 7th. A plain loop's state still
    counts every batch it received, and the loader used by hand after fit goes on with the 7th."""
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    ds = tc.TokenDataset(cache, seq_len=SEQ)

    def make() -> tc.DataLoader:
        if own_sampler:
            return tc.DataLoader(ds, batch_size=BATCH, sampler=_EndlessOrder(len(ds)))
        return tc.DataLoader(ds, batch_size=BATCH,
                             sampler=tc.DistributedSampler(ds, seed=SEED, infinite=True))

    def count(state: dict) -> int:
        return state["batches"] if own_sampler else state["consumed"] // BATCH

    plain = make()
    it = iter(plain)
    uninterrupted = [next(it)["input_ids"].tolist() for _ in range(STEPS)]
    again = make()
    again_it = iter(again)
    for _ in range(SAVE_AT):
        next(again_it)
    assert count(again.state_dict()) == SAVE_AT  # a plain loop: every batch received counts

    loader = make()
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(loader, "max_size_cycle"))
    iter(fetcher)
    received = [next(fetcher)[0]["input_ids"].tolist() for _ in range(SAVE_AT)]
    assert received == uninterrupted[:SAVE_AT] and len(fetcher.batches) == 1  # step 7's, ahead
    state = loader.state_dict()
    assert count(state) == SAVE_AT
    fetcher.teardown()  # what fit does when it ends: the batch held is dropped
    assert loader.state_dict() == state
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [b["input_ids"].tolist() for _, b in zip(range(STEPS - SAVE_AT), resumed)] \
        == uninterrupted[SAVE_AT:]
    if not own_sampler:  # the loader itself, iterated by hand after fit: step 7's batch next
        assert next(iter(loader))["input_ids"].tolist() == uninterrupted[SAVE_AT]


@pytest.mark.slow
@pytest.mark.parametrize("infinite", [False, True], ids=["epochs", "infinite"])
def test_a_state_lightning_leaves_unloaded_is_refused(tmp_path, cache, infinite):
    """With max_epochs set, reading trainer.estimated_stepping_batches in configure_optimizers
    makes Lightning 2.6 set up the train dataloader before it restores the checkpoint, and
    never load the loader's state (Lightning #20550): the resumed run would start the data
    stream over. It stops at its first batch instead, saying why."""
    run = functools.partial(launch_steps, tmp_path, cache, infinite=infinite, workers=0,
                            max_epochs=2, estimated_stepping_batches=True)
    fresh = run("fresh", max_steps=SAVE_AT, save_every=(SAVE_AT,))
    assert fresh.returncode == 0, fresh.stderr
    resumed = run("resume", resume=f"every{SAVE_AT}-step={SAVE_AT}.ckpt")
    assert resumed.returncode != 0
    assert "never loaded this DataLoader's saved state" in resumed.stderr
    assert "estimated_stepping_batches" in resumed.stderr
    assert not (tmp_path / "resume-rank0.json").exists()  # no batch was trained on


@pytest.mark.parametrize("workers", [0, 2])
def test_set_epoch_after_lightnings_fetcher_started_a_new_loader(cache, workers):
    """In-process, Lightning's resume from an epoch-end checkpoint: a new loader, no state
    loaded, iterated by the fetcher (fit_loop.setup_data), then sampler.set_epoch(1)
    (on_advance_start): the first batch is epoch 1's, as with torch's lazy samplers. A loader
    that has received batches keeps its position (set_epoch warns, as before)."""
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    ds = tc.TokenDataset(cache, seq_len=SEQ)

    def make() -> tc.DataLoader:
        return tc.DataLoader(ds, batch_size=BATCH, num_workers=workers,
                             sampler=tc.DistributedSampler(ds, seed=SEED, shuffle=True))

    plain = make()
    epochs = [[b["input_ids"].tolist() for b in plain] for _ in range(2)]
    loader = make()
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(loader, "max_size_cycle"))
    iter(fetcher)
    assert len(loader) == len(epochs[0])  # asked before set_epoch, as Lightning does
    loader.sampler.set_epoch(1)
    assert [next(fetcher)[0]["input_ids"].tolist() for _ in range(2)] == epochs[1][:2]
    assert loader.consumed == len(ds) + 2 * BATCH
    with pytest.warns(UserWarning, match="ignored"):
        loader.sampler.set_epoch(0)
    assert next(fetcher)[0]["input_ids"].tolist() == epochs[1][2]
    fetcher.teardown()


def test_len_under_lightnings_fetcher_is_the_whole_epoch(cache):
    """Lightning reads len(loader) after loading a mid-epoch state, and takes it as the number
    of batches of every epoch, counted from the epoch's start: under its fetcher the loader
    gives the whole loader epoch's; in a loop of your own, the batches the next iter() yields."""
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    ds = tc.TokenDataset(cache, seq_len=SEQ)

    def make() -> tc.DataLoader:
        return tc.DataLoader(ds, batch_size=BATCH, sampler=tc.DistributedSampler(ds, seed=SEED))

    first = make()
    it = iter(first)
    for _ in range(SAVE_AT):
        next(it)
    state = first.state_dict()
    plain, loader = make(), make()
    plain.load_state_dict(state)
    loader.load_state_dict(state)
    assert len(plain) == 2 and len(first) == 2  # the rest of the 8 batches of loader epoch 0
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(loader, "max_size_cycle"))
    iter(fetcher)
    assert len(loader) == 8 and fetcher.length == 8
    assert [b[0]["input_ids"].tolist() for b in fetcher][:2] == [b["input_ids"].tolist() for b in plain]
    fetcher.teardown()
