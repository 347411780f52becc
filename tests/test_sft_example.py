"""examples/sft.py end to end: a chat cache mixed 80/20 with a text cache trains only on what the
assistant writes, and a stopped-and-resumed run (2 DataLoader workers) repeats the losses exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import torchcache as tc

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "sft.py"
COMMON = ["--steps", "8", "--save-every", "4", "--batch-size", "4", "--seq-len", "32"]


def run(out: Path, *extra: str) -> list[tuple[int, str, float]]:
    """Run the example; its printed steps as (step, loss text, trained fraction)."""
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), *COMMON, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout}\n{done.stderr}"
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("step ")]
    return [(int(r[1]), r[3], float(r[5])) for r in rows]


@pytest.mark.slow
def test_sft_example_trains_on_the_mask_and_resumes_exactly(tmp_path):
    whole = run(tmp_path / "whole", "--num-workers", "2")
    assert [s for s, _, _ in whole] == list(range(1, 9))
    assert all(0 < fraction < 1 for _, _, fraction in whole)  # chat rows: part of each trained
    chat = tc.TokenCache(tmp_path / "whole" / "chat")
    assert chat.has_loss_mask and 0.2 < chat.loss_mask(0, chat.num_tokens).mean() < 0.9
    first = run(tmp_path / "resumed", "--num-workers", "2", "--stop-after", "4")
    rest = run(tmp_path / "resumed", "--num-workers", "2", "--resume")
    assert first + rest == whole
