"""Damage on a local cache that used to pass silently (issue 21, items 4, 5, 11 and 16).

A finished cache without its commit point, a tokenizer.json swapped for another valid one,
temporary files left by a `pack`, `upgrade` or `repair` killed with SIGKILL, a damaged index
checksum, and the file count `repair` reports. Every cache here is a real build of real text;
every kill is a real SIGKILL of a real `torchcache` process, at a known point: the process is
held just before it renames a finished temporary file, and the test kills it once that file is
there.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

import torchcache as tc
from torchcache.errors import BuildError, CacheFormatError

from conftest import (as_format_v1, build_killed_at_commit, paragraphs, python_with_hooks, tree_bytes,
                      write_jsonl)

CHUNKS_OF_4 = {"pack_chunk_blocks": 4}  # test hooks: pack plans of 4 blocks per chunk file

# Runs the command line in this interpreter, held forever just before it renames a temporary
# file to a name under folder argv[1] ending with argv[2] (the test then kills it with SIGKILL).
_HELD_BEFORE_RENAME = """
import os, sys, time
folder, final_suffix = sys.argv[1:3]
real_replace = os.replace
def held_replace(src, dst, *args, **kwargs):
    dst = os.fspath(dst)
    if dst.startswith(folder + os.sep) and dst.endswith(final_suffix):
        while True:
            time.sleep(60)
    return real_replace(src, dst, *args, **kwargs)
os.replace = held_replace
from torchcache.cli import main
sys.exit(main(sys.argv[3:]))
"""


def run_cli(*args, **settings) -> subprocess.CompletedProcess:
    """`torchcache ARGS` in a subprocess, with the test hooks `settings`."""
    command = python_with_hooks("from torchcache.cli import main\nsys.exit(main(sys.argv[1:]))",
                                *map(str, args), **settings)
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TQDM_DISABLE": "1"})


def kill_when_temp_file_appears(final_suffix: str, folder: Path, *args,
                                env: dict[str, str] | None = None, **settings) -> Path:
    """Run `torchcache ARGS` (with the test hooks `settings`), SIGKILL it once it holds a finished
    temporary file of a name ending with `final_suffix` under `folder`; that file, left behind."""
    proc = subprocess.Popen(python_with_hooks(_HELD_BEFORE_RENAME, str(folder), final_suffix,
                                              *map(str, args), **settings),
                            env={**os.environ, "TQDM_DISABLE": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pattern = f"*{final_suffix}.tmp-{proc.pid}"
        while not list(folder.rglob(pattern)):
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"torchcache {args[0]} ended (code {proc.returncode}) before writing "
                            f"{pattern}: {out.decode()} {err.decode()}")
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    (left,) = folder.rglob(pattern)
    return left


@pytest.fixture()
def live_process():
    """A live process whose pid names a temporary file that must never be removed."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    yield proc.pid
    proc.stdin.close()
    proc.wait()


@pytest.fixture()
def inputs(tmp_path, books) -> list[str]:
    docs = paragraphs(books, 600)
    d = tmp_path / "in"
    d.mkdir()
    return [write_jsonl(d / f"part-{i}.jsonl", docs[i::2]) for i in range(2)]


@pytest.fixture()
def built(tmp_path, inputs, gpt2_tokenizer_path) -> Path:
    out = tmp_path / "cache"
    result = tc.build_cache(inputs, out, gpt2_tokenizer_path, block_tokens=4000, num_workers=1,
                            progress=False)
    assert result.num_blocks >= 6
    return out


def _all_tokens(root) -> np.ndarray:
    cache = tc.TokenCache(root)
    return cache.read(0, cache.num_tokens)


# ---------------------------------------------------------------- item 4: head.json missing

