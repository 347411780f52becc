"""`torchcache pack` and the pack plans `torchcache info` lists, run as a user runs them.

The figures the command prints are checked against a PackedDataset whose plan is computed
independently (in this process, in another plan directory) on the same small real cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

import torchcache as tc
from torchcache._util import hooks
from torchcache.cli import main

from conftest import build_killed_at_commit, paragraphs, python_with_hooks, write_jsonl

CHUNKS_OF_8 = {"pack_chunk_blocks": 8}  # test hooks: 39 blocks make 5 chunk files


def run_cli(*args, env: dict[str, str] | None = None, **settings) -> subprocess.CompletedProcess:
    """`torchcache ARGS` in a subprocess, with the test hooks `settings`."""
    command = python_with_hooks("from torchcache.cli import main\nsys.exit(main(sys.argv[1:]))",
                                *map(str, args), **settings)
    return subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TQDM_DISABLE": "1", **(env or {})})


def field(stdout: str, name: str) -> str:
    """The value of an indented `name   value` line."""
    found = re.findall(rf"^  {name} +(.*)$", stdout, flags=re.M)
    assert len(found) == 1, (name, stdout)
    return found[0]


def mtimes(directory: str) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in Path(directory).iterdir()}


@pytest.fixture(autouse=True)
def no_progress_bar(monkeypatch):
    """For main() run in this process; run_cli sets TQDM_DISABLE for the commands it runs."""
    monkeypatch.setenv("TQDM_DISABLE", "1")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    """A real cache of 39 small blocks (about 1,000 paragraph documents, 75k tokens)."""
    d = tmp_path_factory.mktemp("pack_cli")
    docs = write_jsonl(d / "docs.jsonl", paragraphs(books))
    result = tc.build_cache(docs, d / "cache", gpt2_tokenizer_path, block_tokens=2000, progress=False)
    assert result.num_blocks > 16
    return str(d / "cache")


def test_pack_prints_the_packed_datasets_figures_and_a_second_run_reuses_the_plan(cache, tmp_path):
    done = run_cli("pack", cache, "--seq-len", 256, env={"TQDM_DISABLE": ""})
    assert done.returncode == 0, done.stderr
    ds = tc.PackedDataset(cache, 256, plan_dir=tmp_path / "fresh")  # planned here, independently
    stats = ds.stats()
    blocks = tc.TokenCache(cache).num_blocks
    assert stats["split_documents"] > 0 and stats["padding"] > 0
    plan_dir = os.path.join(cache, "packs", ds.plan.identity.plan_id)
    assert field(done.stdout, "stored in") == f"{plan_dir}  (1 chunk file)"
    assert field(done.stdout, "seq_len") == "256  (long_docs split, max_segments none, seed 0)"
    assert field(done.stdout, "rows") == f"{len(ds):,}"
    assert field(done.stdout, "padding") == f"{ds.padding_fraction:.3%}  ({stats['padding']:,} tokens)"
    assert field(done.stdout, "split") == f"{stats['split_documents']} documents longer than seq_len"
    assert field(done.stdout, "blocks") == f"{blocks} planned"
    assert re.search(rf"^planned {blocks} blocks in [\d.]+ s", done.stdout, flags=re.M)
    assert "planning" in done.stderr and f"{blocks}/{blocks}" in done.stderr  # the progress bar
    # the plan the command stored is the one PackedDataset opens by default
    assert len(tc.PackedDataset(cache, 256)) == len(ds)

    before = mtimes(plan_dir)
    again = run_cli("pack", cache, "--seq-len", 256)  # TQDM_DISABLE=1: no bar
    assert again.returncode == 0 and again.stderr == ""
    assert again.stdout.splitlines()[:-1] == done.stdout.splitlines()[:-1]
    assert re.search(r"^already stored: read 1 chunk file in [\d.]+ s$", again.stdout, flags=re.M)
    assert mtimes(plan_dir) == before


def test_pack_options_plan_dir_json_and_info(cache, tmp_path, monkeypatch, capsys):
    plans = tmp_path / "plans"
    options = ["--seq-len", 128, "--long-docs", "drop", "--max-segments", 4, "--seed", 3]
    done = run_cli("pack", cache, *options, "--plan-dir", plans, "--json", **CHUNKS_OF_8)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    monkeypatch.setattr(hooks, "pack_chunk_blocks", 8)  # the same plan identity here
    ds = tc.PackedDataset(cache, 128, long_docs="drop", max_segments=4, seed=3,
                          plan_dir=tmp_path / "fresh")
    stats = ds.stats()
    assert stats["dropped_documents"] > 0
    assert result["plan"] == str(plans / ds.plan.identity.plan_id)
    assert not os.path.exists(os.path.join(cache, "packs", ds.plan.identity.plan_id))
    assert {k: result[k] for k in stats} == stats
    assert result["chunk_files"] == 5 and result["blocks_computed"] == stats["blocks"]
    assert (result["seq_len"], result["long_docs"], result["max_segments"], result["seed"]) == (
        128, "drop", 4, 3)
    assert result["already_stored"] is False

    # info --json (as a user runs it): the plan under --plan-dir, with its figures
    shown = run_cli("info", cache, "--plan-dir", plans, "--json")
    assert shown.returncode == 0, shown.stderr
    listed = [p for p in json.loads(shown.stdout)["pack_plans"] if p["plan_root"] == str(plans)]
    assert len(listed) == 1
    plan = listed[0]
    assert plan["state"] == "complete" and plan["chunk_files"] == 5
    assert (plan["seq_len"], plan["long_docs"], plan["max_segments"], plan["seed"]) == (128, "drop", 4, 3)
    assert plan["rows"] == len(ds) and plan["padding_fraction"] == ds.padding_fraction
    assert plan["dropped_tokens"] == stats["dropped_tokens"]

    # info as text, in this process (the same main() `python -m torchcache` runs)
    line = (f"    seq_len 128, long_docs drop, max_segments 4, seed 3: 5 chunk files, "
            f"{len(ds):,} rows, padding {ds.padding_fraction:.3%}")
    assert main(["info", cache, "--plan-dir", str(plans)]) == 0
    out = capsys.readouterr().out
    assert f"  pack plans in {plans}\n{line}\n" in out

    # a missing chunk file: info says partial and never computes it
    missing = Path(result["plan"]) / "000002.pack"
    missing.unlink()
    assert main(["info", cache, "--plan-dir", str(plans)]) == 0
    out = capsys.readouterr().out
    assert "    seq_len 128, long_docs drop, max_segments 4, seed 3: partial (4 chunk files)\n" in out
    assert not missing.exists()
    # pack computes only that chunk again
    assert main(["pack", cache, *map(str, options), "--plan-dir", str(plans)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^planned 8 blocks in [\d.]+ s .*; reused 31 stored blocks$", out, flags=re.M)
    assert missing.exists()
    assert field(out, "rows") == f"{len(ds):,}"


def test_an_interrupted_cache_gets_its_whole_chunks_stored_and_info_says_partial(
        tmp_path, capsys, monkeypatch, books, gpt2_tokenizer_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", paragraphs(books))
    out = tmp_path / "part"
    assert build_killed_at_commit([docs], out, gpt2_tokenizer_path, 20, block_tokens=2000) == -9
    monkeypatch.setattr(hooks, "pack_chunk_blocks", 8)
    cache = tc.TokenCache(out)
    assert not cache.complete and cache.num_blocks > 8
    assert main(["info", str(out)]) == 0
    assert f"  pack plans none in {out / 'packs'} (`torchcache pack" in capsys.readouterr().out
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pack_plans"] == []

    assert main(["pack", str(out), "--seq-len", "256"]) == 0
    text = capsys.readouterr().out
    stored = cache.num_blocks // 8
    assert field(text, "stored in").endswith(f"  ({stored} chunk file{'s' if stored > 1 else ''})")
    assert field(text, "blocks") == f"{cache.num_blocks} planned"
    assert "the cache is interrupted: only whole chunks of 8 blocks are stored" in text
    assert field(text, "rows") == f"{len(tc.PackedDataset(out, 256, plan_dir=tmp_path / 'fresh')):,}"
    assert main(["info", str(out)]) == 0
    assert (f"    seq_len 256, long_docs split, max_segments none, seed 0: partial ({stored} chunk "
            f"file{'s' if stored > 1 else ''})\n") in capsys.readouterr().out


def test_a_bad_argument_is_one_line_naming_it(cache):
    done = run_cli("pack", cache, "--seq-len", 0)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "torchcache pack: error: --seq-len must be >= 1, got 0\n"


@pytest.mark.parametrize("args, names", [
    (["--seq-len", "8", "--max-segments", "9"], "--max-segments must be <= 8"),
    (["--seq-len", "8", "--workers", "0"], "--workers must be >= 1"),
    (["--seq-len", "8", "--seed", "-1"], "--seed must be >= 0"),
    (["--seq-len", "8", "--plan-dir", "{file}/plans"], "--plan-dir DIR"),
])
def test_bad_pack_arguments_and_directories(cache, tmp_path, capsys, args, names):
    (tmp_path / "file").write_text("not a directory")
    args = [a.format(file=tmp_path / "file") for a in args]
    assert main(["pack", cache, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("torchcache pack: error: ")
    assert names in captured.err
    if "--plan-dir" in args:
        assert str(tmp_path / "file") in captured.err


def test_pack_of_a_path_that_is_no_cache_names_it(tmp_path, capsys):
    assert main(["pack", str(tmp_path / "nothing"), "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "nothing") in err and "not a torchcache cache" in err
