"""Remote caches bigger than the local disk: TokenCache(url, local_dir=..., cache_limit=...).

A real moto S3 server on loopback (through s3fs), a real cache about 4x the limit. Nothing here
depends on timing: concurrent runs only change how many bytes move, and the assertions are bounds
that hold for every interleaving (the copy directory is checked at every batch).
"""

from __future__ import annotations

import gc
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import paragraphs, write_jsonl

import torchcache as tc
from torchcache.read.local_copies import STATS_DIR, LocalCopies, SessionStats, copy_name, parse_size

BLOCK = 2_000  # tokens per block: ~40 blocks of ~4 KB
BLOCK0 = "blocks/000000-000000.safetensors"
SEQ = 64


def tree_bytes(folder) -> int:
    """Bytes of the local copies under ``folder``: every file but reading sessions' counters
    (``.stats``, which are not copies and not under the limit). Readers in other processes may
    remove a file between the listing and its stat: it then counts for nothing."""
    total = 0
    for p in Path(folder).rglob("*"):
        if STATS_DIR in p.relative_to(folder).parts:
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


# ---------------------------------------------------------------- no server needed

def test_parse_size_units_and_errors():
    assert parse_size(4096) == 4096
    assert parse_size(np.int64(10)) == 10
    assert parse_size("200GB") == 200 * 10**9
    assert parse_size("200 gb") == 200 * 10**9
    assert parse_size("1.5TB") == 1_500_000_000_000
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("2Gi") == 2 * 2**30
    assert parse_size("10k") == 10_000
    assert parse_size(" 7 ") == 7
    assert parse_size("1.1GB") == 1_100_000_000  # exact decimal, no float rounding
    assert parse_size("0.5KiB") == 512
    for bad in ("lots", "10XB", "GB", "-5GB", "1e9", "", "5 G B"):
        with pytest.raises(ValueError, match=r"cache_limit must be .*'200GB'.*got"):
            parse_size(bad)
    for bad in (0, -1, "0MB", "0.1B"):
        with pytest.raises(ValueError, match="cache_limit must be at least 1 byte"):
            parse_size(bad)
    for bad in (1.5, True, None, [1]):
        with pytest.raises(TypeError, match="cache_limit must be a number of bytes"):
            parse_size(bad)
    with pytest.raises(ValueError, match="keep_bytes"):
        parse_size("x", "keep_bytes")


def test_bad_cache_limit_is_refused_before_any_network_access():
    with pytest.raises(ValueError, match="cache_limit"):
        tc.TokenCache("s3://no-such-bucket/cache", cache_limit="a lot")
    with pytest.raises(TypeError, match="fetch_threads"):
        tc.TokenCache("s3://no-such-bucket/cache", cache_limit="1GB", fetch_threads=2.5)


def test_local_cache_ignores_the_limit_and_reports_zeros(tmp_path, shards, gpt2_tokenizer_path):
    built = tc.build_cache(shards[:1], tmp_path / "c", gpt2_tokenizer_path, block_tokens=BLOCK,
                           progress=False)
    cache = tc.TokenCache(built.path, cache_limit="1KB")  # read in place: nothing is copied
    assert cache.read(0, 10).shape == (10,)
    stats = cache.stats()
    assert stats["bytes_downloaded"] == 0 and stats["hit_rate"] is None and stats["local_bytes"] == 0
    with pytest.raises(ValueError, match="evict.*cache_limit"):
        cache.evict()
    cache.plan_reads(np.array([0, 100]), length=5)  # a no-op for a local cache


def test_dead_writers_reservation_is_reclaimed(tmp_path):
    """A download killed mid-way leaves a reservation whose lock is free: the next scan deletes
    it, so its space is not lost forever."""
    copies = LocalCopies(str(tmp_path), limit=1000)
    os.makedirs(tmp_path / "blocks")
    (tmp_path / "blocks" / "000000-000001.safetensors.tmp-4242-r0").write_bytes(b"\0" * 900)
    assert copies.usage() == 900
    status, reservation, used = copies.reserve("blocks/000000-000000.safetensors", 500,
                                               lambda residents: ([], 0))
    assert status == "reserved" and used == 500
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == [
        f"000000-000000.safetensors.tmp-{os.getpid()}-r0"]
    reservation.commit(b"x" * 500)
    assert (tmp_path / "blocks" / "000000-000000.safetensors").read_bytes() == b"x" * 500
    assert copies.usage() == 500


