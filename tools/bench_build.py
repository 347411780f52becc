"""Builder throughput against plain `Tokenizer.encode_batch`, in one run on the same machine.

    python tools/bench_build.py [--corpus DIR] [--tokenizer tokenizer.json] [--workers N]

Prints tokens/s of the baseline (whole-document encode_batch, encoding time only, per shard) and of
`build_cache` (everything: reading, tokenizing, writing, fsync), their ratio, whether the ids are
identical, and the builder's peak RSS (whole process tree) on the full corpus and on a fifth of it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil
from tokenizers import Tokenizer

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def baseline(shards: list[str], tokenizer: str) -> tuple[float, list[list[list[int]]]]:
    tok = Tokenizer.from_file(tokenizer)
    seconds, ids = 0.0, []
    for path in shards:
        with open(path, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        t = time.perf_counter()
        encoded = tok.encode_batch(texts, add_special_tokens=False)
        seconds += time.perf_counter() - t
        ids.append([e.ids for e in encoded])
    return seconds, ids


def build_with_rss(shards: list[str], tokenizer: str, out: str, workers: int | None) -> tuple[float, float]:
    """Run build_cache in a child process; return (seconds, peak RSS of the process tree in MB)."""
    code = ("import sys, json, torchcache as tc; "
            "tc.build_cache(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], "
            "num_workers=json.loads(sys.argv[4]), progress=False)")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(shards), out, tokenizer,
                             json.dumps(workers)])
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            rss = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            rss = 0
        peak = max(peak, rss)
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"build failed with exit code {proc.returncode}")
    return time.perf_counter() - start, peak / 2 ** 20


def cache_ids_by_input(out: str) -> list[list[list[int]]]:
    import torchcache as tc
    from torchcache.format.blocks import read_tensor_file
    from torchcache.format.ledger import read_manifest
    cache = tc.TokenCache(out)
    manifest = read_manifest(out)
    per_input: dict[int, list[list[int]]] = {}
    starts = cache.block_token_starts()
    for b, entry in sorted(enumerate(manifest["blocks"]), key=lambda x: (x[1]["input"], x[1]["index"])):
        tokens = cache.read(int(starts[b]), int(starts[b + 1])).astype(np.int64)
        offsets = read_tensor_file(os.path.join(out, entry["offsets"]), "offsets")
        docs = per_input.setdefault(entry["input"], [])
        docs.extend(tokens[offsets[i]:offsets[i + 1] - 1].tolist() for i in range(len(offsets) - 1))
    return [per_input[i] for i in sorted(per_input)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    parser.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    parser.add_argument("--workers", type=int, default=None, help="builder workers (default: all cores)")
    args = parser.parse_args()
    shards = sorted(glob.glob(os.path.join(args.corpus, "*.jsonl")))
    if not shards:
        raise SystemExit(f"no *.jsonl in {args.corpus}")
    size = sum(os.path.getsize(s) for s in shards)
    print(f"corpus: {len(shards)} shards, {size / 1e6:.1f} MB; cores: {os.cpu_count()}")

    base_s, base_ids = baseline(shards, args.tokenizer)
    n_tokens = sum(len(d) for shard in base_ids for d in shard)
    print(f"baseline encode_batch (whole documents): {n_tokens:,} tokens in {base_s:.1f} s = "
          f"{n_tokens / base_s / 1e6:.3f} M tokens/s")

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cache")
        build_s, peak = build_with_rss(shards, args.tokenizer, out, args.workers)
        print(f"build_cache: {n_tokens:,} tokens in {build_s:.1f} s = {n_tokens / build_s / 1e6:.3f} M "
              f"tokens/s (wall clock incl. process start), peak RSS {peak:.0f} MB")
        identical = cache_ids_by_input(out) == base_ids
        print(f"ids identical to whole-document encoding: {identical}")
        small = shards[: max(1, len(shards) // 5)]
        _, small_peak = build_with_rss(small, args.tokenizer, os.path.join(tmp, "small"), args.workers)
    print(f"peak RSS on {len(small)} shard(s): {small_peak:.0f} MB; on {len(shards)}: {peak:.0f} MB "
          f"(ratio {peak / small_peak:.2f})")
    print(f"RATIO builder / baseline tokens/s: {base_s / build_s:.2f}x")
    if not identical:
        raise SystemExit("ids differ from whole-document encoding")


if __name__ == "__main__":
    main()
