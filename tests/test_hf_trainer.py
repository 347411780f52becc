"""transformers.Trainer on torchcache's loader: torchcache.integrations.transformers.Trainer
(DESIGN.md §9.4). Real installs, real subprocesses: the training script below is a plain script,
as users write it, run as one process and under `torchrun --nproc_per_node 2` (gloo, CPU).

A run interrupted after the checkpoint of step 6 (of 12) and resumed in a fresh process must train
on exactly the batches of an uninterrupted run, with exactly its losses (the model has dropout), and
reach its first batch about as fast as a fresh start (no batches are skipped by reading them).
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
import torch.distributed as dist

import torchcache as tc
from conftest import paragraphs

pytest.importorskip("transformers")

SEQ, STEPS, SAVE_AT, SEED = 32, 12, 6, 11

SCRIPT = textwrap.dedent("""\
    import hashlib
    import json
    import os
    import sys
    import time

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    import torchcache as tc
    from torchcache.integrations.transformers import Trainer

    cache, out, phase, workers, batch, accumulation = sys.argv[1:7]
    resume = sys.argv[7] if len(sys.argv) > 7 else None
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=50257, n_positions=64))
    ds = tc.TokenDataset(cache, seq_len=%(SEQ)d, labels="same")
    args = TrainingArguments(
        output_dir=out, max_steps=%(STEPS)d, per_device_train_batch_size=int(batch),
        gradient_accumulation_steps=int(accumulation), dataloader_num_workers=int(workers),
        learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=%(SAVE_AT)d,
        seed=%(SEED)d, report_to="none", use_cpu=True, disable_tqdm=True)
    rows, times = [], {}


    def record(module, call_args, kwargs):
        if module.training:
            ids = kwargs.get("input_ids", call_args[0] if call_args else None)
            rows.append([trainer.state.global_step + 1,
                         [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in ids.cpu()]])


    def dump():
        result = {"rows": rows, "times": times, "log": trainer.state.log_history,
                  "world_size": args.world_size}
        with open(f"{out}/{phase}-rank{rank}.json", "w") as f:
            json.dump(result, f)


    class Probe(TrainerCallback):
        def on_epoch_begin(self, args, state, control, **kwargs):
            times.setdefault("epoch_begin", time.perf_counter())

        def on_step_begin(self, args, state, control, **kwargs):
            times.setdefault("first_step", time.perf_counter())

        def on_save(self, args, state, control, **kwargs):
            if phase == "interrupted" and state.global_step == %(SAVE_AT)d:
                dump()  # then die without cleaning up, as a killed job does
                sys.stdout.flush()
                os._exit(0)


    model.register_forward_pre_hook(record, with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Probe()])
    trainer.train(resume_from_checkpoint=resume)
    dump()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
