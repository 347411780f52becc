"""examples/train_gpt.py end to end: a stopped-and-resumed run repeats the uninterrupted losses exactly.

The runs use a tiny corpus (three real book openings, about 40 samples of 32 tokens) so that 12 steps
of 4 samples cross a loader-epoch boundary, and the resumes from step 4 have to cross it too. Later
runs start from a copy of the first run's cache, so their build is the cheap no-op. The --pack runs
(tc.PackedDataset rows, document-masked attention) use about 90 short paragraphs instead, so that most
rows hold two or three documents; an in-process test checks that the mask and the restarting positions
make a packed document's loss what the document alone gives.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import torchcache as tc
from conftest import example_checkpoint, example_losses

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
SEQ, BATCH, STEPS, SAVE = 32, 4, 12, 4
slow = pytest.mark.slow  # the tests that train (and resume) a model in subprocesses

COMMON = ["--seq-len", str(SEQ), "--batch-size", str(BATCH), "--save-every", str(SAVE), "--seed", "3"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, books) -> str:
    path = tmp_path_factory.mktemp("corpus") / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": b["text"][:1500]}) + "\n" for b in books[:3]))
    return str(path)


def train(out: Path, corpus: str, *extra: str, cache: Path | None = None,
          launcher: list[str] | None = None) -> str:
    if cache is not None and not out.exists():
        shutil.copytree(cache, out / "cache")
    cmd = (launcher or [sys.executable]) + [str(SCRIPT), "--out", str(out), "--data", corpus, *COMMON, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> tuple[dict[int, float], Path]:
    """The uninterrupted run (no workers): 12 steps, checkpoints at 4, 8 and 12 -> (losses, cache)."""
    out = tmp_path_factory.mktemp("reference")
    stdout = train(out, corpus, "--steps", str(STEPS), "--num-workers", "0")
    ref = example_losses(out)
    assert len(ref) == STEPS
    printed = [line.split() for line in stdout.splitlines() if line.startswith("step ")]
    assert [(int(p[1]), float(p[3])) for p in printed] == [(s, round(x, 6)) for s, x in ref.items()]
    n = len(tc.TokenDataset(out / "cache", SEQ))
    assert 7 * BATCH <= n < STEPS * BATCH, "the resumes must cross a loader-epoch boundary"
    step, state = example_checkpoint(out)  # one short batch (n % BATCH samples) ended loader epoch 0
    assert (step, state["consumed"]) == (STEPS, STEPS * BATCH - (-n % BATCH))
    return ref, out / "cache"


@slow
@pytest.mark.parametrize("workers", [0, 2])
def test_stop_and_resume_gives_identical_losses(tmp_path, corpus, reference, workers):
    ref, cache = reference
    out = tmp_path / "run"
    train(out, corpus, "--steps", str(STEPS), "--num-workers", str(workers), "--stop-after", "6", cache=cache)
    assert example_checkpoint(out)[0] == SAVE and example_checkpoint(out)[1]["consumed"] == SAVE * BATCH
    assert len(example_losses(out)) == 6  # steps 5 and 6 are lost work
    if workers:  # the same checkpoint, resumed without workers
        shutil.copytree(out, tmp_path / "no_workers")
        stdout = train(tmp_path / "no_workers", corpus, "--steps", str(STEPS), "--resume",
                       "--num-workers", "0")
        assert f"resumed at step {SAVE}" in stdout
        assert example_losses(tmp_path / "no_workers") == ref
    train(out, corpus, "--steps", str(STEPS), "--resume", "--num-workers", str(workers))
    assert example_losses(out) == ref  # steps 1-4 of the first process, 5-12 of the resumed one
    assert example_checkpoint(out)[0] == STEPS


@slow
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_torchrun_two_processes_then_resume_on_one(tmp_path, corpus, reference):
    ref, cache = reference
    out = tmp_path / "ddp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    stdout = train(out, corpus, "--steps", "4", "--save-every", "2", cache=cache, launcher=torchrun)
    printed = [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")]
    assert printed == ["1", "2", "3", "4"]
    step, state = example_checkpoint(out)
    assert (step, state["consumed"], state["world_size"]) == (4, 4 * BATCH, 2)

    stdout = train(out, corpus, "--steps", "7", "--resume")
    assert "resumed at step 4, 16 samples consumed" in stdout
    step, state = example_checkpoint(out)
    assert (step, state["consumed"], state["world_size"]) == (7, 7 * BATCH, 1)
    # the same global batches as the one-process run: losses agree up to float reduction order
    got = example_losses(out)
    assert list(got) == list(range(1, 8))
    assert got == pytest.approx({s: ref[s] for s in got}, rel=1e-3)


# -- --pack ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pack_corpus(tmp_path_factory, books) -> str:
    """90 short documents (paragraphs cut to 50 characters): 42 packed rows of 32 tokens."""
    paragraphs = [p for b in books for p in b["text"].split("\n\n") if p.strip()][:90]
    path = tmp_path_factory.mktemp("pack_corpus") / "paragraphs.jsonl"
    path.write_text("".join(json.dumps({"text": p[:50]}) + "\n" for p in paragraphs))
    return str(path)


@slow
def test_pack_stop_and_resume_gives_identical_losses(tmp_path, pack_corpus):
    ref_out = tmp_path / "reference"
    train(ref_out, pack_corpus, "--pack", "--steps", str(STEPS), "--num-workers", "0")
    ref = example_losses(ref_out)
    assert len(ref) == STEPS
    ds = tc.PackedDataset(ref_out / "cache", SEQ)  # the plan the run stored in its cache
    assert 7 * BATCH <= len(ds) < STEPS * BATCH, "the resumes must cross a loader-epoch boundary"
    assert ds.get_batch(range(len(ds)))["num_segments"].float().mean() > 1.5  # mostly 2-3 documents a row
    step, state = example_checkpoint(ref_out)  # one short batch (len(ds) % BATCH rows) ended loader epoch 0
    assert (step, state["consumed"]) == (STEPS, STEPS * BATCH - (-len(ds) % BATCH))

    out = tmp_path / "run"  # stopped with 2 workers (compact transfer), resumed without
    train(out, pack_corpus, "--pack", "--steps", str(STEPS), "--num-workers", "2", "--stop-after", "6",
          cache=ref_out / "cache")
    assert example_checkpoint(out)[0] == SAVE and example_checkpoint(out)[1]["consumed"] == SAVE * BATCH
    stdout = train(out, pack_corpus, "--pack", "--steps", str(STEPS), "--resume", "--num-workers", "0")
    assert f"resumed at step {SAVE}" in stdout
    assert example_losses(out) == ref
    assert example_checkpoint(out)[0] == STEPS


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pack_attention_stays_inside_documents(tmp_path, pack_corpus, gpt2_tokenizer_path):
    """A packed document's loss equals the loss of that document alone (positions from 0, no context)."""
    example = load_example()
    tc.build_cache(pack_corpus, tmp_path / "cache", gpt2_tokenizer_path, progress=False)
    ds = tc.PackedDataset(tmp_path / "cache", SEQ)
    batch = ds.get_batch(range(len(ds)))
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]

    mask = example.document_mask(pos)
    assert mask.shape == (len(ds), 1, SEQ, SEQ) and mask.dtype == torch.bool
    for r in range(len(ds)):  # against the definition: causal, within one segment of cu_seqlens
        cu = batch["cu_seqlens"][r, :batch["num_segments"][r] + 1].tolist() + [SEQ]
        segment = torch.bucketize(torch.arange(SEQ), torch.tensor(cu[1:]), right=True)
        want = (segment[:, None] == segment[None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        assert torch.equal(mask[r, 0], want)

    torch.manual_seed(0)
    model = example.GPT(ds.cache.vocab_size, SEQ).eval()
    checked = 0  # documents after another one in their row (the first rows' documents suffice)
    with torch.no_grad():
        for r in range(len(ds)):
            cu = batch["cu_seqlens"][r].tolist()
            for k in range(int(batch["num_segments"][r])):
                s, e = cu[k], cu[k + 1]
                if not (labels[r, s:e] != -100).any():
                    continue
                only = torch.full_like(labels[r:r + 1], -100)
                only[0, s:e] = labels[r, s:e]
                packed = model(ids[r:r + 1], only, pos[r:r + 1])
                alone = model(ids[r:r + 1, s:e], labels[r:r + 1, s:e], torch.arange(e - s)[None])
                assert torch.allclose(packed, alone, rtol=1e-5, atol=1e-5), (r, k)
                checked += s > 0
            if checked >= 20:
                break
    assert checked >= 20
