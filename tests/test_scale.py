"""Scale out: caches on S3 (a real moto S3 server on loopback, through s3fs) and builds on Ray."""

from __future__ import annotations

import json
import logging
import re
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import moto_s3, paragraphs, tree_bytes, write_jsonl

import torchcache as tc
from torchcache.format.ledger import read_manifest
from torchcache.format.storage import open_storage

BLOCK = 2_000


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket; yields (storage_options, request counter)."""
    with moto_s3() as options:
        requests = _RequestLog()
        logging.getLogger("werkzeug").addHandler(requests)
        logging.getLogger("werkzeug").setLevel(logging.INFO)
        try:
            yield options, requests
        finally:
            logging.getLogger("werkzeug").removeHandler(requests)


class _RequestLog(logging.Handler):
    """Counts GETs per object key, from the S3 server's own request log."""

    def __init__(self):
        super().__init__()
        self.gets: Counter[str] = Counter()

    def emit(self, record):
        match = re.search(r'"GET /bucket/(\S+?)(\?\S*)? HTTP', record.getMessage())
        if match:
            self.gets[match.group(1)] += 1


def _s3fs(options):
    import s3fs
    return s3fs.S3FileSystem(**options)


@pytest.fixture()
def inputs(tmp_path, books):
    docs = paragraphs(books)
    return [write_jsonl(tmp_path / f"in{i}.jsonl", docs[i::3]) for i in range(3)]


@pytest.mark.slow
@pytest.mark.s3
def test_build_to_s3_equals_local_and_reads_back_with_workers(tmp_path, inputs, s3, gpt2_tokenizer_path):
    options, requests = s3
    local = tc.build_cache(inputs, tmp_path / "local", gpt2_tokenizer_path, block_tokens=BLOCK,
                           num_workers=2, progress=False)
    url = "s3://bucket/t1/cache"
    remote = tc.build_cache(inputs, url, gpt2_tokenizer_path, block_tokens=BLOCK, num_workers=2,
                            storage_options=options, progress=False)
    assert remote.fingerprint == local.fingerprint and remote.num_blocks == local.num_blocks > 10
    fs = _s3fs(options)
    expected = tree_bytes(local.path)
    listed = {p.split("t1/cache/", 1)[1] for p in fs.find("bucket/t1/cache")}
    assert listed == set(expected)  # no lock or temporary objects left behind
    for rel, data in expected.items():
        assert fs.cat_file(f"bucket/t1/cache/{rel}") == data, rel

    # read from S3 with 2 DataLoader workers; every block is downloaded exactly once
    requests.gets.clear()
    cache = tc.TokenCache(url, storage_options=options, local_dir=str(tmp_path / "copies"))
    ds, ref = tc.TokenDataset(cache, 64), tc.TokenDataset(local.path, 64)
    def batches(d):
        loader = tc.DataLoader(d, batch_size=8, sampler=tc.DistributedSampler(d, seed=1), num_workers=2)
        return [b["input_ids"] for b in loader]
    got, want = batches(ds), batches(ref)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    block_gets = {k: v for k, v in requests.gets.items() if "/blocks/" in k}
    assert len(block_gets) == local.num_blocks   # every block (windows need no offsets) ...
    assert set(block_gets.values()) == {1}       # ... fetched once, whichever worker needed it
    assert not [p for p in (tmp_path / "copies").rglob("*") if ".tmp-" in p.name]
    assert tc.verify_cache(url, storage_options=options, local_dir=str(tmp_path / "copies")) == []
    block_gets = {k: v for k, v in requests.gets.items() if "/blocks/" in k}
    assert len(block_gets) == 2 * local.num_blocks and set(block_gets.values()) == {1}


@pytest.mark.s3
def test_corrupted_remote_block_is_retried_then_reported(tmp_path, inputs, s3, gpt2_tokenizer_path):
    options, _ = s3
    url = "s3://bucket/t2/cache"
    tc.build_cache(inputs[:1], url, gpt2_tokenizer_path, block_tokens=BLOCK, storage_options=options,
                   progress=False)
    fs = _s3fs(options)
    manifest = read_manifest(open_storage(url, options))
    bad = manifest["blocks"][1]["path"]
    data = bytearray(fs.cat_file(f"bucket/t2/cache/{bad}"))
    data[-3] ^= 0xFF
    fs.pipe_file(f"bucket/t2/cache/{bad}", bytes(data))
    cache = tc.TokenCache(url, storage_options=options, local_dir=str(tmp_path / "copies"))
    cache.read(0, int(cache.block_token_starts()[1]))  # block 0 is fine
    with pytest.raises(tc.CacheFormatError, match=f"{url}/{bad}: download failed 3 times.*checksum"):
        cache.read(0, cache.num_tokens)
    assert not (tmp_path / "copies" / manifest["fingerprint"] / bad).exists()


