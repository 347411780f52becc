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
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
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
    options = {}
    if os.environ.get("TC_MISSING_LOADER_STATE"):
        options["missing_loader_state"] = os.environ["TC_MISSING_LOADER_STATE"]
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Probe()], **options)
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
        batch: int = 2, accumulation: int = 2, resume: Path | None = None,
        env: dict[str, str] | None = None, fails: bool = False) -> list[dict] | str:
    """Run SCRIPT; -> each rank's result, or (``fails``) the failed run's stderr."""
    script = tmp / "train_hf.py"
    script.write_text(SCRIPT)
    launcher = [sys.executable]
    if world_size > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    cmd = launcher + [str(script), cache, str(out), phase, str(workers), str(batch), str(accumulation)]
    cmd += [str(resume)] if resume is not None else []
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    if fails:
        assert proc.returncode != 0, f"{cmd} did not fail:\n{proc.stdout[-3000:]}"
        return proc.stderr
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


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache) -> tuple[Path, dict]:
    """The uninterrupted run of STEPS steps (checkpoints at SAVE_AT and 2 * SAVE_AT): its folder
    and its result."""
    tmp = tmp_path_factory.mktemp("hf-full")
    return tmp / "full", run(tmp, cache, "full", tmp / "full")[0]


def test_interrupted_run_resumes_exactly_with_two_workers(tmp_path, cache, full_run):
    full = full_run[1]
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


def test_a_loader_state_of_another_step_or_damaged_is_refused_naming_the_file(tmp_path, cache, full_run):
    """The loader state must be at the data batch the checkpoint's global_step says (steps x
    gradient accumulation): checkpoint-12's state copied into checkpoint-6 is refused, naming the
    file and both step counts; a truncated state names the file (not a bare JSONDecodeError)."""
    folder, _ = full_run
    mixed = tmp_path / f"checkpoint-{SAVE_AT}"
    shutil.copytree(folder / f"checkpoint-{SAVE_AT}", mixed)
    shutil.copy(folder / f"checkpoint-{2 * SAVE_AT}" / "torchcache_loader.json", mixed)
    error = run(tmp_path, cache, "mixed", tmp_path / "mixed", resume=mixed, fails=True)
    # step 12 is data batch 23: the first epoch's 17 batches (9 steps, the last one short), then 3 x 2
    assert f"{mixed / 'torchcache_loader.json'} is at data batch 23 (global step {2 * SAVE_AT})" in error
    assert f"says global_step {SAVE_AT}, which is data batch {2 * SAVE_AT}" in error

    damaged = tmp_path / "damaged"
    shutil.copytree(folder / f"checkpoint-{SAVE_AT}", damaged)
    state = damaged / "torchcache_loader.json"
    state.write_bytes(state.read_bytes()[:40])
    error = run(tmp_path, cache, "damaged", tmp_path / "damaged-run", resume=damaged, fails=True)
    assert f"ValueError: {state}: not a loader state" in error and "truncated" in error


def test_a_checkpoint_without_loader_state_resumes_at_its_step_when_asked(tmp_path, cache, full_run):
    """missing_loader_state="step": a checkpoint without torchcache_loader.json (a
    transformers.Trainer checkpoint) resumes the stream at the data batch of its global_step."""
    folder, full = full_run
    bare = tmp_path / f"checkpoint-{SAVE_AT}"
    shutil.copytree(folder / f"checkpoint-{SAVE_AT}", bare)
    (bare / "torchcache_loader.json").unlink()
    resumed = run(tmp_path, cache, "resumed", tmp_path / "bare", resume=bare,
                  env={"TC_MISSING_LOADER_STATE": "step"})[0]
    assert steps(resumed) == {s: steps(full)[s] for s in range(SAVE_AT + 1, STEPS + 1)}
    assert losses(resumed) == losses(full)


class Regression(torch.utils.data.Dataset):
    """transformers' own test dataset, in kind: y = 2x + 3 + noise, items of numpy scalars."""

    def __init__(self, length: int = 66, lists: bool = False):
        rng = np.random.default_rng(42)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (2.0 * self.x + 3.0 + rng.normal(scale=0.1, size=(length,))).astype(np.float32)
        self.lists = lists  # items as a datasets.Dataset gives them: Python lists, not tensors

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        if self.lists:
            return {"input_x": [float(self.x[i])] * 2, "labels": [float(self.y[i])] * 2}
        return {"input_x": self.x[i], "labels": self.y[i]}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(Regression(40))


class RegressionModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None):
        y = input_x * self.a + self.b
        return (torch.nn.functional.mse_loss(y, labels), y)


