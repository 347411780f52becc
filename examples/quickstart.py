"""The main job on bundled data: build a cache, train on it, stop, resume, and check the resume.

    python examples/quickstart.py [--out runs/quickstart] [--fresh]

1. Builds a cache of 14 public-domain books in the background and reads it while it grows.
2. Trains a tiny GPT on it (examples/train_gpt.py) for 24 steps without interruption.
3. Trains again but stops after 15 steps (the last checkpoint is at step 12), then resumes to 24.
4. Checks that the resumed run's losses equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

import torchcache as tc

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "tests" / "data"
TRAIN = [sys.executable, str(HERE / "train_gpt.py"), "--steps", "24", "--save-every", "6",
         "--seq-len", "32", "--batch-size", "4", "--num-workers", "2", "--block-tokens", "4096"]


def build_while_reading(out: Path) -> Path:
    tokenizer = out / "gpt2-tokenizer.json"
    if not tokenizer.exists():
        tokenizer.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    cache_dir = out / "cache"
    print(f"[1] building {cache_dir} in the background from {DATA / 'gutenberg_small.jsonl'}")
    handle = tc.build_cache(str(DATA / "gutenberg_small.jsonl"), cache_dir, str(tokenizer),
                            block_tokens=4096, background=True)
    while not (cache_dir / "manifest.json").exists() and not handle.done:
        time.sleep(0.02)
    cache = tc.TokenCache(cache_dir)
    while not handle.done:
        if cache.refresh():
            print(f"    reader sees {cache.num_blocks} committed blocks, {cache.num_tokens:,} tokens")
        time.sleep(0.02)
    result = handle.wait()
    cache.refresh()
    print(f"    built {result.num_tokens:,} tokens, {result.num_documents} documents, "
          f"{result.num_blocks} blocks in {result.seconds:.1f} s; verify: "
          f"{tc.verify_cache(cache_dir) or 'all checksums match'}")
    print(f"    document 1 starts: {cache.decode(cache.document(1)[:12])!r}")
    return cache_dir


def losses(run: Path) -> dict[int, float]:
    with open(run / "losses.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def train(run: Path, cache_dir: Path, *extra: str) -> None:
    run.mkdir(parents=True, exist_ok=True)
    if not (run / "cache").exists():  # share the cache built above (a re-build is a no-op)
        shutil.copytree(cache_dir, run / "cache")
    subprocess.run(TRAIN + ["--out", str(run), *extra], check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/quickstart", help="working directory")
    parser.add_argument("--fresh", action="store_true", help="delete the working directory first")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        if not args.fresh:
            for run in ("uninterrupted", "interrupted"):
                shutil.rmtree(out / run, ignore_errors=True)
        else:
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    cache_dir = build_while_reading(out)

    print("[2] training 24 steps without interruption (2 DataLoader workers)")
    train(out / "uninterrupted", cache_dir)
    print("[3] training again, stopping after 15 steps (checkpoint at 12), then resuming to 24")
    train(out / "interrupted", cache_dir, "--stop-after", "15")
    state = json.loads(torch.load(out / "interrupted" / "checkpoint.pt", weights_only=False)["loader"])
    print(f"    saved loader state: {state['consumed']} samples consumed, fingerprint "
          f"{state['fingerprint'][:16]}...")
    train(out / "interrupted", cache_dir, "--resume")
    a, b = losses(out / "uninterrupted"), losses(out / "interrupted")
    for step in (13, 18, 24):
        print(f"    step {step}: uninterrupted {a[step]:.6f}  resumed {b[step]:.6f}")
    if a != b:
        raise SystemExit("[4] FAILED: the resumed run's losses differ from the uninterrupted run's")
    print(f"[4] ok: all {len(a)} losses of the resumed run equal the uninterrupted run's exactly")


if __name__ == "__main__":
    main()
