"""Builder reliability: never delete user files, no hang without a main guard, inputs identified
by content, lease loss stops the build, clear errors, restarts, repair, empty builds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from tokenizers import Tokenizer
from conftest import build_killed_at_commit, committed_tree, paragraphs, tree_bytes, write_jsonl

import torchcache as tc
from torchcache.format.ledger import read_manifest
from torchcache.format.storage import RemoteStorage

BLOCK = 2_000
CLI = [sys.executable, "-m", "torchcache"]


def _build(shards, out, tokenizer, **kw):
    kw.setdefault("block_tokens", BLOCK)
    kw.setdefault("num_workers", 1)
    return tc.build_cache(shards, out, tokenizer, progress=False, **kw)


def _killed_build(shards, out, tokenizer, commits: int, workers: int = 1) -> None:
    """A build killed with SIGKILL right after its `commits`-th manifest write."""
    code = build_killed_at_commit(shards, out, tokenizer, commits, workers=workers, block_tokens=BLOCK)
    assert code == -signal.SIGKILL, "the build was meant to be killed at a commit"


def _manifest(out) -> dict:
    return read_manifest(str(out))


# ---------------------------------------------------------------- 1. user files are never deleted

def test_a_folder_with_user_blocks_is_refused_and_left_untouched(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "mine"
    (out / "blocks" / "sub").mkdir(parents=True)
    (out / "blocks" / "notes.txt").write_text("keep me")
    (out / "blocks" / "000000-000000.safetensors").write_bytes(b"mine too")
    (out / "blocks" / "sub" / "deep.txt").write_text("and me")
    before = tree_bytes(str(out))
    with pytest.raises(tc.BuildError, match="not a torchcache cache.*blocks/"):
        _build(shards, out, gpt2_tokenizer_path)
    after = tree_bytes(str(out))
    assert {k: v for k, v in after.items() if k != ".lock"} == before


def test_a_user_tokenizer_json_without_a_manifest_is_not_overwritten(tmp_path, shards,
                                                                     gpt2_tokenizer_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"mine": true}')
    with pytest.raises(tc.BuildError, match="not a torchcache cache"):
        _build(shards, out, gpt2_tokenizer_path)
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'


def test_resume_deletes_only_the_builders_own_leftovers(tmp_path, shards, gpt2_tokenizer_path):
    reference = _build(shards, tmp_path / "ref", gpt2_tokenizer_path)
    out = tmp_path / "cache"
    _killed_build(shards, out, gpt2_tokenizer_path, commits=3)
    (out / "blocks" / "README.txt").write_text("a user's file")
    (out / "blocks" / "000002-000099.safetensors.tmp-123").write_bytes(b"crash leftover")
    (out / "blocks" / "000002-000098.safetensors").write_bytes(b"unknown block of ours")
    _build(shards, out, gpt2_tokenizer_path)
    assert (out / "blocks" / "README.txt").read_text() == "a user's file"
    got = tree_bytes(str(out))
    del got["blocks/README.txt"]
    assert got == tree_bytes(reference.path)


# ---------------------------------------------------------------- 4. plain scripts, no main guard

@pytest.mark.parametrize("background", [False, True])
def test_a_plain_script_without_main_guard_builds_with_two_workers(tmp_path, shards,
                                                                   gpt2_tokenizer_path, background):
    script = tmp_path / "plain_build.py"
    script.write_text(textwrap.dedent(f"""
        import torchcache as tc
        print("script body runs", flush=True)
        result = tc.build_cache({shards!r}, {str(tmp_path / 'out')!r}, {gpt2_tokenizer_path!r},
                                block_tokens={BLOCK}, num_workers=2, progress=False,
                                background={background})
        if {background}:
            result = result.wait(timeout=240)
        print("documents", result.num_documents, flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("script body runs") == 1, "the user's script ran again in a worker"
    assert tree_bytes(str(tmp_path / "out")) == tree_bytes(
        _build(shards, tmp_path / "ref", gpt2_tokenizer_path).path)


# ---------------------------------------------------------------- 9. inputs edited in place

@pytest.mark.slow
def test_an_input_edited_in_place_between_kill_and_resume_is_refused(tmp_path, shards,
                                                                    gpt2_tokenizer_path):
    out = tmp_path / "cache"
    _killed_build(shards, out, gpt2_tokenizer_path, commits=4)
    progress = _manifest(out)["inputs"]
    edited = next(i for i, p in enumerate(progress) if p["records"] > 0 and not p["done"])
    data = bytearray(open(shards[edited], "rb").read())
    position = data.index(b'"text": "') + 9
    data[position] = ord("Q") if data[position] != ord("Q") else ord("R")  # same size
    with open(shards[edited], "wb") as f:
        f.write(data)
    before = committed_tree(out)
    with pytest.raises(tc.InputError, match="changed"):
        _build(shards, out, gpt2_tokenizer_path)
    assert committed_tree(out) == before


@pytest.mark.slow
def test_an_unchanged_input_resumes_after_kill_to_the_same_bytes(tmp_path, shards, gpt2_tokenizer_path):
    reference = _build(shards, tmp_path / "ref", gpt2_tokenizer_path)
    out = tmp_path / "cache"
    _killed_build(shards, out, gpt2_tokenizer_path, commits=5, workers=2)
    assert not _manifest(out)["complete"]
    _build(shards, out, gpt2_tokenizer_path, num_workers=2)
    assert tree_bytes(str(out)) == tree_bytes(reference.path)


# ---------------------------------------------------------------- 11. the S3 lease

def _lease(monkeypatch, url: str, ttl: float):
    """The lock a builder takes on an object store (a lease object), with a short TTL."""
    storage = RemoteStorage(url, {})
    lease_class = type(storage.lock())
    monkeypatch.setattr(lease_class, "TTL", ttl)
    monkeypatch.setattr(lease_class, "RETRY", 0.05)
    return storage, storage.lock()


def _lease_owner(storage) -> str | None:
    try:
        return json.loads(storage.read(".lock"))["owner"]
    except FileNotFoundError:
        return None


def _until(condition, what: str, seconds: float = 30):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {seconds} s")


def test_a_builder_that_cannot_renew_its_lease_stops_before_writing_more(monkeypatch):
    storage, lock = _lease(monkeypatch, "memory://lease-test/cache", ttl=1.0)
    lock.acquire()
    try:
        lock.check()  # freshly renewed
        owner = _lease_owner(storage)
        real_write, broken = storage.write, [True]

        def failing_write(rel, parts):
            if rel == ".lock" and broken[0]:
                raise ConnectionResetError("connection reset by peer")
            return real_write(rel, parts)

        monkeypatch.setattr(storage, "write", failing_write)

        def check_error() -> str:
            try:
                lock.check()
            except RuntimeError as e:
                assert "could not renew its lease" in str(e) and "stopping" in str(e), str(e)
                return str(e)
            return ""

        # check() fails once the last renewal is half a TTL old, naming the renewal's error
        _until(lambda: "ConnectionResetError" in check_error(), "check() failing, naming the error")
        # the heartbeat keeps retrying: once the store answers again, the lease is renewed
        broken[0] = False
        _until(lambda: check_error() == "", "a renewal after the store recovered")
        assert _lease_owner(storage) == owner
    finally:
        lock.release()
    assert _lease_owner(storage) is None, "release() deletes its own lease"


def test_a_lease_taken_by_another_builder_is_noticed(monkeypatch):
    storage, lock = _lease(monkeypatch, "memory://lease-test/taken", ttl=0.6)
    lock.acquire()
    try:
        storage.write(".lock", [json.dumps({"owner": "other:1", "expires": time.time() + 60}).encode()])

        def taken() -> bool:
            try:
                lock.check()
            except RuntimeError as e:  # (or "could not renew", until the heartbeat reads the lease)
                return "another builder (other:1) took this builder's lease" in str(e)
            return False

        _until(taken, "noticing the other owner")
        _until(lambda: not any(t.name == "torchcache-lease" and t.is_alive()
                               for t in threading.enumerate()), "the heartbeat stopping for good")
        assert _lease_owner(storage) == "other:1", "a builder that lost its lease never renews it"
    finally:
        lock.release()
    assert _lease_owner(storage) == "other:1", "release() leaves another owner's lease alone"


# ---------------------------------------------------------------- 14. CLI: one line, no traceback

def _cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=120, **kw)