def test_a_finished_cache_without_head_json_is_refused_and_repair_restores_it(built):
    head = (built / "head.json").read_bytes()
    tokens = _all_tokens(built)
    (built / "head.json").unlink()

    with pytest.raises(CacheFormatError, match=r"head\.json: missing.*torchcache verify --repair"):
        tc.TokenCache(built)
    problems = tc.check_cache(built)
    assert [p.file for p in problems] == ["head.json"]
    cli = run_cli("verify", built)
    assert cli.returncode == 1 and "all checksums match" not in cli.stdout
    assert f"BAD {built}/head.json: missing" in cli.stderr
    assert f"`torchcache verify --repair {built}` restores head.json" in cli.stderr

    result = tc.repair_cache(built)
    assert result.repaired == ["head.json"]
    assert (built / "head.json").read_bytes() == head  # recomputed: the very head the build wrote
    assert np.array_equal(_all_tokens(built), tokens)
    assert tc.verify_cache(built) == []


def test_an_interrupted_cache_without_head_json_is_restored_from_its_log_and_resumes(
        tmp_path, inputs, gpt2_tokenizer_path, built):
    out = tmp_path / "killed"
    assert build_killed_at_commit(inputs, out, gpt2_tokenizer_path, 3, block_tokens=4000) == -9
    head = (out / "head.json").read_bytes()
    assert not json.loads(head)["complete"] and json.loads(head)["blocks"] > 0
    (out / "head.json").unlink()

    with pytest.raises(CacheFormatError, match="head.json: missing"):
        tc.TokenCache(out)
    with pytest.raises(CacheFormatError, match="head.json: missing"):  # no silent fresh start
        tc.build_cache(inputs, out, gpt2_tokenizer_path, block_tokens=4000, num_workers=1,
                       progress=False)
    cli = run_cli("verify", "--repair", out)
    assert cli.returncode == 0, cli.stderr
    assert "restored head.json" in cli.stdout
    assert (out / "head.json").read_bytes() == head

    tc.build_cache(inputs, out, gpt2_tokenizer_path, block_tokens=4000, num_workers=1, progress=False)
    assert tree_bytes(out) == tree_bytes(built)


def test_a_new_cache_with_only_its_manifest_still_opens_empty(tmp_path, built):
    new = tmp_path / "new"
    new.mkdir()
    shutil.copy(built / "manifest.json", new / "manifest.json")
    shutil.copy(built / "tokenizer.json", new / "tokenizer.json")
    cache = tc.TokenCache(new)
    assert (cache.num_tokens, cache.complete) == (0, False)
    assert tc.verify_cache(new) == []


# ---------------------------------------------------------------- item 5: tokenizer swapped

def _another_tokenizer() -> Tokenizer:
    """A valid tokenizer that is not GPT-2: its ids decode to other words."""
    vocab = {f"word{i}": i for i in range(60_000)}
    vocab["[UNK]"] = 60_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_a_swapped_tokenizer_is_reported_by_verify_and_refused_for_decoding(built):
    original = (built / "tokenizer.json").read_bytes()
    text = tc.TokenCache(built).decode(tc.TokenCache(built).document(3))
    expected = json.loads((built / "manifest.json").read_text())["spec"]["tokenizer"]["fingerprint"]
    (built / "tokenizer.json").write_text(_another_tokenizer().to_str())

    (problem,) = tc.check_cache(built)
    assert problem.file == "tokenizer.json" and problem.entry is None
    assert f"{built}/tokenizer.json" in problem.message and expected in problem.message
    cache = tc.TokenCache(built)
    with pytest.raises(CacheFormatError, match="tokenizer.json: .*not the tokenizer the cache was built with"):
        cache.decode(cache.document(3))
    show = run_cli("show", built, "-d", 3)
    assert show.returncode == 2 and show.stdout == ""
    assert "tokenizer.json" in show.stderr and expected in show.stderr
    verify = run_cli("verify", built)
    assert verify.returncode == 1
    assert "rebuilds the damaged blocks" not in verify.stderr  # repair cannot make a tokenizer
    assert "`torchcache verify --repair` cannot fix this" in verify.stderr
    with pytest.raises(BuildError, match="tokenizer.json"):
        tc.repair_cache(built)

    (built / "tokenizer.json").write_bytes(original)
    assert tc.verify_cache(built) == []
    assert run_cli("show", built, "-d", 3).stdout == text + "\n"


