"""Issue 21, build side: a rebuild never returns a cache of other content, one exception type per
cause whatever the executor, a resumed build never commits a missing block, no empty leftovers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import (build_killed_at_commit, committed_tree, moto_s3, paragraphs, python_with_hooks, tree_bytes,
                      write_jsonl)

import torchcache as tc
import torchcache.builder.engine as engine
from torchcache.errors import InputChangedError, InputError
from torchcache.format.ledger import read_manifest

BLOCK = 2_000


def _build(inputs, out, tokenizer, **kw):
    kw.setdefault("block_tokens", BLOCK)
    kw.setdefault("num_workers", 1)
    return tc.build_cache(inputs, out, tokenizer, progress=False, **kw)


@pytest.fixture()
def texts(books) -> list[str]:
    return paragraphs(books, 300)


def _one_word_changed(texts: list[str]) -> list[str]:
    other = list(texts)
    words = other[150].split(" ")
    words[0] = "Changed" if words[0] != "Changed" else "Altered"
    other[150] = " ".join(words)
    return other


class _Counted:
    """An iterator over texts that counts what was taken from it."""

    def __init__(self, texts: list[str]):
        self.items, self.taken = iter(texts), 0

    def __iter__(self):
        return self

    def __next__(self) -> str:
        item = next(self.items)
        self.taken += 1
        return item


# ---------------------------------------------------------------- item 2: iterables

@pytest.mark.parametrize("change", ["one word", "one more", "one fewer", "reordered"])
def test_an_iterable_rebuilt_with_other_texts_is_refused_and_the_cache_untouched(
        tmp_path, texts, gpt2_tokenizer_path, change):
    out = tmp_path / "c"
    _build(iter(texts), out, gpt2_tokenizer_path)
    before = tree_bytes(str(out))
    other = {"one word": _one_word_changed(texts), "one more": texts + ["one more document"],
             "one fewer": texts[:-1], "reordered": texts[1:] + texts[:1]}[change]
    with pytest.raises(InputChangedError) as info:
        _build(iter(other), out, gpt2_tokenizer_path)
    assert str(out) in str(info.value) and "iterable" in str(info.value)
    assert tree_bytes(str(out)) == before


def test_the_same_iterable_again_is_read_but_neither_tokenized_nor_rewritten(tmp_path, texts,
                                                                            gpt2_tokenizer_path):
    out = tmp_path / "c"
    first = _build(iter(texts), out, gpt2_tokenizer_path)
    before = tree_bytes(str(out))
    stamps = {p: os.stat(out / p).st_mtime_ns for p in before}
    again = _Counted(texts)
    result = _build(again, out, gpt2_tokenizer_path)
    assert result.already_complete and result.tokens_built == 0
    assert result.fingerprint == first.fingerprint and result.num_tokens == first.num_tokens
    assert again.taken == len(texts)  # the whole stream was read and digested
    assert tree_bytes(str(out)) == before
    assert {p: os.stat(out / p).st_mtime_ns for p in before} == stamps


_ITERABLE_BUILD = """
import torchcache as tc
texts = json.loads(open(sys.argv[1], encoding="utf-8").read())
tc.build_cache(iter(texts), sys.argv[2], sys.argv[3], block_tokens={block}, progress=False)
"""


def test_an_interrupted_iterable_build_resumed_with_other_texts_is_refused(tmp_path, texts,
                                                                           gpt2_tokenizer_path):
    listed = tmp_path / "texts.json"
    listed.write_text(json.dumps(texts), encoding="utf-8")
    out = tmp_path / "c"
    command = python_with_hooks(_ITERABLE_BUILD.format(block=BLOCK), str(listed), str(out),
                                gpt2_tokenizer_path, kill_after_commits=4)
    code = subprocess.run(command, timeout=300).returncode
    assert code == -signal.SIGKILL
    kept = read_manifest(str(out))
    assert kept["blocks"] and not kept["complete"]
    before = committed_tree(out)
    other = list(texts)
    other[0] = other[0] + " (edited)"
    with pytest.raises(InputChangedError) as info:
        _build(iter(other), out, gpt2_tokenizer_path)
    assert str(out) in str(info.value) and "iterable" in str(info.value)
    assert committed_tree(out) == before
    resumed = _build(iter(texts), out, gpt2_tokenizer_path)
    fresh = _build(iter(texts), tmp_path / "fresh", gpt2_tokenizer_path)
    assert resumed.tokens_built < fresh.tokens_built
    assert tree_bytes(str(out)) == tree_bytes(fresh.path)


# ---------------------------------------------------------------- item 6: inputs edited in place

def _edit_keeping_size(path: Path, keep_mtime: bool) -> None:
    data = path.read_bytes()
    at = data.index(b'"text": "') + len(b'"text": "') + 3
    swapped = b"Q" if data[at:at + 1] != b"Q" else b"Z"
    stat = path.stat()
    path.write_bytes(data[:at] + swapped + data[at + 1:])
    if keep_mtime:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_an_input_edited_in_place_keeping_its_size_is_refused(tmp_path, shards, gpt2_tokenizer_path,
                                                              keep_mtime):
    out = tmp_path / "c"
    _build(shards, out, gpt2_tokenizer_path)
    before = tree_bytes(str(out))
    _edit_keeping_size(Path(shards[1]), keep_mtime)
    with pytest.raises(InputChangedError) as info:
        _build(shards, out, gpt2_tokenizer_path)
    assert shards[1] in str(info.value) and str(out) in str(info.value)
    assert tree_bytes(str(out)) == before


def test_a_touched_but_unchanged_input_is_still_a_no_op(tmp_path, shards, gpt2_tokenizer_path,
                                                         monkeypatch):
    """The inputs are read again once (not tokenized), their new stamps recorded in head.json,
    and the re-run after that is cheap again: no input is read."""
    out = tmp_path / "c"
    _build(shards, out, gpt2_tokenizer_path)
    before = tree_bytes(str(out))
    for path in shards:
        Path(path).write_bytes(Path(path).read_bytes())  # new mtime, same content
    result = _build(shards, out, gpt2_tokenizer_path)
    assert result.already_complete and result.tokens_built == 0
    after = tree_bytes(str(out))
    assert {k: v for k, v in after.items() if k != "head.json"} == \
        {k: v for k, v in before.items() if k != "head.json"}
    heads = [json.loads(tree["head.json"]) for tree in (before, after)]
    stamps = [[i.pop("stamp") for i in head["inputs"]] for head in heads]
    assert heads[0] == heads[1] and all(a != b for a, b in zip(*stamps))

    def no_reading(*args, **kwargs):
        raise AssertionError("an input whose stamp is recorded was read again")

    monkeypatch.setattr(engine, "content_identity", no_reading)
    again = _build(shards, out, gpt2_tokenizer_path)
    assert again.already_complete and tree_bytes(str(out)) == after


def test_an_input_finished_before_a_kill_and_edited_before_the_resume_is_refused(
        tmp_path, books, gpt2_tokenizer_path):
    docs = paragraphs(books)
    short = write_jsonl(tmp_path / "short.jsonl", docs[:40])
    long = write_jsonl(tmp_path / "long.jsonl", docs[40:1200])
    out = tmp_path / "c"
    assert build_killed_at_commit([short, long], out, gpt2_tokenizer_path, 12) == -signal.SIGKILL
    kept = read_manifest(str(out))
    assert kept["inputs"][0]["done"] and not kept["complete"]
    _edit_keeping_size(Path(short), keep_mtime=True)
    with pytest.raises(InputChangedError, match="short.jsonl"):
        _build([short, long], out, gpt2_tokenizer_path)


@pytest.mark.s3
def test_an_input_on_s3_replaced_with_the_same_size_is_refused(tmp_path, shards, gpt2_tokenizer_path):
    with moto_s3() as options:
        import s3fs
        fs = s3fs.S3FileSystem(**options)
        for i, path in enumerate(shards):
            fs.put_file(path, f"bucket/in/part-{i}.jsonl")
        urls = [f"s3://bucket/in/part-{i}.jsonl" for i in range(3)]
        out = tmp_path / "c"
        _build(urls, out, gpt2_tokenizer_path, storage_options=options)
        assert _build(urls, out, gpt2_tokenizer_path, storage_options=options).already_complete
        before = tree_bytes(str(out))
        _edit_keeping_size(Path(shards[2]), keep_mtime=True)
        fs.put_file(shards[2], "bucket/in/part-2.jsonl")
        with pytest.raises(InputChangedError) as info:
            _build(urls, out, gpt2_tokenizer_path, storage_options=options)
        assert urls[2] in str(info.value) and str(out) in str(info.value)
        assert tree_bytes(str(out)) == before


# ---------------------------------------------------------------- item 12: one type per cause

@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_record_is_an_input_error_naming_file_and_line_for_any_worker_count(
        tmp_path, shards, books, gpt2_tokenizer_path, workers):
    lines = [json.dumps({"text": t}) for t in paragraphs(books, 50)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:20] + ["{oops"] + lines[20:]) + "\n")
    with pytest.raises(InputError, match=f"^{bad}:21: malformed JSON") as info:
        _build(shards + [str(bad)], tmp_path / "c", gpt2_tokenizer_path, num_workers=workers)
    assert type(info.value) is InputError


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_changed_before_a_resume_is_the_same_error_for_any_worker_count(
        tmp_path, shards, gpt2_tokenizer_path, workers):
    out = tmp_path / "c"
    assert build_killed_at_commit(shards, out, gpt2_tokenizer_path, 3, workers=workers) == -signal.SIGKILL
    kept = read_manifest(str(out))
    started = next(i for i, p in enumerate(kept["inputs"]) if p["records"] and not p["done"])
    _edit_keeping_size(Path(shards[started]), keep_mtime=False)
    with pytest.raises(InputChangedError, match=f"^{shards[started]}: the input changed"):
        _build(shards, out, gpt2_tokenizer_path, num_workers=workers)


@pytest.mark.parametrize("workers", [1, 2])
def test_an_input_that_cannot_be_read_keeps_its_oserror_type_and_names_the_url(
        tmp_path, shards, gpt2_tokenizer_path, workers):
    missing = tmp_path / "gone" / "part.jsonl"
    url = f"pipe:cat {missing}"
    with pytest.raises(OSError) as info:
        _build(shards + [url], tmp_path / "c", gpt2_tokenizer_path, num_workers=workers)
    assert not isinstance(info.value, (InputError, tc.BuildError))
    assert str(info.value).startswith(f"{url}: reading failed 3 times (OSError: ")
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.slow
@pytest.mark.ray
def test_on_ray_a_bad_record_and_an_unreadable_input_keep_their_types(tmp_path, shards, books,
                                                                      gpt2_tokenizer_path, ray_local):
    lines = [json.dumps({"text": t}) for t in paragraphs(books, 50)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines[:20] + ["{oops"] + lines[20:]) + "\n")
    with pytest.raises(InputError, match=f"^{bad}:21: malformed JSON"):
        _build(shards + [str(bad)], tmp_path / "c", gpt2_tokenizer_path, executor="ray")
    url = f"pipe:cat {tmp_path / 'gone' / 'part.jsonl'}"
    with pytest.raises(OSError) as info:
        _build(shards + [url], tmp_path / "d", gpt2_tokenizer_path, executor="ray")
    assert not isinstance(info.value, (InputError, tc.BuildError))
    assert str(info.value).startswith(f"{url}: reading failed 3 times (OSError: ")


# ---------------------------------------------------------------- item 11: a deleted pending block

def test_a_resume_rewrites_a_finished_block_deleted_after_a_kill(tmp_path, books, gpt2_tokenizer_path):
    """Input 0 gives nothing until the test says so, so input 1's first block is finished and
    logged but waits, invisible, for input 0's: the build is killed then, and that file deleted."""
    import psutil
    docs = paragraphs(books)
    late = write_jsonl(tmp_path / "late.jsonl", docs[:400])
    other = write_jsonl(tmp_path / "other.jsonl", docs[400:800])
    go = tmp_path / "go"
    inputs = [f"pipe:while [ ! -e {go} ]; do sleep 0.05; done; cat {late}", other]
    out = tmp_path / "c"
    assert build_killed_at_commit(inputs, out, gpt2_tokenizer_path, 2, workers=2) == -signal.SIGKILL
    # the killed build's orphaned worker still waits on input 0: end its command, so that it
    # never writes into the cache the resumed build works on
    waiting = [p for p in psutil.process_iter(["cmdline"]) if str(go) in " ".join(p.info["cmdline"] or [])]
    for process in waiting:
        process.kill()
    psutil.wait_procs(waiting)
    go.touch()
    kept = read_manifest(str(out))
    assert kept["pending"], "the test needs a finished block that is not committed yet"
    waiting = kept["pending"][0]
    os.unlink(out / waiting["path"])
    with open(out / kept["pending"][-1]["offsets"], "r+b") as f:  # and another one damaged
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    _build(inputs, out, gpt2_tokenizer_path, num_workers=2)
    assert tc.verify_cache(out) == []
    fresh = _build(inputs, tmp_path / "fresh", gpt2_tokenizer_path)
    assert tree_bytes(str(out)) == tree_bytes(fresh.path)


# ---------------------------------------------------------------- item 17: no empty leftovers

def test_a_finished_cache_has_no_empty_directories(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "c"
    _build(shards, out, gpt2_tokenizer_path, num_workers=2)
    empty = [d for d, dirs, files in os.walk(out) if not dirs and not files]
    assert empty == []
    assert not (out / "log").exists()