""") % {"SEQ": SEQ, "STEPS": STEPS, "SAVE_AT": SAVE_AT, "SEED": SEED}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    """34 samples of 32 tokens: an epoch is 17 batches of 2 on one process (9 steps of 2
    accumulated batches, the last one short), 9 per rank with 2 ranks (5 steps)."""
    out = tmp_path_factory.mktemp("hf") / "cache"
    tc.build_cache(iter(paragraphs(books, 28)), out, gpt2_tokenizer_path, progress=False)
    assert len(tc.TokenDataset(str(out), SEQ)) == 34
    return str(out)


def run(tmp: Path, cache: str, phase: str, out: Path, *, world_size: int = 1, workers: int = 2,
        batch: int = 2, accumulation: int = 2, resume: Path | None = None) -> list[dict]:
    script = tmp / "train_hf.py"
    script.write_text(SCRIPT)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(script), cache, str(out), phase, str(workers), str(batch), str(accumulation)]
    cmd += [str(resume)] if resume is not None else []
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    results = [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(world_size)]
    assert [r["world_size"] for r in results] == [world_size] * world_size
    return results


def steps(result: dict) -> dict[int, list[list[str]]]:
    """step -> the micro-batches (row hashes) trained in it."""
    out: dict[int, list[list[str]]] = {}
    for step, rows in result["rows"]:
        out.setdefault(step, []).append(rows)
    return out


def losses(result: dict) -> dict[int, tuple]:
    return {e["step"]: (e["loss"], e["grad_norm"], e["learning_rate"], e["epoch"])
            for e in result["log"] if "loss" in e}


def all_rows(cache: str) -> list[str]:
    ds = tc.TokenDataset(cache, SEQ)
    return [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16]
            for row in ds.get_batch(list(range(len(ds))))["input_ids"]]


def test_interrupted_run_resumes_exactly_with_two_workers(tmp_path, cache):
    full = run(tmp_path, cache, "full", tmp_path / "full")[0]
    cut = run(tmp_path, cache, "interrupted", tmp_path / "cut")[0]
    checkpoint = tmp_path / "cut" / f"checkpoint-{SAVE_AT}"
    state = json.loads((checkpoint / "torchcache_loader.json").read_text())
    assert state["consumed"] == SAVE_AT * 2 * 2  # 6 steps of 2 accumulated batches of 2
    resumed = run(tmp_path, cache, "resumed", tmp_path / "cut", resume=checkpoint)[0]

    full_steps = steps(full)
    assert sorted(full_steps) == list(range(1, STEPS + 1))
    # an epoch (17 batches, 34 samples): every sample once, then the next epoch's permutation
    first_epoch = [row for s in range(1, 10) for batch in full_steps[s] for row in batch]
    assert sorted(first_epoch) == sorted(all_rows(cache))
    assert [len(full_steps[s]) for s in range(1, 11)] == [2] * 8 + [1, 2]  # the epoch's short last step
    assert steps(cut) == {s: full_steps[s] for s in range(1, SAVE_AT + 1)}
    assert steps(resumed) == {s: full_steps[s] for s in range(SAVE_AT + 1, STEPS + 1)}

    # dropout continues the same random stream: the same losses, bit for bit (and the same
    # grad norms, learning rates and epochs); the log carries steps 1-6 over from the checkpoint
    assert losses(resumed) == losses(full)
    assert sorted(losses(full)) == list(range(1, STEPS + 1))

    # (timed, not asserted: the first batch of the resumed run vs a fresh start's; -s shows it)
    fresh_s = full["times"]["first_step"] - full["times"]["epoch_begin"]
    resumed_s = resumed["times"]["first_step"] - resumed["times"]["epoch_begin"]
    print(f"first batch: fresh {fresh_s:.3f}s, resumed {resumed_s:.3f}s")


needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")


@pytest.mark.slow
@needs_gloo
def test_torchrun_two_ranks_share_and_resume_also_on_one(tmp_path, cache):
    full = run(tmp_path, cache, "full", tmp_path / "full", world_size=2)
    cut = run(tmp_path, cache, "interrupted", tmp_path / "cut", world_size=2)
    checkpoint = tmp_path / "cut" / f"checkpoint-{SAVE_AT}"
    ranks = [steps(r) for r in full]
    # an epoch is 5 steps (9 batches, the last one short) on each rank: every sample exactly once
    epoch = [row for r in ranks for s in range(1, 6) for batch in r[s] for row in batch]
    assert sorted(epoch) == sorted(all_rows(cache))
    for r, result in enumerate(cut):
        assert steps(result) == {s: ranks[r][s] for s in range(1, SAVE_AT + 1)}, f"rank {r}"

    resumed = run(tmp_path, cache, "resumed", tmp_path / "cut", world_size=2, resume=checkpoint)
    for r, result in enumerate(resumed):
        assert steps(result) == {s: ranks[r][s] for s in range(SAVE_AT + 1, STEPS + 1)}, f"rank {r}"
    assert losses(resumed[0]) == losses(full[0])

    # the same checkpoint on one process with the same global batch: the same samples per step
    single = run(tmp_path, cache, "single", tmp_path / "cut", world_size=1, batch=4, resume=checkpoint)[0]
    for s, batches in steps(single).items():
        expected = sorted(row for r in ranks for batch in r[s] for row in batch)
        assert sorted(row for batch in batches for row in batch) == expected, f"step {s}"
    assert sorted(steps(single)) == list(range(SAVE_AT + 1, STEPS + 1))


def test_eval_datasets_work_unchanged_and_a_checkpoint_without_loader_state_is_refused(tmp_path, cache):
    """In one process: evaluation runs on the Trainer's own loader over any dataset, and resuming
    from a checkpoint folder that lacks torchcache_loader.json is an error naming the way out."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from torchcache.integrations.transformers import LOADER_STATE_NAME, Trainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50257,
                                       n_positions=64))
    ds = tc.TokenDataset(cache, seq_len=SEQ, labels="same")
    held_out = [ds[i] for i in range(4)]  # a plain list of dicts, as users often evaluate on
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, save_steps=2,
                             per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=ds, eval_dataset=held_out)
    trainer.train()
    assert not isinstance(trainer.get_eval_dataloader(), tc.DataLoader)
    assert trainer.evaluate()["eval_loss"] > 0
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / LOADER_STATE_NAME).is_file()
    (checkpoint / LOADER_STATE_NAME).unlink()
    args.max_steps = 4
    with pytest.raises(FileNotFoundError, match="ignore_data_skip=True"):
        Trainer(model=model, args=args, train_dataset=ds).train(resume_from_checkpoint=str(checkpoint))


def test_torchcache_does_not_import_transformers(tmp_path):
    code = ("import sys, torchcache as tc, torchcache.integrations\n"
            "tc.DataLoader(list(range(4)), batch_size=2)\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_clear_error_without_transformers(tmp_path):
    code = ("import sys\n"
            "sys.modules['transformers'] = None  # as if not installed\n"
            "try:\n"
            "    import torchcache.integrations.transformers\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'torchcache-lm[transformers]'" in proc.stdout