# ---------------------------------------------------------------- item 11: leftovers

def test_a_rerun_of_a_killed_pack_removes_its_temporary_file_but_not_a_live_ones(built, live_process):
    plans = built / "packs"
    plans.mkdir()
    left = kill_when_temp_file_appears(".pack", plans, "pack", built, "--seq-len", 128,
                                       **CHUNKS_OF_4)
    live = left.parent / f"000001.pack.tmp-{live_process}"
    live.write_bytes(b"a live process is writing this")

    done = run_cli("pack", built, "--seq-len", 128, **CHUNKS_OF_4)
    assert done.returncode == 0, done.stderr
    assert not left.exists() and live.exists()
    assert sorted(p.name for p in left.parent.iterdir() if ".tmp-" in p.name) == [live.name]
    packed = tc.PackedDataset(built, 128)
    assert sum(len(d) for r in range(len(packed)) for d in packed.row_documents(r)) > 0


def test_a_rerun_of_a_killed_upgrade_removes_its_temporary_file(built, live_process):
    tokens = _all_tokens(built)
    as_format_v1(built)
    left = kill_when_temp_file_appears("manifest.json", built, "upgrade", built)
    live = built / f"head.json.tmp-{live_process}"
    live.write_bytes(b"{}")
    assert json.loads((built / "manifest.json").read_text())["version"] == 1

    done = run_cli("upgrade", built)
    assert done.returncode == 0, done.stderr
    assert "upgraded to format v2" in done.stdout
    assert not left.exists() and live.exists()
    assert np.array_equal(_all_tokens(built), tokens)



def test_a_rerun_of_a_killed_repair_removes_its_temporary_file(built, tmp_path):
    block = built / "blocks" / "000001-000001.safetensors"
    good = block.read_bytes()
    block.write_bytes(good[:-8] + bytes(8))
    scratch = tmp_path / "scratch"  # the killed repair's scratch directory stays in there
    scratch.mkdir()
    left = kill_when_temp_file_appears("000001-000001.safetensors", built / "blocks",
                                       "verify", "--repair", built, env={"TMPDIR": str(scratch)})
    done = run_cli("verify", "--repair", built)
    assert done.returncode == 0, done.stderr
    assert not left.exists() and block.read_bytes() == good
    assert not [p for p in built.rglob("*") if ".tmp-" in p.name]


def test_repair_names_a_damaged_index_checksum_instead_of_a_changed_input(built):
    index = built / "index" / "000000.bin"
    data = bytearray(index.read_bytes())
    data[2 * 128 + 32] ^= 1  # block 2's recorded sha256
    index.write_bytes(bytes(data))
    with pytest.raises(BuildError) as raised:
        tc.repair_cache(built)
    message = str(raised.value)
    assert f"{built}/index/000000.bin" in message and "changed" not in message
    assert "block 2" in message and "blocks/000000-000001.safetensors" in message
    cli = run_cli("verify", "--repair", built)
    assert cli.returncode == 2 and "index/000000.bin" in cli.stderr


# ---------------------------------------------------------------- item 16: the count repair reports

def test_repair_reports_exactly_the_files_it_rewrote(built):
    block = built / "blocks" / "000000-000002.safetensors"
    offsets = built / "blocks" / "000001-000000.offsets.safetensors"
    for damaged in (block, offsets):
        data = bytearray(damaged.read_bytes())
        data[-1] ^= 0xFF
        damaged.write_bytes(bytes(data))
    done = run_cli("verify", "--repair", built)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "rebuilt blocks/000000-000002.safetensors",
        "rebuilt blocks/000001-000000.offsets.safetensors",
        f"{built}: repaired 2 files; all checksums match now"]

    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    result = tc.repair_cache(built)
    assert result.repaired == ["blocks/000000-000002.safetensors"]
    assert run_cli("verify", built).returncode == 0
