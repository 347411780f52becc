"""Training from S3 with a bounded local disk, against the same epoch from a fully local cache.

    python tools/bench_remote.py [--shards 2] [--block-tokens 131072] [--limit-fraction 0.25]
                                 [--workers 0 2] [--step-ms 0 40] [--epochs 2]

Builds (once; a re-run is a no-op) a GPT-2 cache of the first ``--shards`` Gutenberg shards,
starts a moto S3 server in its own process on loopback, uploads the cache, then for each worker
count runs shuffled epochs of ``tc.TokenDataset(cache, 2048)`` through ``tc.DataLoader`` (batch
16, ``tc.DistributedSampler(ds, seed=0)``) twice: from the local cache, and from S3 through
``tc.TokenCache(url, local_dir=..., cache_limit=fraction * cache size)`` with a fresh local
directory (the loader plans the remote cache's reads in its sampler's order when it starts
iterating, see ``tc.TokenDataset.plan_reads``). For each it prints samples/s (and the ratio remote / local), bytes downloaded per
epoch over the cache's size, the hit rate, and the largest size the local directory reached
(sampled at every batch) against the limit.

``--step-ms`` adds a simulated training step per batch (``time.sleep``: it holds no GIL, like a
GPU step), to show how much of the remote reading overlaps training. The moto server is a
Python process on the same machine: its request rate, not the network, bounds remote reads, so
the raw ratio (step 0) is a floor; real S3 serves many more concurrent ranged requests.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torchcache as tc  # noqa: E402
from torchcache.read.local_copies import STATS_DIR, tree_bytes  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
SEQ, BATCH = 2048, 16

_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("up", flush=True)
sys.stdin.readline()
server.stop()
"""


def start_s3() -> tuple[subprocess.Popen, dict]:
    """A moto S3 server in its own process, with one bucket; (process, storage_options)."""
    import boto3
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout.readline().strip() == "up"
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="bench")
    return server, {"key": "testing", "secret": "testing",
                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def run_epoch(loader, step: float, watch: str | None) -> tuple[float, int, int]:
    """(samples/s, samples, largest size of the local copies seen) of the loader's next epoch
    (``watch``: the copy directory; its reading sessions' counters are not copies)."""
    largest, n = 0, 0
    start = time.perf_counter()
    for batch in loader:
        n += len(batch["input_ids"])
        if watch is not None:
            largest = max(largest, tree_bytes(watch, skip=(STATS_DIR,)))
        if step:
            time.sleep(step)
    return n / (time.perf_counter() - start), n, largest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="runs/bench-remote/cache")
    p.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    p.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=1 << 17)
    p.add_argument("--limit-fraction", type=float, default=0.25)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    p.add_argument("--step-ms", type=float, nargs="+", default=[0.0, 40.0])
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    shards = sorted(os.path.join(args.corpus, f) for f in os.listdir(args.corpus)
                    if f.endswith(".jsonl"))[: args.shards]
    built = tc.build_cache(shards, args.cache, args.tokenizer, block_tokens=args.block_tokens,
                           num_workers=2, progress=False)
    block_dir = os.path.join(built.path, "blocks")
    cache_bytes = sum(os.path.getsize(os.path.join(block_dir, f)) for f in os.listdir(block_dir)
                      if not f.endswith(".offsets.safetensors"))
    limit = int(cache_bytes * args.limit_fraction)
    print(f"cache: {built.num_tokens:,} tokens, {built.num_blocks} blocks, {cache_bytes / 1e6:.1f} MB "
          f"of blocks; cache_limit {limit / 1e6:.1f} MB ({args.limit_fraction:g} of it); "
          f"seq_len {SEQ}, batch {BATCH}")

    server, options = start_s3()
    try:
        import s3fs
        s3fs.S3FileSystem(**options).put(built.path, "bench/cache", recursive=True)
        url = "s3://bench/cache"
        print(f"{'workers':>7} {'step ms':>7} {'epoch':>5} {'local/s':>9} {'remote/s':>9} {'ratio':>6} "
              f"{'dl/cache':>8} {'hit rate':>8} {'max dir/limit':>13} {'copies':>6} {'ranged':>7} "
              f"{'evicted':>7}")
        for workers in args.workers:
            for step_ms in args.step_ms:
                local_dir = os.path.join(os.path.dirname(built.path), "copies")
                shutil.rmtree(local_dir, ignore_errors=True)
                remote = tc.TokenCache(url, storage_options=options, local_dir=local_dir,
                                       cache_limit=limit)
                local_ds, remote_ds = tc.TokenDataset(built.path, SEQ), tc.TokenDataset(remote, SEQ)
                # one loader each, iterated epoch after epoch (the stream goes on: epoch 2 is a
                # new permutation)
                local_loader = tc.DataLoader(local_ds, batch_size=BATCH, num_workers=workers,
                                             sampler=tc.DistributedSampler(local_ds, seed=0))
                remote_loader = tc.DataLoader(remote_ds, batch_size=BATCH, num_workers=workers,
                                              sampler=tc.DistributedSampler(remote_ds, seed=0))
                before = remote.stats()
                for e in range(args.epochs):
                    local_rate, n_local, _ = run_epoch(local_loader, step_ms / 1e3, None)
                    rate, n, largest = run_epoch(remote_loader, step_ms / 1e3, remote.root)
                    assert n == n_local
                    after = remote.stats()
                    delta = {k: after[k] - before[k] for k in ("bytes_downloaded", "hits", "misses",
                                                               "whole_block_downloads",
                                                               "ranged_reads", "evictions")}
                    before = after
                    served = delta["hits"] + delta["misses"]
                    print(f"{workers:>7} {step_ms:>7g} {e + 1:>5} {local_rate:>9.0f} {rate:>9.0f} "
                          f"{rate / local_rate:>6.2f} {delta['bytes_downloaded'] / cache_bytes:>8.2f} "
                          f"{delta['hits'] / served if served else 0:>8.2f} "
                          f"{largest / limit:>13.3f} {delta['whole_block_downloads']:>6} "
                          f"{delta['ranged_reads']:>7} {delta['evictions']:>7}", flush=True)
                remote.close()
    finally:
        server.stdin.write("stop\n")
        server.stdin.flush()
        server.wait(timeout=30)


main()
