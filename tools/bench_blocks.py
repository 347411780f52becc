"""What many blocks cost: build time against block count, open time, and a simulated 100k-block
cache (open, first batch after resuming at position 0 and 10^12, `torchcache trace` of one step
from a saved state, step_samples at 8 and 8,192 samples, one commit at 100k vs 100).

    python tools/bench_blocks.py [--tokens 1500000] [--simulate 100000]

Figures are ratios within this run (the machine is noisy), plus the absolute times the issue
asks for. The corpus is paragraphs of ../shared/data/corpus/gutenberg_en.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import tempfile
import time

import numpy as np

import torchcache as tc
from torchcache.format import blocks as fmt
from torchcache.format import ledger
from torchcache.format.storage import LocalStorage

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")


def paragraphs_file(out_dir: str, corpus: str, tokens: int) -> list[str]:
    """Two jsonl inputs of Gutenberg paragraphs, about `tokens` GPT-2 tokens in all."""
    chars, want = 0, int(tokens * 2.9)  # GPT-2 on these paragraphs: ~2.9 characters per token
    docs = []
    for path in sorted(glob.glob(os.path.join(corpus, "*.jsonl"))):
        with open(path) as f:
            for line in f:
                for para in json.loads(line)["text"].split("\n\n"):
                    if para.strip():
                        docs.append(para)
                        chars += len(para)
                if chars >= want:
                    break
        if chars >= want:
            break
    paths = []
    for k in range(2):
        path = os.path.join(out_dir, f"part-{k}.jsonl")
        with open(path, "w") as f:
            for doc in docs[k::2]:
                f.write(json.dumps({"text": doc}) + "\n")
        paths.append(path)
    return paths


def timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def build_linearity(tmp: str, inputs: list[str], tokenizer: str) -> None:
    rows = {}
    for block_tokens in (2 ** 24, 1024, 512):
        out = os.path.join(tmp, f"b{block_tokens}")
        seconds = timed(lambda: tc.build_cache(inputs, out, tokenizer, block_tokens=block_tokens,
                                               progress=False))
        cache = tc.TokenCache(out)
        rows[block_tokens] = (cache.num_blocks, seconds, timed(lambda: tc.TokenCache(out), 20))
        print(f"block_tokens {block_tokens:>8}: {cache.num_tokens:,} tokens, {cache.num_blocks:>5} blocks, "
              f"build {seconds:6.1f} s, open {rows[block_tokens][2] * 1e3:6.2f} ms")
    (b1, t1, _), (b2, t2, _) = rows[1024], rows[512]
    print(f"build: {b2 / b1:.2f}x the blocks took {t2 / t1:.2f}x the time (target <= 2x)")
    print(f"open: {rows[512][2] / rows[2 ** 24][2]:.1f}x a {rows[2 ** 24][0]}-block cache's "
          f"(target < 10x)")


def simulate(tmp: str, n_blocks: int, block_tokens: int = 64) -> None:
    """A synthetic v2 cache of `n_blocks` tiny blocks (one document each), written directly."""
    root = os.path.join(tmp, f"sim{n_blocks}")
    storage = LocalStorage(root)
    os.makedirs(os.path.join(root, fmt.BLOCK_DIR))
    spec = {"tokenizer": None, "vocab_size": 50257, "dtype": "U16", "bos_id": None, "eos_id": None,
            "special_tokens_as_text": True, "text_key": "text", "block_tokens": block_tokens,
            "inputs": [{"path": "/synthetic/input.jsonl", "size": None}]}
    ledger.write_header(storage, spec)
    fingerprint = fmt.spec_fingerprint(spec)
    started = time.perf_counter()
    meta = {"format": fmt.FORMAT_NAME, "version": fmt.BLOCK_FILE_VERSION}
    rng = np.random.default_rng(0)
    entries = []
    for b in range(n_blocks):
        tokens = rng.integers(0, 50257, block_tokens, dtype=np.uint16)
        name = fmt.block_name(0, b)
        files = []
        for rel, tensor_name, array in ((name, "tokens", tokens),
                                        (fmt.offsets_name(name), "offsets",
                                         np.array([0, block_tokens], dtype=np.int64))):
            head, _ = fmt.safetensors_bytes(tensor_name, array, meta)
            data = head + array.tobytes()
            with open(os.path.join(root, rel), "wb") as f:  # synthetic: no fsync per file
                f.write(data)
            files.append((len(data), "sha256:" + hashlib.sha256(data).hexdigest()))
        entries.append({"path": name, "checksum": files[0][1], "size": files[0][0],
                        "offsets": fmt.offsets_name(name), "offsets_checksum": files[1][1],
                        "num_tokens": block_tokens, "num_documents": 1, "input": 0, "index": b})
    writer = ledger.LedgerWriter(storage, ledger.empty_head(fingerprint), ledger.CHUNK_RECORDS)
    step = ledger.CHUNK_RECORDS
    for k in range(0, n_blocks, step):
        batch = entries[k: k + step]
        end = k + len(batch)
        head = dict(ledger.empty_head(fingerprint), blocks=end, records=end,
                    num_tokens=end * block_tokens, num_documents=end, complete=end == n_blocks)
        writer.commit([{"input": 0, "entry": e} for e in batch], batch, head)
    print(f"simulated {n_blocks:,} blocks in {time.perf_counter() - started:.1f} s")

    opened = timed(lambda: tc.TokenCache(root), 5)
    print(f"open a {n_blocks:,}-block cache: {opened * 1e3:.1f} ms")
    cache = tc.TokenCache(root)
    ds = tc.TokenDataset(cache, seq_len=16)
    for position in (0, 10 ** 12):
        loader = tc.DataLoader(ds, batch_size=8, shuffle=True, seed=1)
        state = dict(loader.state_dict(), consumed=position)
        start = time.perf_counter()
        fresh = tc.DataLoader(tc.TokenDataset(tc.TokenCache(root), seq_len=16), batch_size=8,
                              shuffle=True, seed=1)
        fresh.load_state_dict(state)
        next(iter(fresh))
        print(f"open + load_state_dict(consumed={position:.0e}) + first batch: "
              f"{(time.perf_counter() - start) * 1e3:.1f} ms")

    # what a loss spike asks: the documents of one step, through the command line's code path
    # (open, loader at a saved state, step_samples, sample_documents, document_info, first words)
    state = dict(tc.DataLoader(ds, batch_size=8, shuffle=True, seed=1).state_dict(), consumed=10 ** 6)
    state_file = os.path.join(tmp, "state.json")
    with open(state_file, "w") as f:
        json.dump(state, f)
    from torchcache.cli import main as cli_main
    import contextlib
    import io
    for step in (12_345, 10 ** 9):
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()) as out:
            assert cli_main(["trace", root, "--seq-len", "16", "--step", str(step),
                             "--state", state_file, "--json"]) == 0
        seconds = time.perf_counter() - start
        traced = json.loads(out.getvalue())
        print(f"torchcache trace of step {step:,} ({len(traced['samples'])} samples) of a "
              f"{n_blocks:,}-block cache: {seconds * 1e3:.0f} ms")
    cost = {}
    for batch in (8, 8192):  # step_samples: O(global batch)
        loader = tc.DataLoader(ds, batch_size=batch, shuffle=True, seed=1)
        cost[batch] = timed(lambda: loader.step_samples(10 ** 6), 20)
    print(f"step_samples: {cost[8] * 1e6:.0f} us for 8 samples, {cost[8192] * 1e6:.0f} us for "
          f"8,192 ({cost[8192] / 8192 * 1e9:.0f} ns a sample)")

    def one_commit(writer: ledger.LedgerWriter, count: int) -> float:
        e = dict(entries[0], index=count)
        head = dict(ledger.empty_head(fingerprint), blocks=count + 1, records=count + 1,
                    num_tokens=(count + 1) * block_tokens, num_documents=count + 1)
        start = time.perf_counter()
        writer.commit([{"input": 0, "entry": e}], [e], head)
        return time.perf_counter() - start

    # a commit at n_blocks vs at 100 (the same work: one block, append + head)
    times = {}
    for count in (100, n_blocks):
        copy = os.path.join(tmp, f"commit{count}")
        shutil.copytree(root, copy)
        copy_storage = LocalStorage(copy)
        head = dict(ledger.empty_head(fingerprint), blocks=count, records=count,
                    num_tokens=count * block_tokens, num_documents=count)
        copy_storage.write_json(ledger.HEAD_NAME, head)
        samples = []
        for k in range(20):
            writer = ledger.LedgerWriter(copy_storage, dict(head, blocks=count + k, records=count + k,
                                                            num_tokens=(count + k) * block_tokens,
                                                            num_documents=count + k),
                                         ledger.CHUNK_RECORDS)
            samples.append(one_commit(writer, count + k))
        times[count] = float(np.median(samples))
    v1_manifest = {"format": "torchcache", "version": 1, "spec": spec, "blocks": entries,
                   "pending": [], "inputs": [{"path": "x", "records": 0, "skipped": {}, "blocks": n_blocks,
                                              "done": False}], "complete": False}
    v1 = timed(lambda: storage.write_json("v1-manifest.json", v1_manifest), 3)
    print(f"one commit: {times[100] * 1e3:.2f} ms at 100 blocks, {times[n_blocks] * 1e3:.2f} ms at "
          f"{n_blocks:,} ({times[n_blocks] / times[100]:.2f}x); a v1 manifest rewrite at {n_blocks:,} "
          f"blocks: {v1 * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    parser.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    parser.add_argument("--tokens", type=int, default=1_500_000)
    parser.add_argument("--simulate", type=int, default=100_000)
    parser.add_argument("--skip-build", action="store_true")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-blocks-")
    try:
        if not args.skip_build:
            inputs = paragraphs_file(tmp, args.corpus, args.tokens)
            build_linearity(tmp, inputs, args.tokenizer)
        if args.simulate:
            simulate(tmp, args.simulate)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
