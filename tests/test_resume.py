"""Crash safety: kill -9 and resume, readers during a background build, bad input handling."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import time

import numpy as np
import pytest
from conftest import build_killed_at_commit, paragraphs, tree_bytes, write_jsonl

import torchcache as tc
from torchcache.format.blocks import file_checksum
from torchcache.format.ledger import read_manifest

BLOCK = 2_000


@pytest.fixture(scope="module")
def big_shards(tmp_path_factory, books):
    """Four real shards, about 300 K tokens: slow enough to be interrupted mid-way (read only)."""
    docs = paragraphs(books)
    d = tmp_path_factory.mktemp("in")
    return [write_jsonl(d / f"s{i}.jsonl", docs[i % 2::2] + docs[: 500 * (i + 1)]) for i in range(4)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, big_shards, gpt2_tokenizer_path):
    """The uninterrupted one-worker build of `big_shards` that the interrupted ones must equal
    byte for byte (read only: tests compare against it, none writes to it)."""
    return tc.build_cache(big_shards, tmp_path_factory.mktemp("ref") / "cache", gpt2_tokenizer_path,
                          block_tokens=BLOCK, num_workers=1, progress=False)


def _committed(root: str) -> list[dict]:
    try:
        manifest = read_manifest(root)
    except (FileNotFoundError, ValueError):
        return []
    return manifest["blocks"] + manifest["pending"]


def _stamps(root: str, entries: list[dict]) -> dict[str, tuple[int, int]]:
    out = {}
    for e in entries:
        for rel in (e["path"], e["offsets"]):
            st = os.stat(os.path.join(root, rel))
            out[rel] = (st.st_ino, st.st_mtime_ns)
    return out


@pytest.mark.slow
def test_kill_9_at_several_points_then_resume_gives_the_same_cache(tmp_path, big_shards, reference,
                                                                     gpt2_tokenizer_path):
    assert reference.num_blocks > 60
    out = str(tmp_path / "killed")
    previous: dict = {}
    count = 0
    # killed after the 2nd manifest write of a fresh build, then after the 9th and the 6th of two
    # resumed ones (one inline, one with a pool of 2 workers)
    for commits, workers in ((2, 2), (9, 1), (6, 2)):
        code = build_killed_at_commit(big_shards, out, gpt2_tokenizer_path, commits, workers=workers)
        assert code == -signal.SIGKILL, f"the build ended with {code} before its kill point"
        committed = _committed(out)
        assert len(committed) > count, "each run commits new blocks"
        count = len(committed)
        assert not tc.TokenCache(out).complete
        stamps = _stamps(out, committed)
        # work committed by an earlier run is never redone (same inode and mtime) nor lost
        assert {k: stamps.get(k) for k in previous} == previous
        previous = stamps
    result = tc.build_cache(big_shards, out, gpt2_tokenizer_path, block_tokens=BLOCK,
                            num_workers=2, progress=False)
    assert {k: v for k, v in _stamps(out, _committed(out)).items() if k in previous} == previous
    assert 0 < result.tokens_built < reference.num_tokens
    assert tree_bytes(out) == tree_bytes(reference.path)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    assert not [n for n in os.listdir(os.path.join(out, "blocks")) if ".tmp-" in n]


def _stream_hash(cache: tc.TokenCache, num_tokens: int) -> str:
    return hashlib.sha256(cache.read(0, num_tokens).tobytes()).hexdigest()


@pytest.mark.slow
def test_reader_during_background_build_sees_only_complete_blocks(tmp_path, big_shards, reference,
                                                                    gpt2_tokenizer_path):
    """A reader polling a cache while a 2-worker background build grows it: whatever it observes
    (however the timing falls) is complete, checksummed, and a prefix of the final cache."""
    out = tmp_path / "growing"
    handle = tc.build_cache(big_shards, out, gpt2_tokenizer_path, block_tokens=BLOCK,
                            num_workers=2, background=True)
    while not (out / "manifest.json").exists():
        assert not handle.done, handle.error
        time.sleep(0.01)
    cache = tc.TokenCache(out)
    seen = []  # (num_blocks, num_tokens, complete, hash of the tokens read) per observation
    manifests = []  # the manifests the reader found on disk
    while True:
        finished = handle.done
        cache.refresh()
        seen.append((cache.num_blocks, cache.num_tokens, cache.complete,
                     _stream_hash(cache, cache.num_tokens)))
        manifest = read_manifest(str(out))
        for entry in manifest["blocks"] + manifest["pending"]:  # every listed file is complete
            assert file_checksum(str(out / entry["path"])) == entry["checksum"]
            assert file_checksum(str(out / entry["offsets"])) == entry["offsets_checksum"]
        manifests.append(manifest)
        if finished:
            break
        time.sleep(0.01)
    result = handle.wait()
    assert handle.error is None and cache.refresh() is False and cache.complete
    assert cache.num_tokens == result.num_tokens and handle.progress["complete"]
    assert tree_bytes(str(out)) == tree_bytes(reference.path)

    final = tc.TokenCache(reference.path)
    final_blocks = read_manifest(str(out))["blocks"]
    assert seen[-1] == (final.num_blocks, final.num_tokens, True,
                        _stream_hash(final, final.num_tokens))
    for (blocks, tokens, complete, digest), earlier in zip(seen, [(0, 0)] + seen):
        assert (blocks, tokens) >= earlier[:2], "the committed stream never shrinks"
        assert blocks == final.num_blocks or not complete
        assert digest == _stream_hash(final, tokens), "a reader saw tokens the final cache lacks"
    for manifest in manifests:
        # the stream is always a prefix of the final one, and a pending block is already final
        assert manifest["blocks"] == final_blocks[:len(manifest["blocks"])]
        assert all(entry in final_blocks for entry in manifest["pending"])


@pytest.mark.slow
def test_a_reader_follows_a_build_that_grows_in_steps(tmp_path, big_shards, gpt2_tokenizer_path):
    """The build is killed at a commit, resumed, killed again...: between steps the reader's view
    must have grown, hold exactly the final cache's first blocks, and never be complete early."""
    source = big_shards[:1]  # one input: each committed block joins the stream at once
    reference = tc.build_cache(source, tmp_path / "ref", gpt2_tokenizer_path, block_tokens=BLOCK,
                               num_workers=1, progress=False)
    final = tc.TokenCache(reference.path)
    assert final.num_blocks > 20
    out = str(tmp_path / "steps")
    cache, views = None, []  # (blocks, tokens, complete) seen after each step
    while cache is None or not cache.complete:
        code = build_killed_at_commit(source, out, gpt2_tokenizer_path, 8)
        assert code in (0, -signal.SIGKILL), code
        if cache is None:
            cache = tc.TokenCache(out)
        else:
            blocks, tokens, _ = views[-1]
            # until refreshed, the reader keeps its view, still readable (blocks are immutable)
            assert (cache.num_blocks, cache.num_tokens) == (blocks, tokens)
            assert _stream_hash(cache, tokens) == _stream_hash(final, tokens)
            assert cache.refresh() is True
        view = (cache.num_blocks, cache.num_tokens, cache.complete)
        assert not views or view > views[-1], "each step commits something new"
        assert code == -signal.SIGKILL or cache.complete, "a build that ended is complete"
        views.append(view)
        # exactly the final cache's first blocks, documents and tokens
        assert cache.num_tokens == int(final.block_token_starts()[cache.num_blocks])
        assert _stream_hash(cache, cache.num_tokens) == _stream_hash(final, cache.num_tokens)
        last = cache.num_documents - 1
        assert np.array_equal(cache.document(last), final.document(last))
    assert len(views) >= 3 and 0 < views[0][0] < views[1][0] < final.num_blocks, views
    assert views[-1] == (final.num_blocks, final.num_tokens, True)
    assert tree_bytes(out) == tree_bytes(reference.path)