def _one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], proc.stderr


def test_cli_output_that_is_a_regular_file(tmp_path, shards, gpt2_tokenizer_path):
    target = tmp_path / "afile"
    target.write_text("not a directory")
    _one_line_error(_cli("build", *shards, "-o", target, "-t", gpt2_tokenizer_path), "afile")
    assert target.read_text() == "not a directory"


def test_cli_corrupt_tokenizer_json(tmp_path, shards):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    _one_line_error(_cli("build", *shards, "-o", tmp_path / "out", "-t", bad), "tokenizer.json")


def _mount_tmpfs(path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); needs root")


@pytest.fixture()
def tiny_disk(tmp_path, gpt2_tokenizer_path):
    """A disk with room for the tokenizer.json and some 30 blocks, not for the whole cache."""
    path = tmp_path / "tiny"
    stored_tokenizer = len(Tokenizer.from_file(gpt2_tokenizer_path).to_str())
    _mount_tmpfs(path, f"size={stored_tokenizer // 1024 + 160}k")
    yield path
    subprocess.run(["umount", str(path)], check=True)


@pytest.fixture()
def read_only_disk(tmp_path):
    path = tmp_path / "ro"
    _mount_tmpfs(path, "ro,size=64k")
    yield path
    subprocess.run(["umount", str(path)], check=True)


