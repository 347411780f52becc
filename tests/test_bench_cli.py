"""`torchcache bench`: would the GPU wait for a cache's data at a given step time (issue 34,
item 3b). Run as a user runs it (a subprocess), on a real small cache, local and on a moto S3
server. The figures are checked against each other and against what the run must have done
(its batches, tokens, requests), never against a speed: only a remote read against a 10 µs
step is certain to make the loop wait.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import torchcache as tc

from conftest import paragraphs, write_jsonl

LINE = {
    "header": r"^(?P<url>\S+): (?P<batches>[\d,]+) batches of (?P<batch>\d+) x (?P<seq>\d+) tokens "
              r"\((?P<mode>[^)]*)\), a (?P<step>[\d.]+) ms step after each$",
    "rate": r"^  batches/s  (?P<value>[\d,.]+)$",
    "tokens": r"^  tokens/s   (?P<value>[\d,]+)$",
    "wait": r"^  data wait  (?P<ms>[\d.]+) ms per step, (?P<percent>[\d.]+)% of the time$",
    "startup": r"^  start-up   (?P<ms>\d+) ms to the first batch",
    "requests": r"^  requests   (?P<total>[\d,]+) \((?P<whole>[\d,]+) whole blocks?, "
                r"(?P<ranged>[\d,]+) ranged reads?\)$",
    "downloaded": r"^  downloaded (?P<mb>[\d,.]+) MB \((?P<read>[\d.]+)x the tokens of the "
                  r"batches, (?P<ratio>[\d.]+)x the cache's (?P<cache_mb>[\d,.]+) MB of tokens\)$",
}
WAITS = r"^the GPU would wait (?P<percent>\d+)% of the time at a (?P<step>[\d.]+) ms step "
KEEPS_UP = r"^data keeps up at a (?P<step>[\d.]+) ms step \(the loop waited (?P<percent>[\d.]+)% "


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcache", "bench", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "TQDM_DISABLE": "1"})


def number(text: str) -> float:
    return float(text.replace(",", ""))


def parsed(stdout: str) -> dict[str, dict[str, str] | None]:
    """Each kind of line of the output (None where absent); the verdict is the last line."""
    lines = stdout.splitlines()
    found = {}
    for name, pattern in LINE.items():
        matches = [m for line in lines if (m := re.match(pattern, line))]
        assert len(matches) <= 1, (name, stdout)
        found[name] = matches[0].groupdict() if matches else None
    found["verdict"] = lines[-1]
    return found


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    """A real cache of about 75k tokens in 38 blocks."""
    d = tmp_path_factory.mktemp("bench_cli")
    docs = write_jsonl(d / "docs.jsonl", paragraphs(books))
    tc.build_cache(docs, d / "cache", gpt2_tokenizer_path, block_tokens=2000, progress=False)
    return str(d / "cache")


@pytest.mark.parametrize("workers", [0, 2])
def test_bench_prints_the_pace_and_the_wait_of_a_local_cache(cache, workers):
    """30 batches of 4 x 1024 (more than the cache's 18 a pass: the sampler goes on to the next
    epoch): the rates agree with each other and the verdict with the wait line."""
    run = bench(cache, "--seq-len", "1024", "--batch-size", "4", "--step-ms", "5", "--batches", "30",
                "--workers", str(workers))
    assert run.returncode == 0, run.stderr
    out = parsed(run.stdout)
    header = out["header"]
    assert header is not None, run.stdout
    assert (header["url"], header["batches"], header["batch"], header["seq"], header["step"]) == \
        (cache, "30", "4", "1024", "5")
    assert header["mode"] == ("2 workers" if workers else "in-process, 4 batches ahead")
    rate, tokens = number(out["rate"]["value"]), number(out["tokens"]["value"])
    assert 0 < rate < 1000 / 5  # a 5 ms step bounds the pace
    assert tokens == pytest.approx(rate * 4 * 1024, rel=0.01)
    percent = number(out["wait"]["percent"])
    assert out["startup"] is not None
    assert out["requests"] is None and out["downloaded"] is None  # a local cache downloads nothing
    waits, keeps_up = re.match(WAITS, out["verdict"]), re.match(KEEPS_UP, out["verdict"])
    assert (waits or keeps_up) is not None, run.stdout
    if keeps_up:
        assert percent < 2 and number(keeps_up["percent"]) == percent
    else:
        assert percent >= 2 and abs(number(waits["percent"]) - percent) <= 0.5


def test_bench_json_gives_the_same_figures_for_tools(cache):
    run = bench(cache, "--seq-len", "64", "--batch-size", "8", "--step-ms", "2", "--batches", "20",
                "--json")
    assert run.returncode == 0, run.stderr
    figures = json.loads(run.stdout)
    assert (figures["path"], figures["workers"], figures["batches"], figures["tokens"],
            figures["step_ms"]) == (cache, 0, 20, 20 * 8 * 64, 2.0)
    assert "remote" not in figures
    assert figures["seconds"] >= 20 * 0.002 + figures["first_wait_seconds"]
    assert figures["data_wait_seconds"] >= figures["first_wait_seconds"] >= 0
    assert figures["wait_fraction"] == pytest.approx(
        (figures["data_wait_seconds"] - figures["first_wait_seconds"])
        / (figures["seconds"] - figures["first_wait_seconds"]))
    assert figures["keeps_up"] == (figures["wait_fraction"] < 0.02)
    assert figures["verdict"].startswith("data keeps up" if figures["keeps_up"] else "the GPU would wait")


def test_bench_without_a_step_gives_the_loaders_own_pace(cache):
    run = bench(cache, "--seq-len", "64", "--batch-size", "8", "--step-ms", "0", "--batches", "20")
    assert run.returncode == 0, run.stderr
    out = parsed(run.stdout)
    rate = out["rate"]["value"]
    assert out["verdict"] == f"no step (--step-ms 0): the loader alone gives {rate} batches/s"


@pytest.mark.parametrize("args, message", [
    (["--cache-limit", "1MB"], "--cache-limit bounds the local copies of a remote cache"),
    (["--batches", "1"], "--batches must be >= 2"),
    (["--step-ms", "-1"], "--step-ms -1: give the training step's time in milliseconds"),
    (["--step-ms", "inf"], "--step-ms inf: give the training step's time in milliseconds"),
])
def test_bench_refuses_bad_arguments_in_one_line(cache, args, message):
    run = bench(cache, "--seq-len", "64", "--batch-size", "8", "--step-ms", "5", *args)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("torchcache bench: error: ") and message in run.stderr, run.stderr
    assert len(run.stderr.splitlines()) == 1


@pytest.mark.s3
def test_bench_of_a_remote_cache_counts_requests_and_says_the_gpu_waits(cache, s3, tmp_path):
    """On a moto S3 server, under a cache_limit that holds few blocks: the requests and bytes
    the run cost are printed (as cache.stats() counts them), and against a 10 µs step the loop
    waits for the store."""
    import s3fs
    s3fs.S3FileSystem(**s3).put(cache, "bucket/bench", recursive=True)
    options = [f"--storage-option={key}={json.dumps(value)}" for key, value in s3.items()]
    run = bench("s3://bucket/bench", "--seq-len", "256", "--batch-size", "4", "--step-ms", "0.01",
                "--batches", "40", "--cache-limit", "20000", "--local-dir", str(tmp_path / "copies"),
                *options)
    assert run.returncode == 0, run.stderr
    out = parsed(run.stdout)
    assert out["header"]["url"] == "s3://bucket/bench"
    requests, downloaded = out["requests"], out["downloaded"]
    assert requests is not None and downloaded is not None, run.stdout
    total, whole, ranged = (int(number(requests[k])) for k in ("total", "whole", "ranged"))
    assert total == whole + ranged and ranged > 0  # few blocks fit: samples read by range
    assert number(downloaded["mb"]) > 0
    token_mb = tc.TokenCache(cache).num_tokens * 2 / 1e6  # GPT-2 ids are uint16
    assert number(downloaded["cache_mb"]) == pytest.approx(token_mb, abs=0.05)
    waits = re.match(WAITS, out["verdict"])
    assert waits is not None and waits["step"] == "0.01", run.stdout
