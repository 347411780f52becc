"""Local vs Ray build time, and first-epoch read throughput from S3 vs a local cache, in one run.

    python tools/bench_scale.py [--corpus DIR] [--tokenizer tokenizer.json] [--skip-ray]

The S3 endpoint is a moto server on 127.0.0.1 (moto[server], s3fs), so the figures measure the
protocol and the local block copies, not a real network. Ray runs a local instance with as many
CPUs as the local pool has workers.
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import tempfile
import time

SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")


def s3_server():
    import boto3
    from moto.server import ThreadedMotoServer
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="x",
                 aws_secret_access_key="x").create_bucket(Bucket="bench")
    return server, {"key": "x", "secret": "x",
                    "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def epoch_throughput(cache, seq_len: int, batch: int, workers: int) -> tuple[float, int]:
    import torchcache as tc
    ds = tc.TokenDataset(cache, seq_len)
    loader = tc.DataLoader(ds, batch_size=batch, sampler=tc.DistributedSampler(ds, seed=0),
                           num_workers=workers)
    start, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["input_ids"])
    return n / (time.perf_counter() - start), n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    parser.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    import torchcache as tc
    shards = sorted(glob.glob(os.path.join(args.corpus, "*.jsonl")))
    tmp = tempfile.mkdtemp(prefix="bench-scale-")
    rows = []

    local = tc.build_cache(shards, os.path.join(tmp, "local"), args.tokenizer,
                           num_workers=args.workers, progress=False)
    rows.append(("build, local pool", local.seconds, f"{local.tokens_built / local.seconds / 1e6:.3f} M tok/s"))
    if not args.skip_ray:
        import ray
        ray.init(num_cpus=args.workers, log_to_driver=False, include_dashboard=False)
        start = time.perf_counter()
        on_ray = tc.build_cache(shards, os.path.join(tmp, "ray"), args.tokenizer, executor="ray",
                                progress=False)
        ray_s = time.perf_counter() - start
        ray.shutdown()
        same = _same_tree(local.path, on_ray.path)
        rows.append(("build, ray executor", ray_s,
                     f"{on_ray.tokens_built / ray_s / 1e6:.3f} M tok/s; identical: {same}"))

    server, options = s3_server()
    try:
        import fsspec
        fs = fsspec.filesystem("s3", **options)
        fs.put(local.path, "bench/cache", recursive=True)
        remote = tc.TokenCache("s3://bench/cache", storage_options=options,
                               local_dir=os.path.join(tmp, "copies"))
        for name, cache in (("read epoch 1, local", tc.TokenCache(local.path)),
                            ("read epoch 1, s3 (downloads)", remote)):
            rate, n = epoch_throughput(cache, 2048, 16, 2)
            rows.append((name, n / rate, f"{rate:,.0f} samples/s"))
        rate, n = epoch_throughput(tc.TokenCache("s3://bench/cache", storage_options=options,
                                                 local_dir=os.path.join(tmp, "copies")), 2048, 16, 2)
        rows.append(("read epoch 1 again, s3 (local copies)", n / rate, f"{rate:,.0f} samples/s"))
    finally:
        server.stop()
    print(f"{'what':40s} {'seconds':>8s}  rate")
    for name, seconds, rate in rows:
        print(f"{name:40s} {seconds:8.1f}  {rate}")


def _same_tree(a: str, b: str) -> bool:
    def files(root):
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(root) for f in fs if f != ".lock"}
    return files(a) == files(b)


if __name__ == "__main__":
    main()
