"""Reader promises: token ranges, documents, integrity errors, safe paths, small pickles; the CLI."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
from conftest import as_format_v1, paragraphs, write_jsonl

import torchcache as tc
from torchcache.format.blocks import MANIFEST_NAME
from torchcache.format.ledger import read_manifest


@pytest.fixture()
def cache_dir(tmp_path, books, gpt2_tokenizer_path):
    docs = paragraphs(books, 600)
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    tc.build_cache(src, tmp_path / "cache", gpt2_tokenizer_path, block_tokens=1_500, progress=False)
    return tmp_path / "cache", docs


def test_read_ranges_cross_blocks_and_match_documents(cache_dir, gpt2):
    root, docs = cache_dir
    cache = tc.TokenCache(root)
    assert cache.num_blocks > 10
    everything = np.concatenate([cache.document(i) for i in range(cache.num_documents)])
    assert len(everything) == cache.num_tokens
    assert np.array_equal(cache.read(0, cache.num_tokens), everything)
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = sorted(rng.integers(0, cache.num_tokens + 1, size=2))
        assert np.array_equal(cache.read(a, b), everything[a:b])
    starts = cache.document_starts_in(0, cache.num_tokens)
    assert starts.tolist() == [cache.document_span(i)[0] for i in range(1, cache.num_documents)]
    for i in (0, 17, cache.num_documents - 1):
        assert gpt2.decode(cache.document(i)[:-1].tolist()) == docs[i]
    with pytest.raises(IndexError):
        cache.read(0, cache.num_tokens + 1)
    with pytest.raises(IndexError):
        cache.document(cache.num_documents)


def test_one_gather_serves_ranges_rows_and_spans(cache_dir):
    """read_ranges (the gather every read goes through): ranges of any length, crossing blocks,
    empty ones (even at the very end), packed where out_offsets says; read_many is its equal
    rows. Checked against the whole stream, with maps and with pread."""
    root, _ = cache_dir
    for cache in (tc.TokenCache(root), tc.TokenCache(root, map_bytes=0)):
        n = cache.num_tokens
        everything = cache.read(0, n)
        rng = np.random.default_rng(1)
        starts = rng.integers(0, n - 4000, 300)
        lengths = rng.integers(0, 4000, 300)  # many cross one or more blocks (1,500 tokens)
        starts[:2], lengths[:2] = n, 0  # empty, at the very end
        flat = cache.read_ranges(starts, lengths)
        assert np.array_equal(flat, np.concatenate([everything[s:s + k] for s, k in zip(starts, lengths)]))
        gaps = np.cumsum(lengths + 3) - lengths  # 3 tokens left alone before each range
        out = np.full(int(gaps[-1] + lengths[-1]), 7, dtype=cache.dtype)
        assert cache.read_ranges(starts, lengths, out, gaps) is out
        for s, k, at in zip(starts, lengths, gaps):
            assert np.array_equal(out[at:at + k], everything[s:s + k]) and (out[at - 3:at] == 7).all()
        rows = cache.read_many(starts[2:], 700)
        assert rows.shape == (298, 700)
        assert all(np.array_equal(r, everything[s:s + 700]) for s, r in zip(starts[2:], rows))
        assert cache.read_ranges([], []).shape == (0,)
        for call, error, match in [
            (lambda: cache.read_ranges([0, 1], [1]), ValueError, "lengths"),
            (lambda: cache.read_ranges([0.5], [1]), TypeError, "starts"),
            (lambda: cache.read_ranges([0], [-1]), IndexError, "token range"),
            (lambda: cache.read_ranges([n - 1], [2]), IndexError, "token range"),
            (lambda: cache.read_ranges([0], [5], np.empty(4, cache.dtype)), IndexError, "out"),
            (lambda: cache.read_ranges([0], [5], np.empty(5, np.int64)), ValueError, "out"),
            (lambda: cache.read_ranges([0], [5], None, [0, 1]), ValueError, "out_offsets"),
            (lambda: cache.read(0, 5, out=np.empty(4, cache.dtype)), ValueError, "out"),
        ]:
            with pytest.raises(error, match=match):
                call()
        cache.close()


def test_pickle_is_small_and_works_after_fork(cache_dir):
    root, _ = cache_dir
    cache = tc.TokenCache(root)
    cache.read(0, 5000)  # opens files; they must not travel
    blob = pickle.dumps(cache)
    assert len(blob) < 16_000
    clone = pickle.loads(blob)
    assert np.array_equal(clone.read(100, 4000), cache.read(100, 4000))


def _flip_byte(path, offset_from_end=10):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupted_block_is_reported_by_verify_and_reader(cache_dir):
    root, _ = cache_dir
    manifest = read_manifest(str(root))
    bad = root / manifest["blocks"][3]["path"]
    assert tc.verify_cache(root) == []
    _flip_byte(bad)
    problems = tc.verify_cache(root)
    assert len(problems) == 1 and str(bad) in problems[0] and "checksum" in problems[0]
    cli = subprocess.run([sys.executable, "-m", "torchcache", "verify", str(root)],
                         capture_output=True, text=True)
    assert cli.returncode == 1 and str(bad) in cli.stderr
    with pytest.raises(tc.CacheFormatError, match=str(bad)):
        tc.TokenCache(root, verify_checksums=True).read(0, tc.TokenCache(root).num_tokens)


def test_truncated_block_is_reported_by_reader_and_verify(cache_dir):
    root, _ = cache_dir
    manifest = read_manifest(str(root))
    bad = root / manifest["blocks"][2]["path"]
    bad.write_bytes(bad.read_bytes()[:-100])
    cache = tc.TokenCache(root)
    with pytest.raises(tc.CacheFormatError, match=f"{bad}.*truncated"):
        cache.read(0, cache.num_tokens)
    problems = tc.verify_cache(root)
    assert any(str(bad) in p for p in problems)
    side = root / manifest["blocks"][5]["offsets"]
    side.write_bytes(side.read_bytes()[:20])
    with pytest.raises(tc.CacheFormatError, match=str(side)):
        tc.TokenCache(root).block_offsets(5)


def test_a_block_changed_after_it_was_checked_is_refused_when_reopened(cache_dir, tmp_path):
    """Blocks checked once are reopened cheaply (path and size only); a block truncated, or
    replaced by a symlink, after that is still refused with the full check's error."""
    root, _ = cache_dir
    manifest = read_manifest(str(root))
    cache = tc.TokenCache(root)
    everything = cache.read(0, cache.num_tokens)  # every block opened and checked
    cache.close()  # their descriptors closed: the next reads reopen them
    assert np.array_equal(cache.read(0, cache.num_tokens), everything)
    cache.close()
    bad = root / manifest["blocks"][3]["path"]
    data = bad.read_bytes()
    bad.write_bytes(data[:-64])
    with pytest.raises(tc.CacheFormatError, match=f"{bad}.*truncated"):
        cache.read(0, cache.num_tokens)
    cache.close()
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(data)
    bad.unlink()
    bad.symlink_to(outside)
    with pytest.raises(tc.CacheFormatError, match="outside the cache"):
        cache.read(0, cache.num_tokens)