def test_session_counters_live_in_the_copy_directory_and_go_with_the_session(tmp_path, monkeypatch):
    """Counters of a reading session are summed over its processes (a forked DataLoader
    worker's too), kept in the copy directory (never in $TMPDIR) and removed with the session;
    a session whose process was killed is removed by the next one."""
    temp = tmp_path / "tmpdir"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    folder = tmp_path / "copies" / STATS_DIR
    stats = SessionStats(str(folder))
    session = folder / stats.session
    stats.add("hits", 2)
    pid = os.fork()
    if pid == 0:  # a worker: its own counters, in its own file
        stats.add_many({"hits": 3, "misses": 1})
        stats.flush()
        os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    totals = stats.totals()
    assert (totals["hits"], totals["misses"]) == (5, 1)
    assert sorted(p.name for p in session.iterdir()) == sorted(
        [f"{os.getpid()}.bin", f"{pid}.bin", "owner.lock"])
    killed = folder / "0123abcd"  # a session whose first process died: nobody holds its lock
    killed.mkdir()
    (killed / "owner.lock").touch()
    (killed / "42.bin").write_bytes(b"\0" * 8)
    other = SessionStats(str(folder))
    assert not killed.exists() and session.exists()  # ours is alive: kept
    del stats, other
    gc.collect()
    assert list(folder.iterdir()) == [] and list(temp.iterdir()) == []
    in_memory = SessionStats(None)
    in_memory.add("misses", 4)
    assert in_memory.totals()["misses"] == 4


# ---------------------------------------------------------------- on S3 (moto)

def uploaded_cache(tmp_path_factory, books, tokenizer, s3, key: str) -> tuple[str, str, int]:
    """(url, local copy path, block bytes): a ~40-block cache built locally and uploaded to
    bucket/`key`."""
    import s3fs
    root = tmp_path_factory.mktemp(key)
    docs = paragraphs(books)
    inputs = [write_jsonl(root / f"in{i}.jsonl", docs[i::3]) for i in range(3)]
    built = tc.build_cache(inputs, root / "cache", tokenizer, block_tokens=BLOCK,
                           num_workers=1, progress=False)
    s3fs.S3FileSystem(**s3).put(str(root / "cache"), f"bucket/{key}", recursive=True)
    blocks = [p for p in (root / "cache" / "blocks").iterdir() if not p.name.endswith(".offsets.safetensors")]
    assert len(blocks) == built.num_blocks >= 30
    return f"s3://bucket/{key}", str(root / "cache"), sum(p.stat().st_size for p in blocks)


@pytest.fixture(scope="module")
def remote(tmp_path_factory, books, gpt2_tokenizer_path, s3):
    """(url, local copy path, block bytes): a ~40-block cache built locally and uploaded."""
    return uploaded_cache(tmp_path_factory, books, gpt2_tokenizer_path, s3, "remote")


def epoch(ds, *, workers, shuffle=True, watch=None):
    """The batches of one loader epoch; with ``watch``, the largest size of that directory seen
    at any batch."""
    loader = tc.DataLoader(ds, batch_size=8, sampler=tc.DistributedSampler(ds, seed=3, shuffle=shuffle),
                           num_workers=workers)
    batches, largest = [], 0
    for batch in loader:
        batches.append(batch["input_ids"])
        if watch is not None:
            largest = max(largest, tree_bytes(watch))
    return batches, largest


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("workers", [0, 2])
def test_shuffled_epoch_under_a_limit_a_quarter_of_the_cache(tmp_path, remote, s3, workers):
    url, local, cache_bytes = remote
    limit = cache_bytes // 4
    copies = tmp_path / "copies"
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=limit)
    got, largest = epoch(tc.TokenDataset(cache, SEQ), workers=workers, watch=copies)
    want, _ = epoch(tc.TokenDataset(local, SEQ), workers=0)
    assert same(got, want)  # exactly the samples of the local copy, in the same order
    assert 0 < largest <= limit  # never above the limit, checked at every batch
    cache.close()  # waits for what this process still fetches ahead (the next epoch's reads)
    assert tree_bytes(copies) <= limit
    stats = cache.stats()  # summed over the worker processes
    assert stats["bytes_downloaded"] <= 3 * cache_bytes, stats
    assert stats["whole_block_downloads"] >= 1 and stats["ranged_reads"] >= 1
    assert stats["hits"] + stats["misses"] == sum(len(b) for b in got)  # each sample once
    assert 0 < stats["hit_rate"] < 1 and stats["prefetched"] > 0
    assert stats["local_bytes"] == tree_bytes(copies) and stats["cache_limit"] == limit
    assert not [p for p in copies.rglob("*") if ".tmp-" in p.name]

    # the same epoch again: the copies kept serve part of it
    again, largest = epoch(tc.TokenDataset(cache, SEQ), workers=workers, watch=copies)
    assert same(again, want) and largest <= limit
    second = cache.stats()
    assert second["bytes_downloaded"] - stats["bytes_downloaded"] <= 3 * cache_bytes
    assert second["hits"] > stats["hits"]