def test_cli_full_disk_keeps_committed_blocks(tmp_path, shards, gpt2_tokenizer_path, tiny_disk):
    out = tiny_disk / "cache"
    proc = _cli("build", *shards, "-o", out, "-t", gpt2_tokenizer_path, "--block-tokens", 2000, "-j", 1)
    _one_line_error(proc, "No space left on device")
    cache = tc.TokenCache(out)  # what was committed before the disk filled up is intact
    assert cache.num_blocks > 0 and not cache.complete
    assert tc.verify_cache(out) == []
    assert not [n for n in os.listdir(out / "blocks") if ".tmp-" in n]


def test_cli_read_only_output(shards, gpt2_tokenizer_path, read_only_disk):
    _one_line_error(_cli("build", *shards, "-o", read_only_disk / "cache", "-t", gpt2_tokenizer_path),
                    "Read-only file system")


# ---------------------------------------------------------------- 15. arguments, before any write

@pytest.mark.parametrize("kwargs, error, name", [
    ({"num_workers": "2"}, TypeError, "num_workers"),
    ({"num_workers": 1.5}, TypeError, "num_workers"),
    ({"num_workers": True}, TypeError, "num_workers"),
    ({"block_tokens": 0}, ValueError, "block_tokens"),
    ({"bos": 1.5}, TypeError, "bos"),
    ({"bos": [1]}, TypeError, "bos"),
    ({"eos": 2.0}, TypeError, "eos"),
    ({"text_key": ["text"]}, TypeError, "text_key"),
    ({"text_key": ""}, TypeError, "text_key"),
    ({"progress": "yes"}, TypeError, "progress"),
    ({"storage_options": "anon"}, TypeError, "storage_options"),
])
def test_bad_arguments_fail_before_the_output_is_touched(tmp_path, shards, gpt2_tokenizer_path,
                                                         kwargs, error, name):
    out = tmp_path / "never"
    with pytest.raises(error, match=name):
        tc.build_cache(shards, out, gpt2_tokenizer_path, **{"progress": False, **kwargs})
    assert not out.exists()


# ---------------------------------------------------------------- 16. no zombie after a failure

