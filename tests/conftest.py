"""Shared fixtures: the real GPT-2 tokenizer and a small real corpus, both from tests/data; one
folder per test run for every temporary file (removed at the end of the run)."""

from __future__ import annotations

import atexit
import contextlib
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
RUN_DIR_VARIABLE = "TORCHCACHE_TEST_RUN_DIR"


def pytest_configure(config) -> None:
    """Point TMPDIR and HOME at one fresh folder for this run, removed when the run's process
    exits: pytest's tmp_path folders, multiprocessing's pymp-*, torchrun's torchelastic_*, Ray's
    session folders and ~/.ray token, remote-copy caches under ~/.cache all land there, so a test
    run leaves /tmp and ~ as it found them. xdist workers and the processes tests start inherit
    the folder (the variable is already set for them); each xdist worker gets its own TMPDIR in it."""
    if os.environ.get(RUN_DIR_VARIABLE):
        worker = getattr(config, "workerinput", {}).get("workerid")
        if worker:
            os.environ["TMPDIR"] = os.path.join(os.environ[RUN_DIR_VARIABLE], worker)
            os.makedirs(os.environ["TMPDIR"], exist_ok=True)
            tempfile.tempdir = None
        return
    run_dir = tempfile.mkdtemp(prefix="tc-test-")  # short: Ray's socket paths (<108 bytes) live below
    home = os.path.join(run_dir, "home")
    os.mkdir(home)
    os.environ.update({RUN_DIR_VARIABLE: run_dir, "TMPDIR": run_dir, "HOME": home})
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    # atexit, registered before multiprocessing.util is imported: runs after multiprocessing has
    # removed its own pymp-* folder, and after pytest and xdist have stopped their workers
    atexit.register(shutil.rmtree, run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def gpt2_tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_bytes(gzip.decompress((DATA / "gpt2-tokenizer.json.gz").read_bytes()))
    return str(path)


@pytest.fixture(scope="session")
def gpt2(gpt2_tokenizer_path):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(gpt2_tokenizer_path)


@pytest.fixture(scope="session")
def chatml_tokenizer_path(gpt2, tmp_path_factory) -> str:
    """GPT-2's tokenizer.json with the ChatML markers <|im_start|> and <|im_end|> added as special
    tokens (a build takes a path)."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_str(gpt2.to_str())
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path = tmp_path_factory.mktemp("chatml-tokenizer") / "tokenizer.json"
    tokenizer.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def books() -> list[dict]:
    with open(DATA / "gutenberg_small.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def paragraphs(books: list[dict], limit: int | None = None) -> list[str]:
    """Real short documents: the books cut at blank lines."""
    out = [p for b in books for p in b["text"].split("\n\n") if p.strip()]
    return out[:limit] if limit else out


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}, ensure_ascii=False) + "\n")
    return str(path)


@pytest.fixture()
def shards(tmp_path, books) -> list[str]:
    """Three real jsonl shards of paragraph documents (about 1,500 documents)."""
    docs = paragraphs(books)
    d = tmp_path / "in"
    d.mkdir()
    return [write_jsonl(d / f"part-{i}.jsonl", docs[i::3]) for i in range(3)]


@contextlib.contextmanager
def moto_s3(bucket: str = "bucket"):
    """A moto S3 server on 127.0.0.1 with one empty bucket (skips the test without moto/s3fs);
    yields the fsspec storage_options that reach it."""
    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    import boto3
    # port 0: the server binds a free port itself, so parallel test workers never race for one
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server.get_host_and_port()[1]
    try:
        endpoint = f"http://127.0.0.1:{port}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=bucket)
        yield {"key": "testing", "secret": "testing",
               "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    finally:
        server.stop()


class FileBytes(bytes):
    """A file's bytes that print as their size and digest: a failed tree comparison then names
    the files that differ in a few lines, not megabytes of bytes."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes, sha256 {hashlib.sha256(self).hexdigest()[:16]}>"


def tree_bytes(root: str) -> dict[str, bytes]:
    """Every file of a cache (but the lock), by relative path, in path order."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name == ".lock":
                continue
            full = os.path.join(dirpath, name)
            out[os.path.relpath(full, root)] = FileBytes(Path(full).read_bytes())
    return dict(sorted(out.items()))


def committed_tree(root) -> dict[str, bytes]:
    """`tree_bytes(root)` but the block files a killed build left uncommitted (a block it was
    still writing in the background, or had written but not yet committed): its leftovers, which
    the next build deletes. What a refused resume must leave untouched."""
    from torchcache.format.ledger import read_manifest

    manifest = read_manifest(str(root))
    committed = {e[k] for e in manifest["blocks"] + manifest.get("pending", [])
                 for k in ("path", "offsets", "keys", "docs") if k in e}
    return {name: data for name, data in tree_bytes(str(root)).items()
            if not name.startswith("blocks/") or name in committed}


def build_killed_at_commit(inputs: list[str], out, tokenizer: str, commits: int, *,
                           workers: int = 1, block_tokens: int = 2_000) -> int:
    """Run `build_cache` in a child process that SIGKILLs itself right after its `commits`-th
    manifest write (the builder's `hooks.kill_after_commits`): an interruption at a known commit
    instead of a race with a timer. Returns the exit code: -9 when it was killed, 0 when the
    build finished before its `commits`-th manifest write."""
    script = ("import torchcache as tc\n"
              "tc.build_cache(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], "
              f"block_tokens={block_tokens}, num_workers={workers}, progress=False)\n")
    command = python_with_hooks(script, json.dumps(inputs), str(out), tokenizer,
                                kill_after_commits=commits)
    return subprocess.run(command, timeout=300).returncode


def as_format_v1(root) -> None:
    """Rewrite a cache in format v1 (everything in one manifest.json), as torchcache before
    format v2 built it: the new code must keep reading such caches."""
    import shutil

    from torchcache.format.ledger import read_manifest
    manifest = read_manifest(str(root))
    manifest["version"] = 1
    manifest.pop("chunk_records", None)
    Path(root, "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    Path(root, "head.json").unlink()
    for folder in ("index", "log"):
        shutil.rmtree(Path(root, folder), ignore_errors=True)


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1 with one bucket, for a test module; yields its storage_options."""
    import logging
    with moto_s3() as options:
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        yield options


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs) for a test module."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False)
    yield ray
    ray.shutdown()


def wait_for_blocks(path, handle, minimum: int = 1):
    """The TokenCache at `path` once a background build (`handle`) has committed `minimum` blocks
    (polling; the build's error, if it fails first)."""
    import time

    import torchcache as tc
    while True:
        assert handle.error is None, handle.error
        try:
            cache = tc.TokenCache(path)
            if cache.num_blocks >= minimum:
                return cache
        except FileNotFoundError:
            pass
        time.sleep(0.01)


def python_with_hooks(code: str, *args: str, **settings) -> list[str]:
    """The command that runs `code` (with `json`, `sys` and `hooks` imported; `sys.argv[1:]` is
    `args`) in a fresh interpreter whose test hooks (`torchcache._util.hooks`) are this process's,
    updated with `settings`: how a hook reaches a process a test starts itself (the package's
    own child processes get their parent's hooks)."""
    from torchcache._util import hooks
    values = json.dumps(dict(hooks.values(), **settings))
    prelude = f"import json, sys\nfrom torchcache._util import hooks\nhooks.apply(json.loads({values!r}))\n"
    return [sys.executable, "-c", prelude + code, *args]


def killed_build_resumes_to_the_same_bytes(code: str, *args: str, root: Path) -> Path:
    """Run the build script `code` (its last argument the output) into root/"whole", and again
    into root/"killed", SIGKILLed after 3 commits and then run once more; assert the resumed
    cache's files equal the uninterrupted one's byte for byte. Returns root/"whole"."""
    def run(out: Path, **hooks) -> subprocess.CompletedProcess:
        return subprocess.run(python_with_hooks(code, *args, str(out), **hooks), capture_output=True,
                              text=True, timeout=300)

    whole = run(root / "whole")
    assert whole.returncode == 0, whole.stderr
    killed = run(root / "killed", kill_after_commits=3)
    assert killed.returncode == -9
    resumed = run(root / "killed")
    assert resumed.returncode == 0, resumed.stderr
    assert tree_bytes(str(root / "killed")) == tree_bytes(str(root / "whole"))
    return root / "whole"


def example_losses(out: Path) -> dict[int, float]:
    """An example training script's losses.jsonl, by step (steps 1, 2, ... with none missing)."""
    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return {r["step"]: r["loss"] for r in rows}


def example_checkpoint(out: Path) -> tuple[int, dict]:
    """An example training script's checkpoint.pt: its step and the loader state it holds."""
    import torch  # (only the example tests need it)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    return ckpt["step"], json.loads(ckpt["loader"])
