"""Format v2: commits are appends (head.json + binary block index + commit log), v1 caches stay
readable and upgrade in place, and a damaged v2 file is an error naming it.

Builds here use 3 records per index/log chunk (the test hook `hooks.chunk_records`, recorded in
each cache's manifest), so a few blocks cross several chunk boundaries.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import torchcache as tc
import torchcache.format.ledger as ledger
from torchcache._util import hooks
from conftest import as_format_v1, build_killed_at_commit, paragraphs, tree_bytes, write_jsonl
from torchcache.format.storage import LocalStorage

BLOCK = 2_000
CHUNK = 3


@pytest.fixture(autouse=True, scope="module")
def small_chunks():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hooks, "chunk_records", CHUNK)  # child processes get it too
        yield


@pytest.fixture(scope="module")
def shards(tmp_path_factory, books) -> list[str]:
    """The module's inputs (conftest's three shards), written once: every build here reads them."""
    docs = paragraphs(books)
    d = tmp_path_factory.mktemp("in")
    return [write_jsonl(d / f"part-{i}.jsonl", docs[i::3]) for i in range(3)]


def _build(shards, out, tokenizer, **options):
    options = {"block_tokens": BLOCK, "progress": False, **options}
    return tc.build_cache(shards, out, tokenizer, **options)


@pytest.fixture(scope="module")
def built(tmp_path_factory, shards, gpt2_tokenizer_path):
    """The complete v2 cache of `shards` (tests copy it before changing anything)."""
    result = _build(shards, tmp_path_factory.mktemp("built") / "c", gpt2_tokenizer_path,
                    num_workers=2)
    return Path(result.path)


def _tokens(root) -> np.ndarray:
    cache = tc.TokenCache(root)
    return cache.read(0, cache.num_tokens)


# ---------------------------------------------------------------- the layout

def test_a_v2_cache_keeps_its_blocks_in_a_chunked_binary_index(built):
    manifest = json.loads((built / "manifest.json").read_text())
    head = json.loads((built / "head.json").read_text())
    assert manifest["version"] == 2 and manifest["chunk_records"] == CHUNK
    assert "blocks" not in manifest and head["complete"] and head["blocks"] > 2 * CHUNK
    chunks = sorted(os.listdir(built / "index"))
    assert len(chunks) == -(-head["blocks"] // CHUNK)
    sizes = [os.path.getsize(built / "index" / c) for c in chunks]
    assert sizes[:-1] == [CHUNK * ledger.RECORD.itemsize] * (len(chunks) - 1)
    assert not (built / "log").exists()  # a complete cache drops its build log, folder and all
    entries = ledger.read_manifest(str(built))["blocks"]  # as a v1 manifest listed them
    table = ledger.BlockTable.from_entries(entries)
    assert [table.entry(b) for b in range(len(table))] == entries  # 128-byte records lose nothing
    assert tc.verify_cache(built) == []


def test_the_same_build_is_byte_identical_with_any_worker_count(tmp_path, shards, gpt2_tokenizer_path,
                                                                built):
    one = _build(shards, tmp_path / "one", gpt2_tokenizer_path, num_workers=1)
    assert tree_bytes(one.path) == tree_bytes(str(built))  # built by 2 workers


def test_a_complete_v2_cache_reads_the_same_as_its_v1_form(built, tmp_path):
    v1 = Path(shutil.copytree(built, tmp_path / "v1"))
    as_format_v1(v1)
    assert json.loads((v1 / "manifest.json").read_text())["version"] == 1
    a, b = tc.TokenCache(built), tc.TokenCache(v1)
    assert (a.fingerprint, a.num_blocks, a.num_documents) == (b.fingerprint, b.num_blocks, b.num_documents)
    assert np.array_equal(a.read(0, a.num_tokens), b.read(0, b.num_tokens))
    assert np.array_equal(a.block_token_starts(), b.block_token_starts())
    assert tc.verify_cache(v1) == []


def test_a_loader_state_saved_on_a_v1_cache_loads_after_the_upgrade(built, tmp_path):
    v1 = Path(shutil.copytree(built, tmp_path / "v1"))
    as_format_v1(v1)
    ds = tc.TokenDataset(v1, seq_len=64)
    loader = tc.DataLoader(ds, batch_size=4, shuffle=True, seed=3)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    expected = next(batches)["input_ids"]
    done = subprocess.run([sys.executable, "-m", "torchcache", "upgrade", str(v1)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "upgraded to format v2" in done.stdout, done.stderr
    resumed = tc.DataLoader(tc.TokenDataset(v1, seq_len=64), batch_size=4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    assert np.array_equal(next(iter(resumed))["input_ids"], expected)


def test_upgrade_gives_the_bytes_of_a_v2_build_and_is_idempotent(built, tmp_path):
    v1 = Path(shutil.copytree(built, tmp_path / "v1"))
    as_format_v1(v1)
    assert ledger.upgrade(LocalStorage(str(v1)))
    assert tree_bytes(str(v1)) == tree_bytes(str(built))
    done = subprocess.run([sys.executable, "-m", "torchcache", "upgrade", str(v1)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "already in format v2" in done.stdout
    assert tree_bytes(str(v1)) == tree_bytes(str(built))


def test_an_interrupted_upgrade_leaves_a_readable_v1_cache_and_can_be_rerun(built, tmp_path, monkeypatch):
    v1 = Path(shutil.copytree(built, tmp_path / "v1"))
    as_format_v1(v1)
    storage = LocalStorage(str(v1))
    real_write = LocalStorage.write

    def crash_at_the_switch(self, rel, parts):
        if rel == "manifest.json":
            raise OSError(28, "No space left on device", rel)
        return real_write(self, rel, parts)

    monkeypatch.setattr(LocalStorage, "write", crash_at_the_switch)
    with pytest.raises(OSError):
        ledger.upgrade(storage)
    monkeypatch.setattr(LocalStorage, "write", real_write)
    assert json.loads((v1 / "manifest.json").read_text())["version"] == 1
    assert np.array_equal(_tokens(v1), _tokens(built)) and tc.verify_cache(v1) == []
    assert ledger.upgrade(storage)
    assert tree_bytes(str(v1)) == tree_bytes(str(built))


@pytest.mark.slow
def test_resuming_an_interrupted_v1_build_upgrades_it_and_ends_identical(tmp_path, shards,
                                                                         gpt2_tokenizer_path, built):
    reference = tc.TokenCache(built)  # the same bytes as a 1-worker build
    out = tmp_path / "old"
    assert build_killed_at_commit(shards, out, gpt2_tokenizer_path, 6, block_tokens=BLOCK) == -9
    as_format_v1(out)  # as if an older torchcache had been killed there
    partial = json.loads((out / "manifest.json").read_text())
    assert partial["version"] == 1 and not partial["complete"] and partial["blocks"]
    result = _build(shards, out, gpt2_tokenizer_path, num_workers=2)
    assert 0 < result.tokens_built < reference.num_tokens  # resumed, not rebuilt
    assert tree_bytes(str(out)) == tree_bytes(str(built))


# ---------------------------------------------------------------- crashes and growing caches

@pytest.mark.slow
def test_kill_9_at_commits_across_chunk_boundaries_then_resume_is_byte_identical(
        tmp_path, shards, gpt2_tokenizer_path, built):
    out = tmp_path / "killed"
    seen = 0
    for commits in (4, 5, 4):  # each run resumes the previous one (inline: deterministic commits)
        assert build_killed_at_commit(shards, out, gpt2_tokenizer_path, commits,
                                      block_tokens=BLOCK) == -signal.SIGKILL
        manifest = ledger.read_manifest(str(out))  # every kill left a valid, growing cache
        assert not manifest["complete"]
        finished = len(manifest["blocks"]) + len(manifest["pending"])
        assert finished > seen
        seen = finished
        cache = tc.TokenCache(out)
        assert np.array_equal(cache.read(0, cache.num_tokens), _tokens(str(built))[: cache.num_tokens])
    _build(shards, out, gpt2_tokenizer_path, num_workers=2)
    assert tree_bytes(str(out)) == tree_bytes(str(built))


@pytest.mark.slow
def test_a_reader_follows_a_growing_cache_reading_only_new_commits(tmp_path, shards,
                                                                   gpt2_tokenizer_path, built):
    """Once a reader has the first index chunks, refresh() never reads them again: it works with
    them removed. (They are put back before the build resumes, which reads its whole record.)"""
    full = _tokens(str(built))
    out = tmp_path / "growing"
    # inline builds commit one event at a time: the same commits, in the same order, every run
    assert build_killed_at_commit(shards, out, gpt2_tokenizer_path, 8, block_tokens=BLOCK) == -9
    cache = tc.TokenCache(out)
    sizes = [cache.num_blocks]
    aside = tmp_path / "aside"
    aside.mkdir()
    hidden = 0
    while not cache.complete:
        read_already = sorted(os.listdir(out / "index"))[: cache.num_blocks // CHUNK]  # full chunks
        code = build_killed_at_commit(shards, out, gpt2_tokenizer_path, 3, block_tokens=BLOCK)
        assert code in (0, -signal.SIGKILL)
        for name in read_already:
            shutil.move(out / "index" / name, aside / name)
        cache.refresh()
        for name in read_already:
            shutil.move(aside / name, out / "index" / name)
        hidden += len(read_already)
        sizes.append(cache.num_blocks)
        assert np.array_equal(cache.read(0, cache.num_tokens), full[: cache.num_tokens])
        assert code == -signal.SIGKILL or cache.complete  # (a kill can follow the last commit)
    assert len(sizes) >= 3 and sizes == sorted(sizes) and 0 < sizes[0]
    assert sizes[-1] == tc.TokenCache(str(built)).num_blocks > 3 * CHUNK
    assert hidden > 0, "refresh() was never tested without the chunks it had read"
    assert tree_bytes(str(out)) == tree_bytes(str(built))


# ---------------------------------------------------------------- damaged v2 files

def _head(root) -> dict:
    return json.loads((root / "head.json").read_text())


def _set_head(root, **changes) -> None:
    (root / "head.json").write_text(json.dumps({**_head(root), **changes}))


def _damage_index(root, block: int, field: str, value) -> None:
    path = root / "index" / f"{block // CHUNK:06d}.bin"
    records = np.fromfile(path, dtype=ledger.RECORD)
    records[block % CHUNK][field] = value
    records.tofile(path)


def _swap_index(root, a: int, b: int) -> None:
    pa, pb = (root / "index" / f"{k // CHUNK:06d}.bin" for k in (a, b))
    ra, rb = np.fromfile(pa, dtype=ledger.RECORD), np.fromfile(pb, dtype=ledger.RECORD)
    ra[a % CHUNK], rb[b % CHUNK] = rb[b % CHUNK].copy(), ra[a % CHUNK].copy()
    ra.tofile(pa)
    if pb != pa:
        rb.tofile(pb)


DAMAGE = {
    "head not json": (lambda r: (r / "head.json").write_text("{"), "head.json", "not valid JSON"),
    "head of another cache": (lambda r: _set_head(r, fingerprint="0" * 32), "head.json", "fingerprint"),
    "head counts more blocks": (lambda r: _set_head(r, blocks=_head(r)["blocks"] + 1), "index",
                                "head.json (says|counts)"),
    "head totals": (lambda r: _set_head(r, num_tokens=_head(r)["num_tokens"] + 1), "head.json",
                    "num_tokens"),
    "head blocks negative": (lambda r: _set_head(r, blocks=-1), "head.json", "blocks must be a count"),
    "index chunk missing": (lambda r: os.unlink(r / "index" / "000001.bin"), "000001.bin", "missing"),
    "index truncated": (lambda r: os.truncate(r / "index" / "000000.bin", 200), "000000.bin",
                        "shorter than head.json says"),
    "record input out of range": (lambda r: _damage_index(r, 4, "input", 7), "index",
                                  "block 4 names an input the spec lacks"),
    "record tokens negative": (lambda r: _damage_index(r, 2, "num_tokens", -5), "index",
                               "block 2 has an invalid token count"),
    "records swapped": (lambda r: _swap_index(r, 1, 4), "index", "out of stream order"),
    "chunk size": (lambda r: (r / "manifest.json").write_text(json.dumps(
        {**json.loads((r / "manifest.json").read_text()), "chunk_records": 0})), "manifest.json",
        "chunk_records"),
}


CLI_CHECKED = ("head not json", "records swapped", "chunk size")


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_a_damaged_v2_file_is_an_error_naming_it(built, tmp_path, name):
    root = Path(shutil.copytree(built, tmp_path / name.replace(" ", "_")))
    damage, file, message = DAMAGE[name]
    damage(root)
    with pytest.raises(tc.CacheFormatError, match=message) as info:
        tc.TokenCache(root)
    assert file in str(info.value)
    problems = tc.check_cache(root)
    assert problems and file in problems[0].message
    if name in CLI_CHECKED:  # the command line reports what check_cache does (a subprocess each)
        cli = subprocess.run([sys.executable, "-m", "torchcache", "verify", str(root)],
                             capture_output=True, text=True, timeout=120)
        assert cli.returncode == 1 and file in cli.stderr and "Traceback" not in cli.stderr


def test_a_damaged_commit_log_of_an_interrupted_build_is_reported(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "partial"
    assert build_killed_at_commit(shards, out, gpt2_tokenizer_path, 7, block_tokens=BLOCK) == -9
    assert tc.verify_cache(out) == []
    log = out / "log" / "000001.jsonl"
    lines = log.read_bytes().split(b"\n")
    record = json.loads(lines[0])
    record["entry"]["num_documents"] = "many"
    log.write_bytes(b"\n".join([json.dumps(record).encode()] + lines[1:]))
    problems = tc.verify_cache(out)
    assert problems and f"{out}/log: record {CHUNK}.entry.num_documents" in problems[0]
    with pytest.raises(tc.CacheFormatError, match="num_documents"):
        _build(shards, out, gpt2_tokenizer_path)
    assert tc.TokenCache(out).num_blocks > 0  # readers do not need the log