def train_in_process(trainer_class, tmp: Path, dataset, model=None, **options) -> dict:
    """Train with `trainer_class`; -> global step, each trained batch (as lists) and the weights."""
    from transformers import TrainingArguments

    settings = dict(per_device_train_batch_size=16, num_train_epochs=3, learning_rate=0.1,
                    report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    settings.update(options)
    torch.manual_seed(0)
    model = model if model is not None else RegressionModel()
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append({k: v.tolist() for k, v in sorted(kwargs.items())}),
        with_kwargs=True)
    trainer = trainer_class(model=model, args=TrainingArguments(output_dir=str(tmp), **settings),
                            train_dataset=dataset)
    trainer.train()
    return {"step": trainer.state.global_step, "batches": seen,
            "weights": {k: v.tolist() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("dataset, options", [
    ("map", {}),
    ("map", {"dataloader_drop_last": True}),    # 66 samples, batch 16: 4 batches an epoch, not 5
    ("map", {"data_seed": 7}),
    ("map", {"dataloader_num_workers": 2, "seed": 3}),
    ("lists", {}),                               # the default collator makes the tensors
    ("stream", {"max_steps": 5}),                # an IterableDataset trains as in transformers
])
def test_other_datasets_train_exactly_as_with_transformers_trainer(tmp_path, dataset, options):
    """A dataset that is not torchcache's gets transformers.Trainer's own loader, sampler,
    collator, drop_last and seed: the same batches in the same order, the same weights."""
    from transformers import Trainer as HFTrainer

    from torchcache.integrations.transformers import Trainer

    make = {"map": Regression, "lists": lambda: Regression(lists=True), "stream": Stream}[dataset]
    theirs = train_in_process(HFTrainer, tmp_path / "hf", make(), **options)
    ours = train_in_process(Trainer, tmp_path / "tc", make(), **options)
    assert ours == theirs
    if options.get("dataloader_drop_last"):
        assert theirs["step"] == 3 * 4 and {len(b["input_x"]) for b in theirs["batches"]} == {16}


def test_torchcache_dataset_drops_the_last_batch_and_tells_accelerate_what_its_loaders_tell(tmp_path, cache):
    """dataloader_drop_last on a TokenDataset: 34 samples in batches of 16 train 2 full batches an
    epoch, as transformers.Trainer's loader would; the loader gives total_batch_size,
    total_dataset_length and the gradient state (end_of_dataloader on an epoch's last batch) as
    the loader accelerate prepares does."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
    from transformers import Trainer as HFTrainer

    from torchcache.integrations.transformers import Trainer

    class Ends(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_step_end(self, args, state, control, **kwargs):
            gradient_state = trainer.accelerator.gradient_state
            self.seen.append((state.global_step, gradient_state.in_dataloader, gradient_state.end_of_dataloader))

    ds = tc.TokenDataset(cache, seq_len=SEQ, labels="same")
    results = {}
    for name, trainer_class in (("hf", HFTrainer), ("tc", Trainer)):
        ends = Ends()
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50257, n_positions=64))
        trainer = trainer_class(model=model, train_dataset=ds, callbacks=[ends], args=TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=16, num_train_epochs=2,
            dataloader_drop_last=True, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True))
        rows = []
        model.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"]), with_kwargs=True)
        loader = trainer.get_train_dataloader()
        results[name] = (len(loader), loader.total_batch_size, loader.total_dataset_length)
        trainer.train()
        results[name] += (trainer.state.global_step, [len(r) for r in rows], ends.seen)
    assert results["tc"] == results["hf"]
    assert results["tc"][:5] == (2, 16, 34, 4, [16] * 4)
    assert [end for _, _, end in results["tc"][5]] == [False, True, False, True]
    epoch = torch.cat(rows[:2])  # (ours) each epoch: 32 different samples
    assert len({tuple(row.tolist()) for row in epoch}) == 32


@pytest.mark.parametrize("option", [{"train_sampling_strategy": "group_by_length"},
                                    {"dataloader_in_order": False}])
def test_arguments_the_torchcache_loader_cannot_honour_are_refused(tmp_path, cache, option):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from torchcache.integrations.transformers import Trainer

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50257, n_positions=64))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **option)
    trainer = Trainer(model=model, args=args, train_dataset=tc.TokenDataset(cache, seq_len=SEQ, labels="same"))
    with pytest.raises(ValueError, match=f"{next(iter(option))}="):
        trainer.get_train_dataloader()


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


def test_example_two_fresh_runs_train_alike(tmp_path):
    """examples/hf_trainer.py seeds before building the model: two fresh runs log the same losses
    from step 1 (else a user comparing a resumed run with a fresh one sees a difference that
    resume did not make)."""
    example = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    books = (example.parent.parent / "tests" / "data" / "gutenberg_small.jsonl").read_text().splitlines()
    data = tmp_path / "two-books.jsonl"
    data.write_text("\n".join(books[:2]) + "\n")
    logged = []
    for name in ("first", "second"):
        cmd = [sys.executable, str(example), "--out", str(tmp_path / name), "--data", str(data), "--max-steps", "3",
               "--save-steps", "3", "--workers", "0", "--batch-size", "2", "--seq-len", "32"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        state = json.loads((tmp_path / name / "checkpoints" / "checkpoint-3" / "trainer_state.json").read_text())
        logged.append([(e["step"], e["loss"], e["grad_norm"]) for e in state["log_history"] if "loss" in e])
    assert [step for step, _, _ in logged[0]] == [1, 2, 3]
    assert logged[0] == logged[1]
