"""The command line as a new user meets it (issue 21, items 14-16): remote caches and inputs
through `--storage-option`, their errors in one line, remote caches named by their URL, and
output that says what is true.

Everything runs the real `torchcache` command in a subprocess, against a real moto S3 server on
loopback (through s3fs) and real caches built from the bundled Gutenberg paragraphs. The
subprocesses never see this machine's AWS credentials or configuration.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import paragraphs, write_jsonl

import torchcache as tc
from torchcache.builder.engine import default_workers

CLI = [sys.executable, "-m", "torchcache"]
BLOCK = 2_000


def user_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment without any AWS credential, profile or config file, and without a
    progress bar (unless `extra` sets TQDM_DISABLE)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_CONFIG_FILE=str(tmp_path / "no-aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "no-aws-credentials"),
               AWS_EC2_METADATA_DISABLED="true", TQDM_DISABLE="1",
               TORCHCACHE_LOCAL_DIR=str(tmp_path / "default-local-dir"))
    env.update(extra)
    return env


def cli(tmp_path: Path, *args, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=user_env(tmp_path, **env))


def storage_options(options: dict) -> list[str]:
    """`options` as the command line takes them: one --storage-option KEY=VALUE each."""
    out = []
    for key, value in options.items():
        out += ["--storage-option", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return out


def one_line_error(done: subprocess.CompletedProcess, command: str) -> str:
    """The single stderr line of a failed command (no traceback, no stale output)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"torchcache {command}: error: "), lines[0]
    return lines[0]


def on_a_terminal(tmp_path: Path, *args) -> tuple[int, str, list[str]]:
    """Run a command with its progress bar on: (exit code, stderr as written, the non-blank
    lines a terminal shows of it)."""
    done = subprocess.run([*CLI, *map(str, args)], capture_output=True, timeout=300,
                          env=user_env(tmp_path, TQDM_DISABLE=""))
    stderr = done.stderr.decode()  # not text=True, which turns each carriage return into a newline
    return done.returncode, stderr, visible_lines(stderr)


def visible_lines(stream: str) -> list[str]:
    """The non-blank lines a terminal shows for `stream`: a carriage return moves back to the
    start of the line, and what follows overwrites what was there."""
    lines = []
    for raw in stream.split("\n"):
        screen = ""
        for part in raw.split("\r"):
            screen = part + screen[len(part):]
        if screen.strip():
            lines.append(screen.rstrip())
    return lines


# ---------------------------------------------------------------- a remote cache on S3 (moto)

@pytest.fixture(scope="module")
def remote(tmp_path_factory, books, gpt2_tokenizer_path, s3):
    """A small cache built locally and uploaded to s3://bucket/cache, its inputs uploaded to
    s3://bucket/inputs/, and two webdataset shards to s3://bucket/shards/; yields the local cache."""
    import s3fs
    root = tmp_path_factory.mktemp("trust_cli")
    docs = paragraphs(books, 600)
    inputs = [write_jsonl(root / f"in{i}.jsonl", docs[i::2]) for i in range(2)]
    tc.build_cache(inputs, root / "cache", gpt2_tokenizer_path, block_tokens=BLOCK,
                   num_workers=1, progress=False)
    fs = s3fs.S3FileSystem(**s3)
    fs.put(str(root / "cache"), "bucket/cache", recursive=True)
    for path in inputs:
        fs.put(path, f"bucket/inputs/{Path(path).name}")
    for shard in range(2):
        fs.pipe_file(f"bucket/shards/s-{shard}.tar", webdataset_shard(docs[shard * 10:shard * 10 + 10]))
    return tc.TokenCache(root / "cache")


