"""What a remote epoch pays at its start that a local one does not (issue 34): each epoch's new
DataLoader workers read blocks already verified on the machine without asking the store for
their metadata first, and create their S3 client from the API models the main process parsed.

A real moto S3 server on loopback (through s3fs) and a real ~40-block cache; a second server over
the same moto data counts the requests by method. Nothing here depends on timing: the counts
asserted hold for every interleaving.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import torchcache as tc
from torchcache.format.storage import RemoteStorage
from test_remote_cache import tree_bytes, uploaded_cache

SEQ = 64


@pytest.fixture(scope="module")
def remote(tmp_path_factory, books, gpt2_tokenizer_path, s3):
    """(url, local copy path, block bytes): a ~40-block cache built locally and uploaded."""
    return uploaded_cache(tmp_path_factory, books, gpt2_tokenizer_path, s3, "start")


@contextlib.contextmanager
def second_server(s3, middleware):
    """storage_options reaching the module server's data (moto keeps one store per process)
    through a second moto server whose requests go through ``middleware(app, environ,
    start_response)``."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server
    app = DomainDispatcherApplication(create_backend_app)
    server = make_server("127.0.0.1", 0, lambda environ, start: middleware(app, environ, start),
                         threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    try:
        yield {**s3, "client_kwargs": {**s3["client_kwargs"], "endpoint_url": endpoint}}
    finally:
        server.shutdown()
        thread.join()


@pytest.fixture
def counted(s3):
    """(storage_options, counts): a server counting the requests it answers by HTTP method."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def counting(app, environ, start_response):
        with lock:
            counts[environ["REQUEST_METHOD"]] += 1
        return app(environ, start_response)
    with second_server(s3, counting) as options:
        yield options, counts


def epoch(loader, watch):
    batches, largest = [], 0
    for batch in loader:
        batches.append(batch["input_ids"])
        largest = max(largest, tree_bytes(watch))
    return batches, largest


@pytest.mark.s3
def test_new_workers_read_verified_blocks_with_no_metadata_request(tmp_path, remote, counted):
    """Once a block's remote version has been verified on the machine (downloaded whole once,
    checked against its checksum), a new reader process (an epoch's new DataLoader workers)
    pins its ranged reads to that version (S3: If-Match on its ETag) without a HEAD request
    per block; the batches stay exact and the directory within its limit."""
    options, counts = counted
    url, local, cache_bytes = remote
    limit = cache_bytes // 4
    copies = tmp_path / "copies"
    ref = tc.TokenCache(local)
    edges = ref.block_token_starts()
    first = tc.TokenCache(url, storage_options=options, local_dir=str(copies), cache_limit=1)
    starts = edges[:-1][edges[1:] - edges[:-1] >= 4]
    fours = np.full(len(starts), 4)
    assert np.array_equal(first.read_ranges(starts, fours), ref.read_ranges(starts, fours))
    assert counts["HEAD"] >= len(starts)  # each block looked up and verified once
    assert first.stats()["verified_bytes"] >= sum(ref.block_table.size(b) for b in range(len(starts)))
    first.close()

    counts.clear()
    cache = tc.TokenCache(url, storage_options=options, local_dir=str(copies), cache_limit=limit)
    ds, want = tc.TokenDataset(cache, SEQ), tc.TokenDataset(ref, SEQ)
    loader = tc.DataLoader(ds, batch_size=8, num_workers=2, sampler=tc.DistributedSampler(ds, seed=5))
    expected = tc.DataLoader(want, batch_size=8, sampler=tc.DistributedSampler(want, seed=5))
    got, largest = epoch(loader, copies)
    assert len(got) == len(expected) and all(
        torch.equal(a, b["input_ids"]) for a, b in zip(got, expected))
    assert 0 < largest <= limit
    stats = cache.stats()
    assert stats["ranged_reads"] > 0 and stats["verified_bytes"] == 0, stats
    assert counts["HEAD"] == 0, counts
    cache.close()


@pytest.mark.s3
def test_a_forked_reader_creates_its_client_from_the_parsed_store_models(remote, s3):
    """A DataLoader worker (a forked process) connects to S3 without reading botocore's API
    descriptions from disk again: its client is made from the models the parent parsed (each
    new worker otherwise spends 0.1 to 0.3 s of CPU on them before its first request)."""
    botocore = pytest.importorskip("botocore")
    url, _, _ = remote
    storage = RemoteStorage(url, s3)
    assert storage.exists("manifest.json") or storage.exists("head.json")  # the parent connects
    data_dir = os.path.join(os.path.dirname(botocore.__file__), "data")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker: which of botocore's data files does its first request open?
        status = 1
        try:
            opened = []
            sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open"
                             and str(args[0]).startswith(data_dir) else None)
            found = storage.exists("manifest.json") or storage.exists("head.json")
            os.write(write, json.dumps([found, opened]).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as f:
        found, opened = json.loads(f.read())
    assert os.waitpid(pid, 0)[1] == 0
    assert found and opened == []
    # a process that never connected (a fresh filesystem) reads them: the check above can fail
    probe = subprocess.run([sys.executable, "-c", _FRESH, url, json.dumps(s3), data_dir],
                           capture_output=True, text=True, check=True)
    assert json.loads(probe.stdout.strip().splitlines()[-1]) > 0


_FRESH = """
import json, sys
from torchcache.format.storage import RemoteStorage
url, options, data_dir = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
opened = []
sys.addaudithook(lambda event, args: opened.append(1) if event == "open"
                 and str(args[0]).startswith(data_dir) else None)
RemoteStorage(url, options).exists("manifest.json")
print(len(opened))
"""


@pytest.mark.s3
def test_the_block_copies_one_read_needs_download_side_by_side(tmp_path, remote, s3):
    """A read spanning blocks the policy copies whole (the first batches of an epoch, while the
    directory fills) downloads those copies at the same time, not one after the other. The
    server holds the first block request until a second one comes (or 10 s went by): one after
    the other, never two are in flight."""
    url, local, cache_bytes = remote
    cond = threading.Condition()
    seen = {"arrived": 0, "in_flight": 0, "most": 0, "on": False}

    def holding(app, environ, start_response):
        if not (seen["on"] and environ["REQUEST_METHOD"] == "GET" and "/blocks/" in environ["PATH_INFO"]):
            return app(environ, start_response)
        with cond:
            seen["arrived"] += 1
            seen["in_flight"] += 1
            seen["most"] = max(seen["most"], seen["in_flight"])
            cond.notify_all()
            cond.wait_for(lambda: seen["arrived"] >= 2, timeout=10)
        try:
            return list(app(environ, start_response))
        finally:
            with cond:
                seen["in_flight"] -= 1
    ref = tc.TokenCache(local)
    edges = ref.block_token_starts()
    with second_server(s3, holding) as options:
        cache = tc.TokenCache(url, storage_options=options, local_dir=str(tmp_path / "copies"),
                              cache_limit=cache_bytes, readahead=0)  # room for every block
        starts = edges[[2, 5, 9, 14]] + 1
        lengths = np.full(len(starts), SEQ + 1)
        seen["on"] = True
        got = cache.read_ranges(starts, lengths)
        seen["on"] = False
        assert np.array_equal(got, ref.read_ranges(starts, lengths))
        stats = cache.stats()
        assert stats["whole_block_downloads"] == 4 and stats["ranged_reads"] == 0, stats
        assert seen["most"] >= 2, seen
        cache.close()
