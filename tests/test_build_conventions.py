"""Conventions a user of the builder expects: webdataset's `pipe:` inputs, tqdm's TQDM_DISABLE,
and `torchcache info` telling a killed build from a running one."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchcache as tc
from conftest import DATA, tree_bytes
from torchcache.format.storage import open_storage


def _blocks(root) -> dict[str, bytes]:
    return {k: v for k, v in tree_bytes(str(root)).items() if k.startswith("blocks")}


def test_pipe_input_gives_the_cache_of_the_file_itself(tmp_path, shards, gpt2_tokenizer_path):
    direct = tc.build_cache(shards[0], tmp_path / "direct", gpt2_tokenizer_path, progress=False)
    piped = tc.build_cache(f"pipe:cat {shards[0]}", tmp_path / "piped", gpt2_tokenizer_path,
                           progress=False)
    assert piped.num_tokens == direct.num_tokens
    assert _blocks(tmp_path / "piped") == _blocks(tmp_path / "direct")


def test_pipe_output_may_be_compressed_whatever_the_command_names(tmp_path, shards, gpt2_tokenizer_path):
    """`pipe:curl URL.jsonl.gz` yields gzip bytes, `pipe:gzip -dc URL.jsonl.gz` plain ones."""
    packed = tmp_path / "part.jsonl.gz"
    packed.write_bytes(gzip.compress(Path(shards[0]).read_bytes()))
    reference = tc.build_cache(shards[0], tmp_path / "ref", gpt2_tokenizer_path, progress=False)
    for name, command in (("gz", f"pipe:cat {packed}"), ("plain", f"pipe:gzip -dc {packed}")):
        result = tc.build_cache(command, tmp_path / name, gpt2_tokenizer_path, progress=False)
        assert _blocks(tmp_path / name) == _blocks(tmp_path / "ref"), name
        assert result.num_documents == reference.num_documents


def test_pipe_webdataset_shard_converts_like_the_file(tmp_path, gpt2_tokenizer_path):
    shard = str(DATA / "compressed.tar")
    tc.convert_webdataset(shard, tmp_path / "direct", tokenizer=gpt2_tokenizer_path,
                          text_key="txt.gz", progress=False)
    tc.convert_webdataset(f"pipe:cat {shard}", tmp_path / "piped", tokenizer=gpt2_tokenizer_path,
                          text_key="txt.gz", progress=False)
    assert _blocks(tmp_path / "piped") == _blocks(tmp_path / "direct")
    assert tc.TokenCache(tmp_path / "piped").document_key(0) == "compressed/0001"


def test_a_failing_pipe_command_is_an_io_error_not_damage(tmp_path, gpt2_tokenizer_path, monkeypatch):
    import torchcache.builder.inputs as inputs_module
    monkeypatch.setattr(inputs_module, "_RETRY_DELAY", 0.001)
    for on_error in ("raise", "skip"):  # never skipped: the rest of the input was not read
        with pytest.raises(OSError, match="exited with status 1"):
            tc.build_cache(f"pipe:cat {tmp_path}/missing.jsonl", tmp_path / on_error,
                           gpt2_tokenizer_path, on_error=on_error, progress=False)
    assert not (tmp_path / "skip").exists()  # no cache, complete or not: it committed nothing


def test_pipe_input_of_unknown_type_is_refused_naming_it(tmp_path, gpt2_tokenizer_path):
    with pytest.raises(ValueError, match="pipe:echo hello.*cannot tell the file type"):
        tc.build_cache("pipe:echo hello", tmp_path / "out", gpt2_tokenizer_path)
    with pytest.raises(ValueError, match="Parquet needs random access"):
        tc.build_cache("pipe:cat x.parquet", tmp_path / "out", gpt2_tokenizer_path)


def _run_script(tmp_path: Path, body: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300, cwd=tmp_path)


@pytest.mark.parametrize("env, progress, shown", [
    ({}, None, True),
    ({"TQDM_DISABLE": "1"}, None, False),
    ({}, False, False),
    ({"TQDM_DISABLE": "1"}, True, True),  # an explicit argument wins
])
def test_progress_bar_follows_tqdm_disable_and_the_argument(tmp_path, shards, gpt2_tokenizer_path,
                                                            env, progress, shown):
    done = _run_script(tmp_path, f"""
        import torchcache as tc
        tc.build_cache({shards[0]!r}, "out", {gpt2_tokenizer_path!r}, progress={progress!r})
        """, {"TQDM_DISABLE": "", **env})
    assert done.returncode == 0, done.stderr
    assert ("tokenizing" in done.stderr) is shown, done.stderr


def _info(path) -> str:
    done = subprocess.run([sys.executable, "-m", "torchcache", "info", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[0]


@pytest.mark.slow
def test_info_tells_an_interrupted_build_from_a_running_one(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "out"
    killed = _run_script(tmp_path, f"""
        import torchcache as tc
        from torchcache._util import hooks
        hooks.kill_after_commits = 3  # SIGKILL right after the 3rd commit
        tc.build_cache({shards!r}, {str(out)!r}, {gpt2_tokenizer_path!r}, block_tokens=2000,
                       num_workers=0, progress=False)
        """, {})
    assert killed.returncode == -9
    assert "interrupted: rerun the same build to resume it" in _info(out)
    lock = open_storage(str(out)).lock()
    lock.acquire()  # as a running builder holds it
    try:
        assert "(still building)" in _info(out)
    finally:
        lock.release()
    tc.build_cache(shards, out, gpt2_tokenizer_path, block_tokens=2000, progress=False)
    assert "(complete)" in _info(out)
    shutil.rmtree(out)


def test_show_tokens_takes_a_count_or_a_range(tmp_path, shards, gpt2_tokenizer_path):
    tc.build_cache(shards[0], tmp_path / "c", gpt2_tokenizer_path, progress=False)

    def show(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "torchcache", "show", str(tmp_path / "c"), *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert show("--tokens", "40", "--ids") == show("--tokens", "0:40", "--ids")
    ids = [int(x) for x in show("--tokens", "40", "--ids").split()]
    assert ids == tc.TokenCache(tmp_path / "c").read(0, 40).tolist()
