"""Shared fixtures: the real GPT-2 tokenizer and a small real corpus, both from tests/data."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def gpt2_tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    return str(path)


@pytest.fixture(scope="session")
def gpt2(gpt2_tokenizer_path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(gpt2_tokenizer_path)


@pytest.fixture(scope="session")
def books() -> list[dict]:
    with open(DATA / "gutenberg_small.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def paragraphs(books: list[dict], limit: int | None = None) -> list[str]:
    """Real short documents: the books cut at blank lines."""
    out = [p for b in books for p in b["text"].split("\n\n") if p.strip()]
    return out[:limit] if limit else out


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture()
def shards(tmp_path, books) -> list[str]:
    """Three real jsonl shards of paragraph documents (about 1,500 documents)."""
    docs = paragraphs(books)
    d = tmp_path / "in"
    d.mkdir()
    return [write_jsonl(d / f"part-{i}.jsonl", docs[i::3]) for i in range(3)]


@contextlib.contextmanager
def moto_s3(bucket: str = "bucket"):
    """A moto S3 server on 127.0.0.1 with one empty bucket (skips the test without moto/s3fs);
    yields the fsspec storage_options that reach it."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import boto3
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
        yield {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    finally:
        server.stop()


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every file of a cache (but the lock), by relative path."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name == ".lock":
                continue
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = Path(full).read_bytes()
    return out


def build_killed_at_commit(inputs: list[str], out, tokenizer: str, commits: int, *,
                           workers: int = 1, block_tokens: int = 2_000) -> int:
    """Run `build_cache` in a child process that SIGKILLs itself right after its `commits`-th
    manifest write (the builder's TORCHCACHE_TEST_KILL_AFTER_COMMITS hook): an interruption at a
    known commit instead of a race with a timer. Returns the exit code: -9 when it was killed,
    0 when the build finished before its `commits`-th manifest write."""
    script = ("import sys, json, torchcache as tc\n"
              "tc.build_cache(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], "
              f"block_tokens={block_tokens}, num_workers={workers}, progress=False)\n")
    env = dict(os.environ, TORCHCACHE_TEST_KILL_AFTER_COMMITS=str(commits))
    return subprocess.run([sys.executable, "-c", script, json.dumps(inputs), str(out), tokenizer],
                          env=env, timeout=300).returncode


def as_format_v1(root) -> None:
    """Rewrite a cache in format v1 (everything in one manifest.json), as torchcache before
    format v2 built it: the new code must keep reading such caches."""
    import shutil

    from torchcache.format.ledger import read_manifest
    manifest = read_manifest(str(root))
    manifest["version"] = 1
    manifest.pop("chunk_records", None)
    Path(root, "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    Path(root, "head.json").unlink()
    for folder in ("index", "log"):
        shutil.rmtree(Path(root, folder), ignore_errors=True)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket, for a test module; yields its storage_options."""
    import logging
    with moto_s3() as options:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        yield options


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs) for a test module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()


def wait_for_blocks(path, handle, minimum: int = 1):
    """The TokenCache at `path` once a background build (`handle`) has committed `minimum` blocks
    (polling; the build's error, if it fails first)."""
    import time

    import torchcache as tc
    while True:
        assert handle.error is None, handle.error
        try:
            cache = tc.TokenCache(path)
            if cache.num_blocks >= minimum:
                return cache
        except FileNotFoundError:
            pass
        time.sleep(0.01)