def webdataset_shard(texts: list[str]) -> bytes:
    """A webdataset tar: one sample per text, its `txt` member holding the text."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for i, text in enumerate(texts):
            data = text.encode()
            member = tarfile.TarInfo(f"sample{i:04d}.txt")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.s3
def test_storage_options_reach_build_info_show_and_verify(tmp_path, remote, s3, gpt2_tokenizer_path):
    opts = storage_options(s3)
    url = "s3://bucket/built"
    done = cli(tmp_path, "build", "s3://bucket/inputs/*.jsonl", "-o", url, "-t", gpt2_tokenizer_path,
               "--block-tokens", BLOCK, "-j", 1, *opts)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{url}: {remote.num_tokens:,} tokens, "), done.stdout
    built = tc.TokenCache(url, storage_options=s3, local_dir=str(tmp_path / "python"))
    assert (built.read(0, built.num_tokens) == remote.read(0, remote.num_tokens)).all()
    copy = str(tmp_path / "copies" / built.fingerprint)

    info = cli(tmp_path, "info", url, "--json", "--local-dir", tmp_path / "copies", *opts)
    assert info.returncode == 0, info.stderr
    fields = json.loads(info.stdout)
    assert (fields["path"], fields["local_copy"]) == (url, copy)
    assert (fields["tokens"], fields["documents"]) == (remote.num_tokens, remote.num_documents)

    info = cli(tmp_path, "info", url, "--local-dir", tmp_path / "copies", *opts)
    assert info.returncode == 0, info.stderr
    lines = info.stdout.splitlines()
    assert lines[0] == f"{url}  (complete)"
    assert f"  local copy {copy}" in lines
    assert not any(line.startswith(copy) for line in lines)

    shown = cli(tmp_path, "show", url, "-d", 1, "--local-dir", tmp_path / "copies", *opts)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout == remote.decode(remote.document(1)) + "\n"
    assert shown.stderr == f"{url} (local copy {copy})\n"

    verified = cli(tmp_path, "verify", url, "--local-dir", tmp_path / "copies", *opts)
    assert verified.returncode == 0, verified.stderr
    assert verified.stdout.splitlines() == [f"{url}: all checksums match", f"  local copy {copy}"]
    assert not (tmp_path / "default-local-dir").exists()  # --local-dir was used, every time


@pytest.mark.s3
def test_storage_options_reach_pack_upgrade_mix_plan_and_convert(tmp_path, remote, s3,
                                                                  gpt2_tokenizer_path):
    opts = storage_options(s3)
    local = ["--local-dir", tmp_path / "copies"]
    packed = cli(tmp_path, "pack", "s3://bucket/cache", "--seq-len", 64, "--plan-dir",
                 tmp_path / "plans", *local, *opts)
    assert packed.returncode == 0, packed.stderr
    assert packed.stdout.startswith("pack plan of s3://bucket/cache\n")
    expected_rows = tc.PackedDataset(remote, 64, plan_dir=str(tmp_path / "local-plans"))
    assert f"  rows       {len(expected_rows):,}" in packed.stdout.splitlines()

    upgraded = cli(tmp_path, "upgrade", "s3://bucket/cache", *opts)
    assert (upgraded.returncode, upgraded.stdout) == (0, "s3://bucket/cache: already in format v2\n")

    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"seq_len": 64, "samples": 100, "weights": {"web": 1},
                                  "sources": {"web": {"path": "s3://bucket/cache"}}}))
    planned = cli(tmp_path, "mix", "plan", recipe, "--json", *local, *opts)
    assert planned.returncode == 0, planned.stderr
    (source,) = json.loads(planned.stdout)["sources"]
    assert source["samples"] == (remote.num_tokens - 1) // 64

    converted = cli(tmp_path, "convert-webdataset", "s3://bucket/shards/s-{0..1}.tar", "-o",
                    "s3://bucket/wds", "-t", gpt2_tokenizer_path, *opts)
    assert converted.returncode == 0, converted.stderr
    assert converted.stdout.startswith("s3://bucket/wds: ")
    wds = tc.TokenCache("s3://bucket/wds", storage_options=s3, local_dir=str(tmp_path / "python"))
    assert wds.num_documents == 20


def test_a_storage_option_must_be_key_equals_value(tmp_path):
    done = cli(tmp_path, "info", "s3://bucket/cache", "--storage-option", "anon")
    assert done.returncode == 2
    assert "--storage-option: 'anon': give KEY=VALUE" in done.stderr
    done = cli(tmp_path, "info", "s3://bucket/cache", "--storage-option", "key=a",
               "--storage-option", "key=b")
    assert "--storage-option key is given twice" in one_line_error(done, "info")


@pytest.mark.s3
def test_missing_credentials_are_one_line_naming_the_url(tmp_path, remote, s3, gpt2_tokenizer_path):
    endpoint = storage_options({"client_kwargs": s3["client_kwargs"]})  # no key, no secret
    local_input = tmp_path / "docs.jsonl"
    write_jsonl(local_input, ["a document", "another"])
    commands = [("info", "s3://bucket/cache"), ("verify", "s3://bucket/cache"),
                ("show", "s3://bucket/cache", "-d", 0), ("upgrade", "s3://bucket/cache"),
                ("pack", "s3://bucket/cache", "--seq-len", 64),
                ("build", "s3://bucket/inputs/*.jsonl", "-o", tmp_path / "out", "-t", gpt2_tokenizer_path),
                ("build", local_input, "-o", "s3://bucket/new", "-t", gpt2_tokenizer_path)]
    for command, *args in commands:
        line = one_line_error(cli(tmp_path, command, *args, *endpoint), command)
        url = next(a for a in args if str(a).startswith("s3://"))
        assert f": error: {url}: no credentials for the store" in line, line
        assert ("pass them with --storage-option key=ACCESS_KEY --storage-option "
                "secret=SECRET_KEY, or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY") in line
    assert not (tmp_path / "out").exists()


@pytest.mark.s3
def test_wrong_credentials_are_refused_in_one_line(tmp_path, remote, s3, gpt2_tokenizer_path):
    """With the server checking signatures (moto's IAM authentication): a real user's key works,
    a wrong secret or an unknown key is one line naming the URL."""
    import boto3
    from moto.core.authorization import enable_iam_authentication
    iam = boto3.client("iam", endpoint_url=s3["client_kwargs"]["endpoint_url"],
                       region_name="us-east-1", aws_access_key_id="testing",
                       aws_secret_access_key="testing")
    iam.create_user(UserName="trainer")
    iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    right = {**s3, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
    with enable_iam_authentication():
        done = cli(tmp_path, "info", "s3://bucket/cache", *storage_options(right))
        assert done.returncode == 0, done.stderr
        for wrong in ({**right, "secret": "not-the-secret"}, {**right, "key": "AKIANOSUCHKEY"}):
            for command, *args in [("info", "s3://bucket/cache"),
                                   ("build", "s3://bucket/inputs/*.jsonl", "-o", tmp_path / "out",
                                    "-t", gpt2_tokenizer_path)]:
                line = one_line_error(cli(tmp_path, command, *args, *storage_options(wrong)), command)
                url = next(a for a in args if str(a).startswith("s3://"))
                assert f": error: {url}: the store refused the credentials (" in line, line
                assert "--storage-option key=ACCESS_KEY --storage-option secret=SECRET_KEY" in line


@pytest.mark.s3
def test_a_missing_bucket_is_named(tmp_path, remote, s3, gpt2_tokenizer_path):
    import boto3
    opts = storage_options(s3)
    local_input = tmp_path / "docs.jsonl"
    write_jsonl(local_input, ["a document", "another"])
    commands = [("info", "s3://nobucket/cache"), ("verify", "s3://nobucket/cache"),
                ("show", "s3://nobucket/cache", "-d", 0), ("upgrade", "s3://nobucket/cache"),
                ("pack", "s3://nobucket/cache", "--seq-len", 64),
                ("build", "s3://nobucket/inputs/*.jsonl", "-o", tmp_path / "out", "-t", gpt2_tokenizer_path),
                ("build", local_input, "-o", "s3://nobucket/new", "-t", gpt2_tokenizer_path)]
    for command, *args in commands:
        line = one_line_error(cli(tmp_path, command, *args, *opts), command)
        url = next(a for a in args if str(a).startswith("s3://"))
        assert f": error: {url}: bucket 'nobucket' does not exist" in line, line
    buckets = boto3.client("s3", endpoint_url=s3["client_kwargs"]["endpoint_url"], region_name="us-east-1",
                           aws_access_key_id="testing", aws_secret_access_key="testing").list_buckets()
    assert [b["Name"] for b in buckets["Buckets"]] == ["bucket"]  # no build created one


# ---------------------------------------------------------------- output that says what is true

def test_one_document_in_one_block_is_singular(tmp_path, gpt2_tokenizer_path):
    docs = write_jsonl(tmp_path / "one.jsonl", ["a single short document"])
    done = cli(tmp_path, "build", docs, "-o", tmp_path / "cache", "-t", gpt2_tokenizer_path)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first.endswith(" tokens, 1 document, 1 block; skipped: none"), first


def test_workers_help_gives_the_real_default(tmp_path):
    for command in ("build", "convert-webdataset"):
        text = " ".join(cli(tmp_path, command, "--help").stdout.split())
        assert "all cores" not in text
        assert (f"(default: the CPUs this process may use, {default_workers()} here; at most "
                "one per input file)") in text, text


def test_a_missing_input_names_no_python_only_remedy(tmp_path, gpt2_tokenizer_path):
    done = cli(tmp_path, "build", tmp_path / "missing.jsonl", "-o", tmp_path / "c", "-t",
               gpt2_tokenizer_path)
    line = one_line_error(done, "build")
    assert line.endswith(f"input {str(tmp_path / 'missing.jsonl')!r} does not exist"), line


def test_a_failed_build_leaves_no_progress_bar_above_its_error(tmp_path, books, gpt2_tokenizer_path):
    docs = tmp_path / "docs.jsonl"
    write_jsonl(docs, paragraphs(books, 200))
    with open(docs, "a", encoding="utf-8") as f:
        f.write("{not json\n")
    code, stderr, lines = on_a_terminal(tmp_path, "build", docs, "-o", tmp_path / "c", "-t",
                                        gpt2_tokenizer_path, "-j", 1)
    assert code == 2
    assert "tokenizing" in stderr  # the bar was drawn ...
    assert len(lines) == 1, lines  # ... and is gone: only the error is left on screen
    line = lines[0]
    assert line.startswith("torchcache build: error: ") and ":201" in line, line


def test_a_failed_pack_leaves_no_progress_bar_above_its_error(tmp_path, books, gpt2_tokenizer_path):
    docs = write_jsonl(tmp_path / "docs.jsonl", paragraphs(books, 200))
    tc.build_cache(docs, tmp_path / "c", gpt2_tokenizer_path, block_tokens=BLOCK, progress=False)
    (tmp_path / "a-file").write_text("not a directory")
    code, stderr, lines = on_a_terminal(tmp_path, "pack", tmp_path / "c", "--seq-len", 64,
                                        "--plan-dir", tmp_path / "a-file")
    assert code == 2
    assert "planning" in stderr
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("torchcache pack: error: ") and "--plan-dir" in line, line

