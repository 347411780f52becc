"""Build tokens/s of this working tree against an earlier commit, in alternating rounds.

    python tools/bench_build_against.py REV [--corpus DIR] [--tokenizer tokenizer.json]
                                            [--shards 4] [--workers 2] [--rounds 3]

Checks REV out into a temporary git worktree, then builds the same shards of the corpus with
`tc.build_cache` from each tree in turn (a fresh interpreter each time, the output deleted in
between), alternating which goes first, and prints each build's tokens/s and the ratio of the
medians (this tree over REV). Both builds must produce the same number of tokens. The worktree
and the outputs are removed at the end.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(os.path.dirname(HERE), "shared", "data")
BUILD = """
import json, sys, time
import torchcache as tc
shards, out, tokenizer, workers = json.loads(sys.argv[1])
start = time.perf_counter()
result = tc.build_cache(shards, out, tokenizer, num_workers=workers, progress=False)
print(json.dumps({"tokens": result.num_tokens, "seconds": time.perf_counter() - start}))
"""


def build_rate(tree: str, shards: list[str], out: str, tokenizer: str, workers: int) -> tuple[int, float]:
    """(tokens, tokens/s) of one build of ``shards`` with the package of ``tree``."""
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", BUILD, json.dumps([shards, out, tokenizer, workers])],
                          env={**os.environ, "PYTHONPATH": tree}, cwd=os.path.dirname(out),
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the build with {tree} failed:\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result["tokens"], result["tokens"] / result["seconds"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the commit to compare against (e.g. HEAD~1)")
    p.add_argument("--corpus", default=os.path.join(DATA, "corpus", "gutenberg_en"))
    p.add_argument("--tokenizer", default=os.path.join(DATA, "tokenizers", "gpt2", "tokenizer.json"))
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    shards = sorted(glob.glob(os.path.join(args.corpus, "*.jsonl")))[:args.shards]
    if not shards:
        sys.exit(f"no .jsonl shards in {args.corpus}")
    scratch = tempfile.mkdtemp(prefix="bench-build-against-")
    earlier = os.path.join(scratch, "tree")
    subprocess.run(["git", "-C", HERE, "worktree", "add", "--detach", earlier, args.rev], check=True,
                   capture_output=True)
    try:
        trees = {args.rev: earlier, "this tree": HERE}
        rates: dict[str, list[float]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                tokens, rate = build_rate(trees[name], shards, os.path.join(scratch, "out"),
                                          args.tokenizer, args.workers)
                rates[name].append(rate)
                print(f"round {r + 1}/{args.rounds} {name}: {tokens:,} tokens, {rate / 1e6:.3f} M tokens/s",
                      flush=True)
        before, now = (statistics.median(rates[name]) for name in trees)
        print(f"median: {args.rev} {before / 1e6:.3f} M tokens/s, this tree {now / 1e6:.3f} M tokens/s: "
              f"{now / before:.2f}x ({len(shards)} shards, {args.workers} workers, {args.rounds} rounds)")
    finally:
        subprocess.run(["git", "-C", HERE, "worktree", "remove", "--force", earlier], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