@pytest.mark.s3
def test_eviction_under_two_workers_sharing_one_local_dir(tmp_path, remote, s3):
    """In stream order each block is worth copying once it comes up: the copies turn over
    (Belady evicts blocks already read), with two worker processes and the main process sharing
    the directory, under the limit at every batch, and the samples stay exact."""
    url, local, cache_bytes = remote
    limit = cache_bytes // 4
    copies = tmp_path / "copies"
    # lookahead: less than an epoch (as in real training), so blocks already read are not needed
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=limit,
                          lookahead=512)
    got, largest = epoch(tc.TokenDataset(cache, SEQ), workers=2, shuffle=False, watch=copies)
    want, _ = epoch(tc.TokenDataset(local, SEQ), workers=0, shuffle=False)
    assert same(got, want)
    assert largest <= limit
    stats = cache.stats()
    assert stats["evictions"] >= 1 and stats["whole_block_bytes"] > limit, stats
    assert stats["bytes_downloaded"] <= 3 * cache_bytes, stats


@pytest.mark.s3
def test_persistent_workers_follow_the_stream_into_the_next_epoch(tmp_path, remote, s3):
    """Persistent workers keep the plan they were started with: the stream goes on, so epoch 2
    is still planned (read ahead), and exact."""
    url, local, cache_bytes = remote
    copies = tmp_path / "copies"
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=cache_bytes // 4)

    def two_epochs(ds, workers):
        loader = tc.DataLoader(ds, batch_size=8, sampler=tc.DistributedSampler(ds, seed=4),
                               num_workers=workers, persistent_workers=workers > 0)
        return [[b["input_ids"] for b in loader] for _ in range(2)]
    got = two_epochs(tc.TokenDataset(cache, SEQ), 2)
    want = two_epochs(tc.TokenDataset(local, SEQ), 0)
    assert same(got[0], want[0]) and same(got[1], want[1]) and not same(got[0], got[1])
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == sum(len(b) for e in got for b in e)
    assert stats["prefetched"] > stats["misses"] // 2, stats  # most remote reads were ahead
    assert tree_bytes(copies) <= cache_bytes // 4


@pytest.mark.s3
def test_reads_without_a_plan_are_exact_and_bounded(tmp_path, remote, s3):
    """Plain reads (no sampler): ranged reads and copies evicted least recently used first."""
    url, local, _ = remote
    ref = tc.TokenCache(local)
    limit = 3 * 4_100
    copies = tmp_path / "copies"
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=limit)
    rng = np.random.default_rng(0)
    for _ in range(60):
        start = int(rng.integers(0, ref.num_tokens - 500))
        stop = start + int(rng.integers(1, 500))
        assert np.array_equal(cache.read(start, stop), ref.read(start, stop))
        assert tree_bytes(copies) <= limit
    starts = rng.integers(0, ref.num_tokens - 65, size=40)
    assert np.array_equal(cache.read_many(starts, 65), ref.read_many(starts, 65))
    for i in (0, 5, ref.num_documents - 1):  # offsets are read into memory, never copied
        assert np.array_equal(cache.document(i), ref.document(i))
    assert not [p for p in copies.rglob("*") if "offsets" in p.name]
    assert tree_bytes(copies) <= limit


