"""examples/speech.py end to end on tests/data/speech-sample.tar (4 utterances, FLAC + transcripts).

The cached features of each utterance are bit-identical to the example's featurize() applied to the
tar's members directly, and a stopped-and-resumed run (2 DataLoader workers) repeats the
uninterrupted losses exactly. 4 utterances in batches of 2 make 2 steps a loader epoch, so the runs
cross several epoch boundaries and the resume starts at one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

import torchcache as tc
from conftest import example_checkpoint, example_losses

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "speech.py"
TAR = ROOT / "tests" / "data" / "speech-sample.tar"
STEPS, SAVE, BATCH = 8, 2, 2
COMMON = ["--data", str(TAR), "--batch-size", str(BATCH), "--save-every", str(SAVE), "--seed", "3",
          "--steps", str(STEPS)]


def run(out: Path, *extra: str, cache: Path | None = None) -> str:
    if cache is not None and not out.exists():
        shutil.copytree(cache, out / "cache")
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *COMMON, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def load_example():
    spec = importlib.util.spec_from_file_location("speech_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def samples() -> dict[str, dict]:
    """The tar's samples as webdataset groups them: {key: {"__key__", ext: bytes}}."""
    out: dict[str, dict] = {}
    with tarfile.open(TAR) as tar:
        for member in tar.getmembers():
            key, ext = member.name.split(".", 1)
            out.setdefault(key, {"__key__": key, "__url__": str(TAR)})[ext] = tar.extractfile(member).read()
    return out


@pytest.mark.slow
def test_speech_example_features_and_exact_resume(tmp_path):
    pytest.importorskip("soundfile")
    pytest.importorskip("transformers")
    ref_out = tmp_path / "reference"
    stdout = run(ref_out, "--num-workers", "2")
    assert "cache: 4 utterances" in stdout
    ref = example_losses(ref_out)
    assert len(ref) == STEPS and ref[STEPS] < ref[1]  # it learns something
    assert example_checkpoint(ref_out) == (STEPS, example_checkpoint(ref_out)[1]) and example_checkpoint(ref_out)[1]["consumed"] == STEPS * BATCH

    # features read back are bit-identical to featurize() of the record; tokens are its transcript
    example = load_example()
    cache = tc.TokenCache(ref_out / "cache")
    assert cache.array_fields and "input_features" in cache.array_fields
    records = list(samples().values())  # in tar order: document_info's "record" indexes them
    assert cache.num_documents == len(records) == 4
    for i in range(cache.num_documents):
        info = cache.document_info(i)
        assert info["input"] == str(TAR)
        record = records[info["record"]]
        want = example.featurize(record)
        got = cache.document_arrays(i)["input_features"]
        assert got.dtype == np.float32 and got.ndim == 2 and got.shape[1] == 80
        # trimmed to the utterance (10 ms frames), not padded to Whisper's 30 s
        seconds = json.loads(record["json"])["seconds"]
        assert abs(got.shape[0] - seconds * 100) <= 2 and got.shape[0] < 3000
        assert got.shape == want["input_features"].shape
        assert got.tobytes() == want["input_features"].tobytes()
        assert want["text"] in cache.decode(cache.document(i))

    # stopped after 5 steps (checkpoint at 4), resumed with 2 workers: the same losses, bit for bit
    out = tmp_path / "run"
    run(out, "--num-workers", "2", "--stop-after", "5", cache=ref_out / "cache")
    assert example_checkpoint(out)[0] == 4 and example_checkpoint(out)[1]["consumed"] == 4 * BATCH
    assert len(example_losses(out)) == 5  # step 5 is lost work
    stdout = run(out, "--num-workers", "2", "--resume")
    assert "resumed at step 4" in stdout
    assert example_losses(out) == ref
    assert example_checkpoint(out)[0] == STEPS


def test_featurize_names_the_extra_without_soundfile(monkeypatch):
    example = load_example()
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'torchcache-lm\[audio\]'"):
        example.featurize(next(iter(samples().values())))
