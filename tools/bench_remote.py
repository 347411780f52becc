"""Training from S3 with a bounded local disk, against the same epoch from a fully local cache.

    python tools/bench_remote.py [--shards 2] [--block-tokens 131072] [--limit-fraction 0.25]
                                 [--seq 1024] [--batch 8] [--workers 2] [--step-ms 40]
                                 [--latency-ms 30] [--epochs 2] [--rounds 1]

The defaults are issue 34's acceptance setup: 30 ms per request, a local directory a quarter of
the cache, a 40 ms step per batch, ``TokenDataset(cache, 1024)``, batch 8, 2 workers, shuffled.

Builds (once; a re-run is a no-op) a GPT-2 cache of the first ``--shards`` Gutenberg shards,
starts a moto S3 server in its own process on loopback, uploads the cache, then for each worker
count runs shuffled epochs of ``tc.TokenDataset(cache, --seq)`` through ``tc.DataLoader`` (batch
``--batch``, ``tc.DistributedSampler(ds, seed=0)``), local and remote epochs interleaved: from the local cache, and from S3 through
``tc.TokenCache(url, local_dir=..., cache_limit=fraction * cache size)`` with a fresh local
directory (the loader plans the remote cache's reads in its sampler's order when it starts
iterating, see ``tc.TokenDataset.plan_reads``). For each epoch it prints samples/s (and the
ratio remote / local, of epochs run one after the other), the HTTP requests the server answered
(``reqs``: every GET and HEAD, counted by the server) and the ranged reads among them, bytes
downloaded over the cache's size, bytes downloaded that no read asked for (``wasted``: the gaps
coalesced requests span), the hit rate, and the largest size the local directory reached
(sampled at every batch; the local epochs walk that directory at every batch too, so that both
training loops do the same measuring work) against the limit. With ``--rounds N`` the whole table is run N times
(a fresh local directory each round). ``--persistent``: both loaders keep their workers from
one epoch to the next (a new worker's first batch waits for its S3 client and first requests).

``--latency-ms`` makes the server sleep that long before answering each request (in the
request's own server thread, so concurrent requests overlap as with a real store's first-byte
latency).

``--step-ms`` adds a simulated training step per batch (``time.sleep``: it holds no GIL, like a
GPU step), to show how much of the remote reading overlaps training. The moto server is a
Python process on the same machine: its request rate, not the network, bounds remote reads, so
the raw ratio (step 0) is a floor; real S3 serves many more concurrent ranged requests.
"""

from __future__ import annotations

import argparse
import json
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


# the server: a moto S3 server whose every request first sleeps LATENCY seconds (in its own
# thread: the server is threaded), counting requests; stdin "count" prints the counts, "stop" ends
_SERVER = """
import json, sys, threading, time
from moto.moto_server import werkzeug_app
from moto.server import ThreadedMotoServer
latency = float(sys.argv[2])
counts = {"requests": 0, "ranged": 0}
lock = threading.Lock()
call = werkzeug_app.DomainDispatcherApplication.__call__
def delayed(self, environ, start_response):
    if latency:
        time.sleep(latency)
    with lock:
        counts["requests"] += 1
        counts["ranged"] += "HTTP_RANGE" in environ
    return call(self, environ, start_response)
werkzeug_app.DomainDispatcherApplication.__call__ = delayed
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("up", flush=True)
for line in sys.stdin:
    if line.strip() != "count":
        break
    with lock:
        print(json.dumps(counts), flush=True)
server.stop()
"""


