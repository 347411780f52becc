"""Remote caches at local pace (issue 34): read-ahead sized from measurements, ranged reads of
one block coalesced into fewer requests with a cap on the bytes spanned for nothing, and the
exactness that must stay (identical batches, the local directory within its limit at every
batch, a reader killed with SIGKILL blocks nobody).

A real moto S3 server on loopback (through s3fs) and a real ~40-block cache. Nothing here depends
on timing: how far ahead a reader fetches changes when requests start, never which bytes a read
gets, and the request counts asserted are bounds that hold for every interleaving.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchcache as tc
from torchcache.read.remote_reads import fetch_depth
from test_remote_cache import tree_bytes, uploaded_cache

SEQ = 64


@pytest.fixture(scope="module")
def remote(tmp_path_factory, books, gpt2_tokenizer_path, s3):
    """(url, local copy path, block bytes): a ~40-block cache built locally and uploaded."""
    return uploaded_cache(tmp_path_factory, books, gpt2_tokenizer_path, s3, "ahead")


def test_fetch_depth_covers_a_request_at_the_measured_pace():
    # 30 ms per request, a read every 5 ms: 6 reads go by while one is answered; twice that,
    # plus a batch of 8
    assert fetch_depth(0.030, 0.005, 8, 1024) == 8 + 12
    assert fetch_depth(0.100, 0.005, 8, 1024) == 8 + 40  # slower store: deeper
    assert fetch_depth(0.100, 0.005, 8, 1024, boost=2.0) == 8 + 80  # reads came in late: deeper
    assert fetch_depth(0.100, 0.0001, 8, 1024) == 1024  # never beyond the window
    assert fetch_depth(0.0001, 0.5, 8, 1024) == 8 + 1  # a fast store: about one batch
    assert fetch_depth(0.0, 0.0, 8, 1024) == 16  # nothing measured yet: two batches
    assert fetch_depth(0.0, 0.0, 8, 4) == 8  # at least the batch


def requests(cache, starts, lengths, ref):
    """(ranged requests, ranged bytes, wasted bytes) of reading ``starts`` once more (the first
    read of a block downloads it whole to verify it: not what is measured here)."""
    assert np.array_equal(cache.read_ranges(starts, lengths), ref.read_ranges(starts, lengths))
    before = cache.stats()
    assert np.array_equal(cache.read_ranges(starts, lengths), ref.read_ranges(starts, lengths))
    after = cache.stats()
    return tuple(after[k] - before[k] for k in ("ranged_reads", "ranged_bytes", "wasted_bytes"))


@pytest.mark.s3
def test_ranges_of_a_block_a_small_gap_apart_are_one_request(tmp_path, remote, s3):
    url, local, _ = remote
    ref = tc.TokenCache(local)
    item = ref.dtype.itemsize
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=1, readahead=0)  # no block fits: every read is ranged
    edges = ref.block_token_starts()
    lengths = np.full(6, SEQ + 1)
    # 8 tokens between windows: spanned (one request), the gaps downloaded for nothing
    near = int(edges[2]) + np.arange(6) * (SEQ + 1 + 8)
    assert requests(cache, near, lengths, ref) == (1, (6 * (SEQ + 1) + 5 * 8) * item, 5 * 8 * item)
    # a gap larger than a window: never spanned
    far = int(edges[4]) + np.arange(6) * (3 * SEQ)
    assert requests(cache, far, lengths, ref) == (6, 6 * (SEQ + 1) * item, 0)


@pytest.mark.s3
def test_bytes_spanned_for_nothing_stay_under_the_cap(tmp_path, remote, s3):
    """Gaps a third of a window wide, read after read: spanning them all would waste a third of
    the bytes; the cap stops spanning at a quarter, so some requests are coalesced, not all."""
    url, local, _ = remote
    ref = tc.TokenCache(local)
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=1, readahead=0)
    edges = ref.block_token_starts()
    gap = (SEQ + 1) // 3
    starts = int(edges[6]) + np.arange(20) * (SEQ + 1 + gap)
    reads, ranged, wasted = requests(cache, starts, np.full(20, SEQ + 1), ref)
    assert 1 < reads < 20
    assert 0 < wasted and 4 * wasted <= ranged - wasted  # <= 1/4 of the bytes asked for
    assert cache.stats()["wasted_bytes"] * 4 <= cache.stats()["ranged_bytes"]


@pytest.mark.s3
@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_epoch_read_ahead_coalesces_and_stays_exact(tmp_path, remote, s3, workers):
    """A shuffled epoch under a limit a quarter of the cache: the batches are the local cache's,
    the local directory is within its limit at every batch, and the reads of each block fetched
    ahead go out in few requests (without coalescing: one request per read by range)."""
    url, local, cache_bytes = remote
    limit = cache_bytes // 4
    copies = tmp_path / "copies"
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=limit)

    def epoch(ds, watch=None):
        loader = tc.DataLoader(ds, batch_size=8, num_workers=workers,
                               sampler=tc.DistributedSampler(ds, seed=7))
        batches, largest = [], 0
        for batch in loader:
            batches.append(batch["input_ids"])
            if watch is not None:
                largest = max(largest, tree_bytes(watch))
        return batches, largest
    got, largest = epoch(tc.TokenDataset(cache, SEQ), watch=copies)
    want, _ = epoch(tc.TokenDataset(local, SEQ))
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert 0 < largest <= limit
    cache.close()
    assert tree_bytes(copies) <= limit
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == sum(len(b) for b in got)
    assert stats["prefetched"] > stats["misses"] // 2, stats
    assert 0 < stats["ranged_reads"] * 2 < stats["misses"], stats  # far fewer requests than reads
    assert stats["wasted_bytes"] * 4 <= stats["ranged_bytes"], stats


_READER = """
import json, sys
import torchcache as tc
url, options, local_dir, limit, workers = json.loads(sys.argv[1])
cache = tc.TokenCache(url, storage_options=options, local_dir=local_dir, cache_limit=limit)
ds = tc.TokenDataset(cache, 64)
loader = tc.DataLoader(ds, batch_size=8, num_workers=workers, sampler=tc.DistributedSampler(ds, seed=1))
for _ in range(100):  # epoch after epoch, until killed
    for i, batch in enumerate(loader):
        print("batch", i, flush=True)