@pytest.mark.s3
def test_s3_builds_are_locked_by_a_lease_that_expires(tmp_path, inputs, s3, gpt2_tokenizer_path):
    import time
    options, _ = s3
    fs = _s3fs(options)
    url = "s3://bucket/t3/cache"
    fs.pipe_file("bucket/t3/cache/.lock", json.dumps({"owner": "other-host:1",
                                                      "expires": time.time() + 60}).encode())
    with pytest.raises(tc.BuildError, match="another builder"):
        tc.build_cache(inputs[:1], url, gpt2_tokenizer_path, storage_options=options, progress=False)
    fs.pipe_file("bucket/t3/cache/.lock", json.dumps({"owner": "crashed-host:1",
                                                      "expires": time.time() - 1}).encode())
    result = tc.build_cache(inputs[:1], url, gpt2_tokenizer_path, storage_options=options,
                            progress=False)
    assert result.num_documents > 0 and not fs.exists("bucket/t3/cache/.lock")


@pytest.mark.slow
@pytest.mark.ray
def test_ray_executor_builds_the_same_cache(tmp_path, inputs, ray_local, gpt2_tokenizer_path):
    local = tc.build_cache(inputs, tmp_path / "local", gpt2_tokenizer_path, block_tokens=BLOCK,
                           num_workers=1, progress=False)
    on_ray = tc.build_cache(inputs, tmp_path / "ray", gpt2_tokenizer_path, block_tokens=BLOCK,
                            executor="ray", progress=False)
    assert tree_bytes(on_ray.path) == tree_bytes(local.path)
    assert tc.build_cache(inputs, tmp_path / "ray", gpt2_tokenizer_path, block_tokens=BLOCK,
                          executor="ray", progress=False).tokens_built == 0
    # inputs and output given as URLs of a filesystem every node (here: every Ray worker) sees
    shared = tmp_path / "shared"
    on_url = tc.build_cache([f"file://{p}" for p in inputs], f"file://{shared}/cache",
                            gpt2_tokenizer_path, block_tokens=BLOCK, executor="ray", progress=False)
    assert on_url.fingerprint == local.fingerprint
    assert tree_bytes(str(shared / "cache")) == tree_bytes(local.path)


@pytest.mark.slow
@pytest.mark.ray
def test_a_pipeline_builds_on_ray_as_locally(tmp_path, inputs, ray_local, gpt2_tokenizer_path):
    """A lazy pipeline's functions reach Ray tasks by value: the cache equals the local build."""
    limit = 200
    steps = (lambda pipe: pipe.filter(lambda r: len(r["text"]) > limit)
             .map(lambda r: {"text": r["text"][:limit]}))
    local = steps(tc.source(inputs)).tokenize(gpt2_tokenizer_path, block_tokens=BLOCK, num_workers=1,
                                              progress=False).cache(tmp_path / "local")
    steps(tc.source(inputs)).tokenize(gpt2_tokenizer_path, block_tokens=BLOCK, executor="ray",
                                      progress=False).cache(tmp_path / "ray")
    assert local.skipped["filtered"] > 0
    assert tree_bytes(str(tmp_path / "ray")) == tree_bytes(str(tmp_path / "local"))


@pytest.mark.slow
@pytest.mark.ray
def test_ray_executor_resumes_a_partial_build_and_reports_bad_input(tmp_path, inputs, books, ray_local,
                                                                    gpt2_tokenizer_path):
    docs = [json.dumps({"text": t}) for t in paragraphs(books, 500)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(docs[:400] + ["{oops"] + docs[400:]) + "\n")
    out = tmp_path / "c"
    with pytest.raises(tc.InputError, match="bad.jsonl:401: malformed JSON"):
        tc.build_cache(inputs + [str(bad)], out, gpt2_tokenizer_path, block_tokens=BLOCK,
                       executor="ray", progress=False)
    kept = read_manifest(str(out))
    assert kept["blocks"] or kept["pending"]
    tc.build_cache(inputs + [str(bad)], out, gpt2_tokenizer_path, block_tokens=BLOCK, executor="ray",
                   on_error="skip", progress=False)
    fresh = tc.build_cache(inputs + [str(bad)], tmp_path / "fresh", gpt2_tokenizer_path,
                           block_tokens=BLOCK, on_error="skip", num_workers=1, progress=False)
    assert tree_bytes(str(out)) == tree_bytes(fresh.path)
    assert np.array_equal(tc.TokenCache(out).read(0, 100), tc.TokenCache(fresh.path).read(0, 100))


@pytest.mark.s3
def test_inputs_on_s3_build_the_same_blocks(tmp_path, inputs, s3, gpt2_tokenizer_path):
    options, _ = s3
    fs = _s3fs(options)
    for i, path in enumerate(inputs):
        fs.put_file(path, f"bucket/t5/in/part-{i}.jsonl")
    local = tc.build_cache(inputs, tmp_path / "local", gpt2_tokenizer_path, block_tokens=BLOCK,
                           num_workers=1, progress=False)
    remote_in = tc.build_cache("s3://bucket/t5/in/*.jsonl", tmp_path / "from-s3", gpt2_tokenizer_path,
                               block_tokens=BLOCK, num_workers=2, storage_options=options,
                               progress=False)
    cache = tc.TokenCache(remote_in.path)
    assert [i["path"] for i in cache.spec["inputs"]] == [f"s3://bucket/t5/in/part-{i}.jsonl"
                                                         for i in range(3)]
    blocks = {k: v for k, v in tree_bytes(local.path).items() if k.startswith("blocks/")}
    assert blocks == {k: v for k, v in tree_bytes(remote_in.path).items() if k.startswith("blocks/")}