@pytest.mark.slow
def test_cancel_keeps_committed_blocks_and_resumes(tmp_path, big_shards, reference, gpt2_tokenizer_path):
    out = tmp_path / "c"
    handle = tc.build_cache(big_shards, out, gpt2_tokenizer_path, block_tokens=BLOCK,
                            num_workers=2, background=True)
    while len(_committed(str(out))) < 3 and not handle.done:
        time.sleep(0.005)
    handle.cancel()
    assert handle.done
    if handle.error is not None:
        assert isinstance(handle.error, tc.BuildError)
        with pytest.raises(tc.BuildError):
            handle.wait()
    tc.build_cache(big_shards, out, gpt2_tokenizer_path, block_tokens=BLOCK, progress=False)
    assert tree_bytes(str(out)) == tree_bytes(reference.path)


# ------------------------------------------------------------------ bad input

def _bad_files(tmp_path, books) -> dict[str, tuple[str, str]]:
    """name -> (path, expected error text) for each kind of bad input."""
    good = [json.dumps({"text": t}) for t in paragraphs(books, 40)]
    d = tmp_path / "bad"
    d.mkdir()
    files = {}

    def write(name, lines_or_bytes, expect):
        path = d / name
        data = lines_or_bytes if isinstance(lines_or_bytes, bytes) else \
            ("\n".join(lines_or_bytes) + "\n").encode()
        path.write_bytes(data)
        files[name] = (str(path), expect)

    write("malformed.jsonl", good[:5] + ['{"text": "unterminated'] + good[5:10],
          "malformed.jsonl:6: malformed JSON")
    write("missing.jsonl", good[:3] + ['{"body": "no text key"}'] + good[3:6],
          "missing.jsonl:4: no 'text' field")
    write("utf8.jsonl", ("\n".join(good[:7]) + "\n").encode() + b'{"text": "caf\xe9"}\n',
          "utf8.jsonl:8: invalid UTF-8")
    gz = gzip.compress(("\n".join(good) + "\n").encode())
    write("truncated.jsonl.gz", gz[: len(gz) // 2], "truncated.jsonl.gz: cannot read the gzip stream")
    import zstandard
    zst = zstandard.ZstdCompressor().compress(("\n".join(good) + "\n").encode())
    write("truncated.jsonl.zst", zst[: len(zst) // 2], "truncated.jsonl.zst: cannot read the zstd stream")
    write("empty.jsonl", good[:2] + [json.dumps({"text": ""})], None)
    return files


def test_each_bad_input_names_file_and_line(tmp_path, books, gpt2_tokenizer_path):
    for name, (path, expect) in _bad_files(tmp_path, books).items():
        if expect is None:
            continue
        with pytest.raises(tc.InputError) as info:
            tc.build_cache(path, tmp_path / f"out-{name}", gpt2_tokenizer_path, progress=False)
        assert expect in str(info.value) and "on_error='skip'" in str(info.value), str(info.value)


def test_skip_mode_counts_bad_records_in_the_manifest(tmp_path, books, gpt2_tokenizer_path):
    files = _bad_files(tmp_path, books)
    paths = [p for p, _ in files.values()]
    tc.build_cache(paths, tmp_path / "c", gpt2_tokenizer_path, on_error="skip", progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    assert cache.skipped == {"malformed_json": 1, "missing_text": 1, "invalid_utf8": 1,
                             "unreadable": 2, "empty": 1}
    manifest = read_manifest(str(tmp_path / "c"))
    by_name = {os.path.basename(i["path"]): i["skipped"] for i in manifest["inputs"]}
    assert by_name["malformed.jsonl"] == {"malformed_json": 1}
    # a truncated file keeps at most the records decoded before the damage (a prefix)
    assert 10 + 6 + 7 + 2 <= cache.num_documents <= 10 + 6 + 7 + 2 + _readable_prefix(files)


def _readable_prefix(files) -> int:
    """Documents a skip-mode build keeps from the two truncated files (those before the cut)."""
    import zstandard
    n = 0
    path = files["truncated.jsonl.gz"][0]
    with gzip.open(path, "rb") as f:
        try:
            for _ in f:
                n += 1
        except EOFError:
            pass
    raw = open(files["truncated.jsonl.zst"][0], "rb").read()
    with zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True) as r:
        data = b""
        try:
            while chunk := r.read(1 << 16):
                data += chunk
        except zstandard.ZstdError:
            pass
    return n + data.count(b"\n")


def test_error_keeps_committed_blocks_and_a_fixed_run_resumes(tmp_path, books, gpt2_tokenizer_path):
    docs = [json.dumps({"text": t}) for t in paragraphs(books, 400)]
    good = write_jsonl(tmp_path / "good.jsonl", paragraphs(books, 300))
    bad = tmp_path / "late-error.jsonl"
    bad.write_text("\n".join(docs[:350] + ["not json"] + docs[350:]) + "\n")
    out = tmp_path / "c"
    with pytest.raises(tc.InputError, match="late-error.jsonl:351"):
        tc.build_cache([good, str(bad)], out, gpt2_tokenizer_path, block_tokens=BLOCK,
                       num_workers=1, progress=False)
    kept = _committed(str(out))
    assert len(kept) > 5 and any(e["input"] == 1 for e in kept)
    stamps = _stamps(str(out), kept)
    tc.build_cache([good, str(bad)], out, gpt2_tokenizer_path, block_tokens=BLOCK,
                   on_error="skip", progress=False)
    assert _stamps(str(out), kept) == stamps
    fresh = tc.build_cache([good, str(bad)], tmp_path / "fresh", gpt2_tokenizer_path,
                           block_tokens=BLOCK, on_error="skip", progress=False)
    assert tree_bytes(str(out)) == tree_bytes(fresh.path)
    assert tc.TokenCache(out).skipped == {"malformed_json": 1}