@pytest.mark.s3
def test_plan_reads_fetches_ahead(tmp_path, remote, s3):
    url, local, _ = remote
    ref = tc.TokenCache(local)
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=1, readahead=16)  # no block fits: every read is ranged
    starts = np.random.default_rng(1).choice(ref.num_tokens - 100, size=64, replace=False)
    cache.plan_reads(starts, length=100)
    for i in range(0, 64, 8):
        assert np.array_equal(cache.read_many(starts[i:i + 8], 100), ref.read_many(starts[i:i + 8], 100))
    stats = cache.stats()
    assert stats["whole_block_downloads"] == 0 and stats["hits"] == 0 and stats["local_bytes"] == 0
    assert stats["prefetched"] == 56  # every batch after the first was fetched ahead
    with pytest.raises(TypeError, match="length"):
        cache.plan_reads(starts)


@pytest.mark.s3
def test_ranged_reads_are_made_block_by_block(tmp_path, remote, s3):
    """A batch read by range asks for each block's run of touching ranges once (not once per
    range), and a range crossing blocks once per block."""
    url, local, _ = remote
    ref = tc.TokenCache(local)
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit=1, readahead=0)  # no block fits: every read is ranged
    edges = ref.block_token_starts()
    windows = int(edges[2]) + np.arange(6) * SEQ  # 6 windows of SEQ + 1 tokens: each touches the next
    across = int(edges[5]) - 10  # 20 tokens: the end of block 4, the start of block 5
    starts, lengths = np.r_[windows, across], np.r_[np.full(6, SEQ + 1), 20]
    assert np.array_equal(cache.read_ranges(starts, lengths), ref.read_ranges(starts, lengths))
    before = cache.stats()  # (the first reads of a block verify it whole, once per machine)
    assert np.array_equal(cache.read_ranges(starts, lengths), ref.read_ranges(starts, lengths))
    after = cache.stats()
    assert after["ranged_reads"] - before["ranged_reads"] == 3  # blocks 2, 4 and 5
    assert after["ranged_bytes"] - before["ranged_bytes"] == (6 * SEQ + 1 + 20) * ref.dtype.itemsize
    assert after["misses"] - before["misses"] == 7 and after["hits"] == 0


@pytest.mark.s3
def test_resumed_loader_follows_the_new_position(tmp_path, remote, s3):
    url, local, _ = remote
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"),
                          cache_limit="12KB")
    ds, ref = tc.TokenDataset(cache, SEQ), tc.TokenDataset(local, SEQ)

    def loader(d):
        return tc.DataLoader(d, batch_size=8, sampler=tc.DistributedSampler(d, seed=5))
    first = loader(ds)
    it = iter(first)
    for _ in range(30):
        next(it)
    state = first.state_dict()
    resumed, expected = loader(ds), loader(ref)
    resumed.load_state_dict(state)
    expected.load_state_dict(state)
    assert same([b["input_ids"] for b in resumed], [b["input_ids"] for b in expected])
    assert cache.stats()["prefetched"] > 0


_HOLDER = """
import json, sys
import torchcache as tc
url, options, local_dir, limit, stop = json.loads(sys.argv[1])
cache = tc.TokenCache(url, storage_options=options, local_dir=local_dir, cache_limit=limit)
cache.read(0, stop)  # block 0: copied (there is room) and now open, so locked shared
print("holding", flush=True)
sys.stdin.readline()
"""