def test_manifest_paths_outside_the_cache_are_refused(cache_dir):
    """(A v1 manifest names its files; v2 derives every name from input and block numbers.)"""
    root, _ = cache_dir
    as_format_v1(root)
    manifest = json.loads((root / MANIFEST_NAME).read_text())
    for evil in ("../outside.safetensors", "/etc/passwd", "blocks/../../x", "s3://bucket/x"):
        manifest["blocks"][0]["path"] = evil
        (root / MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(tc.CacheFormatError, match="path"):
            tc.TokenCache(root)


def test_unknown_format_version_is_refused(cache_dir):
    root, _ = cache_dir
    manifest = read_manifest(str(root))
    manifest["version"] = 99
    (root / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(tc.CacheFormatError, match="version 99"):
        tc.TokenCache(root)
    with pytest.raises(FileNotFoundError, match="not a torchcache cache"):
        tc.TokenCache(root / "blocks")


def test_block_files_are_standard_safetensors(cache_dir):
    from safetensors.numpy import load_file
    root, _ = cache_dir
    cache = tc.TokenCache(root)
    manifest = read_manifest(str(root))
    entry = manifest["blocks"][1]
    tokens = load_file(str(root / entry["path"]))["tokens"]
    offsets = load_file(str(root / entry["offsets"]))["offsets"]
    assert tokens.dtype == np.uint16 and offsets.dtype == np.int64
    assert offsets[0] == 0 and offsets[-1] == len(tokens) == entry["num_tokens"]
    start = int(cache.block_token_starts()[1])
    assert np.array_equal(tokens, cache.read(start, start + len(tokens)))


@pytest.mark.slow
def test_cli_build_info_show_verify(tmp_path, books, gpt2_tokenizer_path):
    docs = paragraphs(books, 50)
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    out = tmp_path / "c"
    run = lambda *a: subprocess.run([sys.executable, "-m", "torchcache", *a], capture_output=True,
                                    text=True)
    built = run("build", src, "-o", str(out), "-t", gpt2_tokenizer_path, "--block-tokens", "500")
    assert built.returncode == 0, built.stderr
    assert "50 documents" in built.stdout and "tokenizing" in built.stderr  # progress bar
    assert "nothing to do" in run("build", src, "-o", str(out), "-t", gpt2_tokenizer_path,
                                  "--block-tokens", "500").stdout
    info = run("info", str(out), "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["documents"] == 50
    assert "doc length" in run("info", str(out)).stdout
    shown = run("show", str(out), "--document", "7")
    assert shown.stdout.startswith(docs[7]) and "<|endoftext|>" in shown.stdout
    assert run("verify", str(out)).returncode == 0
    bad = run("build", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "x"), "-t",
              gpt2_tokenizer_path)
    assert bad.returncode == 2 and "missing.jsonl" in bad.stderr and "Traceback" not in bad.stderr