"""


@pytest.mark.s3
@pytest.mark.parametrize("workers", [0, 2])
def test_a_reader_killed_mid_epoch_blocks_nothing(tmp_path, remote, s3, workers):
    """kill -9 of a reader (its whole process group: the main process and its DataLoader
    workers) while it fetches ahead, copies blocks and holds copies open: a new reader of the
    same local directory reads an exact epoch within the limit, and every copy the dead one
    held or was downloading can be evicted (no lock, reservation or in-flight download of it
    is left to block anything)."""
    url, local, cache_bytes = remote
    limit = cache_bytes // 4
    copies = tmp_path / "copies"
    args = json.dumps([url, s3, str(copies), limit, workers])
    reader = subprocess.Popen([sys.executable, "-c", _READER, args], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        for line in reader.stdout:
            if line.strip() == "batch 20":
                break
        else:
            pytest.fail(f"the reader ended before its 20th batch (exit {reader.wait()})")
    finally:
        os.killpg(reader.pid, signal.SIGKILL)
        reader.wait()
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=limit)
    ds, ref = tc.TokenDataset(cache, SEQ), tc.TokenDataset(local, SEQ)
    loader = tc.DataLoader(ds, batch_size=8, num_workers=workers, sampler=tc.DistributedSampler(ds, seed=2))
    expected = tc.DataLoader(ref, batch_size=8, sampler=tc.DistributedSampler(ref, seed=2))
    n = 0
    for got, want in zip(loader, expected, strict=True):
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert tree_bytes(copies) <= limit
        n += 1
    assert n == len(expected)
    cache.close()
    cache.evict(0)  # nobody holds anything now: every copy goes, stale reservations too
    assert tree_bytes(copies) == 0
    assert not [p for p in copies.rglob("*") if ".tmp-" in p.name]