@pytest.mark.s3
def test_a_block_in_use_is_never_evicted(tmp_path, remote, s3):
    url, local, _ = remote
    ref = tc.TokenCache(local)
    starts = ref.block_token_starts()
    size0 = os.path.getsize(os.path.join(local, "blocks", "000000-000000.safetensors"))
    local_dir = tmp_path / "copies"
    limit = size0 + 100  # room for block 0 only
    args = json.dumps([url, s3, str(local_dir), limit, int(starts[1])])
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, args], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        cache = tc.TokenCache(url, storage_options=s3, local_dir=str(local_dir), cache_limit=limit)
        copy0 = local_dir / cache.fingerprint / copy_name(BLOCK0, ref.block_table.checksum(0))
        assert copy0.exists()
        # block 1 needs room; the only copy is in use in the other process: read by range
        b1 = (int(starts[1]), int(starts[2]))
        assert np.array_equal(cache.read(*b1), ref.read(*b1))  # verified once (not kept)...
        assert np.array_equal(cache.read(*b1), ref.read(*b1))  # ...then read by range
        assert cache.stats()["refused_copies"] >= 1 and cache.stats()["ranged_reads"] >= 1
        assert copy0.exists() and tree_bytes(local_dir) <= limit
        # an explicit eviction skips it too
        assert cache.evict(0) == 0 and copy0.exists()
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
        # once nobody holds it, it can go
        assert cache.evict(0) == size0 and not copy0.exists()
        b2 = (int(starts[2]), int(starts[3]))
        assert np.array_equal(cache.read(*b2), ref.read(*b2))  # there is room now: copied
        assert cache.stats()["whole_block_downloads"] == 1 and tree_bytes(local_dir) <= limit
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.s3
def test_damaged_remote_blocks_are_reported_with_their_url(tmp_path, remote, s3):
    """A whole-block copy is still verified by checksum (retried, then reported); a ranged read
    of a missing file names it too."""
    import s3fs
    url, local, _ = remote
    fs = s3fs.S3FileSystem(**s3)
    fs.put(local, "bucket/damaged", recursive=True)
    bad = "blocks/000000-000000.safetensors"  # block 0 of the stream
    data = bytearray(fs.cat_file(f"bucket/damaged/{bad}"))
    data[-3] ^= 0xFF
    fs.pipe_file(f"bucket/damaged/{bad}", bytes(data))
    damaged = "s3://bucket/damaged"
    cache = tc.TokenCache(damaged, storage_options=s3, local_dir=str(tmp_path / "a"),
                          cache_limit="1MB")  # room: block 0 is copied whole, and checked
    with pytest.raises(tc.CacheFormatError, match=f"{damaged}/{bad}: download failed 3 times.*checksum"):
        cache.read(0, 10)
    assert not [p for p in (tmp_path / "a").rglob("*")
                if p.is_file() and p.name != ".copies.lock" and STATS_DIR not in p.parts]

    starts = tc.TokenCache(local).block_token_starts()
    missing = "blocks/000001-000000.safetensors"  # block 1 of the stream
    fs.rm_file(f"bucket/damaged/{missing}")
    ranged = tc.TokenCache(damaged, storage_options=s3, local_dir=str(tmp_path / "b"),
                           cache_limit=1)  # nothing fits: ranged reads only
    with pytest.raises(tc.CacheFormatError, match=f"{damaged}/{missing}: missing from the remote cache"):
        ranged.read(int(starts[1]), int(starts[1]) + 10)


@pytest.mark.s3
def test_without_a_limit_every_block_read_is_copied_and_counted(tmp_path, remote, s3):
    url, local, _ = remote
    ref = tc.TokenCache(local)
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "copies"))
    stop = int(ref.block_token_starts()[3])
    assert np.array_equal(cache.read(0, stop), ref.read(0, stop))
    stats = cache.stats()
    copied = [p for p in (tmp_path / "copies").rglob("*")  # named by content (checksum)
              if re.fullmatch(r"\d{6}-\d{6}\.safetensors\.[0-9a-f]{64}", p.name)]
    assert stats["whole_block_downloads"] == len(copied) == 3 and stats["ranged_reads"] == 0
    assert stats["bytes_downloaded"] == sum(p.stat().st_size for p in copied)
    assert stats["cache_limit"] is None and stats["local_bytes"] == stats["bytes_downloaded"]


@pytest.mark.slow
@pytest.mark.s3
def test_packed_rows_of_a_remote_cache_under_a_limit(tmp_path, remote, s3):
    """A PackedDataset over a remote cache: the plan is stored beside the local copies (outside
    the copy folder and its limit) and the rows equal those of the same cache read locally."""
    url, local, _ = remote
    limit = 4 * 4_100
    copies = tmp_path / "copies"
    cache = tc.TokenCache(url, storage_options=s3, local_dir=str(copies), cache_limit=limit)
    packed = tc.PackedDataset(cache, 64)
    reference = tc.PackedDataset(local, 64, plan_dir=tmp_path / "plans")
    assert len(packed) == len(reference) and packed.fingerprint == reference.fingerprint
    assert os.path.isdir(cache.root + ".packs") and not (copies / "packs").exists()
    rows = np.random.default_rng(0).permutation(len(packed))[:48]
    got, want = packed.get_batch(rows), reference.get_batch(rows)
    assert all(torch.equal(got[key], want[key]) for key in want)
    assert tree_bytes(cache.root) <= limit