def start_s3(latency_ms: float = 0.0) -> tuple[subprocess.Popen, dict]:
    """A moto S3 server in its own process, with one bucket, that adds ``latency_ms`` to each
    request; (process, storage_options)."""
    import boto3
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port), str(latency_ms / 1e3)],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout.readline().strip() == "up"
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket="bench")
    return server, {"key": "testing", "secret": "testing",
                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def server_counts(server: subprocess.Popen) -> dict:
    """The requests the server answered so far: {"requests": all, "ranged": with a Range}."""
    server.stdin.write("count\n")
    server.stdin.flush()
    return json.loads(server.stdout.readline())


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
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--step-ms", type=float, nargs="+", default=[40.0])
    p.add_argument("--latency-ms", type=float, nargs="+", default=[30.0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--persistent", action="store_true",
                   help="persistent_workers=True (both loaders): workers, their S3 clients and "
                        "read-ahead live on from one epoch to the next")
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
          f"seq_len {args.seq}, batch {args.batch}")
    print(f"{'round':>5} {'lat ms':>6} {'workers':>7} {'step ms':>7} {'epoch':>5} {'local/s':>8} "
          f"{'remote/s':>8} {'ratio':>6} {'reqs':>6} {'ranged':>6} {'dl/cache':>8} {'wasted':>8} "
          f"{'hit rate':>8} {'max dir/limit':>13} {'copies':>6} {'evicted':>7}", flush=True)
    for r in range(args.rounds):
        for latency_ms in args.latency_ms:
            server, options = start_s3(latency_ms)
            try:
                import s3fs
                s3fs.S3FileSystem(**options).put(built.path, "bench/cache", recursive=True)
                for workers in args.workers:
                    for step_ms in args.step_ms:
                        bench_one(built.path, options, server, r, latency_ms, workers, step_ms,
                                  args, cache_bytes, limit)
            finally:
                server.stdin.write("stop\n")
                server.stdin.flush()
                server.wait(timeout=30)


def bench_one(path: str, options: dict, server: subprocess.Popen, r: int, latency_ms: float,
              workers: int, step_ms: float, args, cache_bytes: int, limit: int) -> None:
    """Interleaved local and remote epochs of one configuration, one line per epoch."""
    url = "s3://bench/cache"
    local_dir = os.path.join(os.path.dirname(path), "copies")
    shutil.rmtree(local_dir, ignore_errors=True)
    remote = tc.TokenCache(url, storage_options=options, local_dir=local_dir, cache_limit=limit)
    local_ds, remote_ds = tc.TokenDataset(path, args.seq), tc.TokenDataset(remote, args.seq)
    # one loader each, iterated epoch after epoch (the stream goes on: epoch 2 is a new
    # permutation)
    persistent = args.persistent and workers > 0
    local_loader = tc.DataLoader(local_ds, batch_size=args.batch, num_workers=workers,
                                 sampler=tc.DistributedSampler(local_ds, seed=0),
                                 persistent_workers=persistent)
    remote_loader = tc.DataLoader(remote_ds, batch_size=args.batch, num_workers=workers,
                                  sampler=tc.DistributedSampler(remote_ds, seed=0),
                                  persistent_workers=persistent)
    before, requests = remote.stats(), server_counts(server)
    for e in range(args.epochs):
        # (the local epoch measures the copy directory at every batch too: the same work in both
        # training loops, so that the ratio is the loaders' own)
        local_rate, n_local, _ = run_epoch(local_loader, step_ms / 1e3, remote.root)
        rate, n, largest = run_epoch(remote_loader, step_ms / 1e3, remote.root)
        assert n == n_local
        after, now = remote.stats(), server_counts(server)
        delta = {k: after.get(k, 0) - before.get(k, 0)
                 for k in ("bytes_downloaded", "hits", "misses", "whole_block_downloads",
                           "ranged_reads", "evictions", "wasted_bytes")}
        reqs = {k: now[k] - requests[k] for k in now}
        before, requests = after, now
        served = delta["hits"] + delta["misses"]
        print(f"{r + 1:>5} {latency_ms:>6g} {workers:>7} {step_ms:>7g} {e + 1:>5} {local_rate:>8.0f} "
              f"{rate:>8.0f} {rate / local_rate:>6.2f} {reqs['requests']:>6} {reqs['ranged']:>6} "
              f"{delta['bytes_downloaded'] / cache_bytes:>8.2f} {delta['wasted_bytes']:>8} "
              f"{delta['hits'] / served if served else 0:>8.2f} "
              f"{largest / limit:>13.3f} {delta['whole_block_downloads']:>6} "
              f"{delta['evictions']:>7}", flush=True)
    remote.close()


if __name__ == "__main__":
    main()