def test_a_failed_background_build_leaves_no_zombie(tmp_path, books, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "bad.jsonl", paragraphs(books, 50))
    with open(src, "a") as f:
        f.write("{not json\n")
    handle = tc.build_cache(src, tmp_path / "cache", gpt2_tokenizer_path, background=True)
    with pytest.raises(tc.InputError, match="bad.jsonl:51"):
        handle.wait(timeout=120)
    assert handle.done and isinstance(handle.error, tc.InputError)
    zombies = [c for c in psutil.Process().children(recursive=True)
               if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


# ---------------------------------------------------------------- 17. a failed first build

@pytest.mark.slow
def test_a_failed_first_build_can_be_rerun_with_corrected_settings(tmp_path, shards,
                                                                   gpt2_tokenizer_path):
    out = tmp_path / "cache"
    with pytest.raises(tc.InputError, match="no 'body' field"):
        _build(shards, out, gpt2_tokenizer_path, text_key="body")
    assert not out.exists()  # nothing committed: nothing left that looks like a cache (issue 31)
    result = _build(shards, out, gpt2_tokenizer_path, text_key="text")
    assert result.num_documents > 1000
    assert tree_bytes(str(out)) == tree_bytes(_build(shards, tmp_path / "ref", gpt2_tokenizer_path).path)
    proc = _cli("build", *shards, "-o", tmp_path / "cli", "-t", gpt2_tokenizer_path, "--text-key", "body")
    _one_line_error(proc, "--on-error skip")
    proc = _cli("build", *shards, "-o", tmp_path / "cli", "-t", gpt2_tokenizer_path)
    assert proc.returncode == 0, proc.stderr


def test_a_cache_with_committed_blocks_still_refuses_other_settings(tmp_path, shards,
                                                                    gpt2_tokenizer_path):
    out = tmp_path / "cache"
    _killed_build(shards, out, gpt2_tokenizer_path, commits=3)
    before = tree_bytes(str(out))
    with pytest.raises(tc.BuildError, match="other settings"):
        _build(shards, out, gpt2_tokenizer_path, block_tokens=BLOCK + 1)
    assert tree_bytes(str(out)) == before


# ---------------------------------------------------------------- 18. repair

def _flip(path, offset: int = -10) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_repair_rebuilds_exactly_the_damaged_blocks(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "cache"
    _build(shards, out, gpt2_tokenizer_path)
    good = tree_bytes(str(out))
    blocks = _manifest(out)["blocks"]
    _flip(out / blocks[4]["path"])
    (out / blocks[7]["offsets"]).unlink()
    untouched = out / blocks[0]["path"]
    stamp = untouched.stat().st_mtime_ns
    proc = _cli("verify", out)
    assert proc.returncode == 1 and "verify --repair" in proc.stderr
    proc = _cli("verify", out, "--repair")
    assert proc.returncode == 0, proc.stderr
    assert blocks[4]["path"] in proc.stdout and blocks[7]["offsets"] in proc.stdout
    assert tree_bytes(str(out)) == good
    assert untouched.stat().st_mtime_ns == stamp, "an intact block was rewritten"
    assert _cli("verify", out).returncode == 0


def test_repair_refuses_an_input_that_changed(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "cache"
    _build(shards, out, gpt2_tokenizer_path)
    block = _manifest(out)["blocks"][3]
    _flip(out / block["path"])
    damaged = (out / block["path"]).read_bytes()
    with open(shards[block["input"]], "r+b") as f:  # same size, other text
        edited = f.read().replace(b"e", b"x")
        f.seek(0)
        f.write(edited)
    with pytest.raises(tc.BuildError, match="changed"):
        tc.repair_cache(out)
    assert (out / block["path"]).read_bytes() == damaged


# ---------------------------------------------------------------- 19. builds that produce nothing

def test_a_build_where_every_record_is_skipped_is_an_error_unless_allowed(tmp_path, books,
                                                                        gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "docs.jsonl", paragraphs(books, 30), key="body")
    with pytest.raises(tc.BuildError, match="every record was skipped.*30 missing_text"):
        tc.build_cache(src, tmp_path / "a", gpt2_tokenizer_path, on_error="skip", progress=False)
    proc = _cli("build", src, "-o", tmp_path / "b", "-t", gpt2_tokenizer_path, "--on-error", "skip")
    _one_line_error(proc, "every record was skipped", "--allow-empty")
    assert "already complete" not in proc.stdout
    result = tc.build_cache(src, tmp_path / "c", gpt2_tokenizer_path, on_error="skip",
                            allow_empty=True, progress=False)
    assert result.num_documents == 0 and result.skipped == {"missing_text": 30}
    proc = _cli("build", src, "-o", tmp_path / "d", "-t", gpt2_tokenizer_path, "--on-error", "skip",
                "--allow-empty")
    assert proc.returncode == 0 and "already complete" not in proc.stdout


# ---------------------------------------------------------------- 16. blocks written in the background

@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_record_keeps_every_block_written_before_it(tmp_path, books, gpt2_tokenizer_path, workers):
    # blocks are written in a background thread while the next is made; a block finished before
    # the bad record is still committed (a re-run resumes after it), and no other block is
    texts = paragraphs(books, 400)
    good = write_jsonl(tmp_path / "good.jsonl", texts[:200])
    bad = write_jsonl(tmp_path / "bad.jsonl", texts[200:])
    with open(bad) as f:
        lines = f.readlines()
    lines.insert(150, "{not json\n")
    with open(bad, "w") as f:
        f.writelines(lines)
    prefix = write_jsonl(tmp_path / "prefix.jsonl", texts[200:350])  # bad.jsonl before line 151
    made = _manifest(_build([prefix], tmp_path / "prefix", gpt2_tokenizer_path,
                            block_tokens=500).path)["blocks"]
    # every block but the last closed before line 151; the last one too if it is full
    before = made[:-1] + [e for e in made[-1:] if e["num_tokens"] >= 500]
    assert len(before) >= 5
    with pytest.raises(tc.InputError, match=r"bad\.jsonl:151"):
        _build([good, bad], tmp_path / "c", gpt2_tokenizer_path, num_workers=workers, block_tokens=500)
    manifest = _manifest(tmp_path / "c")  # (pending: kept, visible once input 0 is complete)
    committed = [e for e in manifest["blocks"] + manifest.get("pending", []) if e["input"] == 1]
    assert [e["checksum"] for e in committed] == [e["checksum"] for e in before]
    assert tc.verify_cache(tmp_path / "c") == []
