"""What a new user meets first (issue 31, "Smaller, seen by the new user"): command-line errors
that name the command line's flags, not Python's arguments; a pre-tokenized build without a
tokenizer; a failed first build that leaves nothing that looks like a cache; a top-level help
that names every command; plain Python ints from the loader's step functions.

The command line runs as a real `torchcache` subprocess; caches are real builds of real files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import paragraphs, write_jsonl

import torchcache as tc

CLI = [sys.executable, "-m", "torchcache"]

# Python's keyword-argument spelling of the library's arguments, as a message would write them
_PYTHON_ARGUMENTS = ("chat_template", "train_on", "input_format", "on_error", "allow_empty",
                     "vocab_size", "keep_fields", "text_key", "block_tokens", "num_workers",
                     "eos_id", "bos_id", "tokenizer=", "eos=", "bos=", "convert_webdataset",
                     "tokenizers.Tokenizer")


def cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, TQDM_DISABLE="1")
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=env)


def one_line_error(done: subprocess.CompletedProcess, command: str) -> str:
    """The single stderr line of a failed command, checked to speak the command line only."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    line = lines[0]
    assert line.startswith(f"torchcache {command}: error: "), line
    leaked = [name for name in _PYTHON_ARGUMENTS  # (a file name like chat_template.jinja is fine)
              if re.search(rf"(?<![\w./-]){re.escape(name)}"
                           + (r"(?![\w-]|\.\w)" if name[-1].isalpha() else ""), line)]
    assert not leaked, f"Python spelling {leaked} in: {line}"
    return line


def write_records(path: Path, records: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture()
def inputs(tmp_path, books) -> dict[str, str]:
    chats = [{"messages": [{"role": "user", "content": p[:80]},
                           {"role": "assistant", "content": p[80:160] or "ok"}]}
             for p in paragraphs(books, 5)]
    (tmp_path / "tok-folder").mkdir()
    return {"text": write_jsonl(tmp_path / "text.jsonl", paragraphs(books, 20)),
            "chat": write_records(tmp_path / "chat.jsonl", chats),
            "tar": str(tmp_path / "none.tar")}


# ---------------------------------------------------------------- errors in the flags' spelling

def test_build_errors_name_the_flags(tmp_path, inputs, gpt2_tokenizer_path):
    out = tmp_path / "out"
    line = one_line_error(cli("build", inputs["text"], "-o", out, "-t", gpt2_tokenizer_path,
                              "--chat-template", "{{ messages }}"), "build")
    assert "--chat-template is for --input-format messages" in line
    # no template beside the tokenizer: the remedy is the flag
    line = one_line_error(cli("build", inputs["chat"], "-o", out, "-t", gpt2_tokenizer_path,
                              "--input-format", "messages"), "build")
    assert "pass --chat-template" in line
    # a template that is not prefix-stable: the remedy names --train-on all
    reversed_template = "{% for m in messages|reverse %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    line = one_line_error(cli("build", inputs["chat"], "-o", out, "-t", gpt2_tokenizer_path,
                              "--input-format", "messages", "--chat-template", reversed_template),
                          "build")
    assert "--train-on all" in line
    line = one_line_error(cli("build", inputs["text"], "-o", out, "-t", gpt2_tokenizer_path,
                              "--vocab-size", "100"), "build")
    assert "--vocab-size" in line
    line = one_line_error(cli("build", inputs["text"], "-o", out, "-t", gpt2_tokenizer_path,
                              "--eos", "<|notatoken|>"), "build")
    assert "--eos '<|notatoken|>' is not a token" in line
    line = one_line_error(cli("build", inputs["text"], "-o", out, "-t", tmp_path / "missing.json"),
                          "build")
    assert "missing.json" in line
    # no tokenizer for text: what to give, in flags
    line = one_line_error(cli("build", inputs["text"], "-o", out), "build")
    assert "--tokenizer is required" in line and "--input-format tokens" in line
    assert "torchcache convert-webdataset" in line
    assert not out.exists()


def test_warnings_are_one_line_in_the_commands_voice(tmp_path, inputs, gpt2_tokenizer_path):
    """A warning (here: role markers that are not single tokens of GPT-2) is shown as the
    command's own line, not as Python's `cli.py:NN: UserWarning:` with a line of source."""
    template = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}"
                "{% endif %}\n{% endfor %}")
    done = cli("build", inputs["chat"], "-o", tmp_path / "out", "-t", gpt2_tokenizer_path,
               "--input-format", "messages", "--chat-template", template)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines and all(line.startswith("torchcache build: warning: ") for line in lines), lines
    assert "UserWarning" not in done.stderr and "build_cache(" not in done.stderr


def test_convert_errors_name_the_flags(tmp_path, inputs, gpt2_tokenizer_path):
    line = one_line_error(cli("convert-webdataset", inputs["tar"], "-o", tmp_path / "out",
                              "-t", gpt2_tokenizer_path, "--vocab-size", "100"),
                          "convert-webdataset")
    assert "--vocab-size" in line and "without --tokenizer" in line


def test_reading_commands_name_the_flags(tmp_path, inputs, gpt2_tokenizer_path):
    cache = tmp_path / "cache"
    assert cli("build", inputs["text"], "-o", cache, "-t", gpt2_tokenizer_path).returncode == 0
    tokens = tc.TokenCache(cache).num_tokens
    line = one_line_error(cli("trace", cache, "--step", "0", "--seq-len", tokens + 10,
                              "--batch-size", "2"), "trace")
    assert f"--seq-len {tokens + 10} is too long" in line and "seq_len" not in line
    line = one_line_error(cli("trace", cache, "--step", "0", "--seq-len", "8", "--batch-size", "2",
                              "--seed", "-1"), "trace")
    assert line.endswith("--seed must be >= 0, got -1")
    line = one_line_error(cli("pack", cache, "--seq-len", "0"), "pack")
    assert "--seq-len must be >= 1" in line
    # a folder that is not a cache: said so, no Python errno, no lock file left in it
    (tmp_path / "folder").mkdir()
    line = one_line_error(cli("upgrade", tmp_path / "folder"), "upgrade")
    assert "is not a torchcache cache" in line and "Errno" not in line
    assert os.listdir(tmp_path / "folder") == []
    line = one_line_error(cli("upgrade", tmp_path / "nowhere"), "upgrade")
    assert "is not a torchcache cache" in line and "Errno" not in line


def test_python_keeps_its_own_spelling(tmp_path, inputs, gpt2_tokenizer_path):
    """The library's messages are for Python callers: only the command line respells them."""
    with pytest.raises(ValueError, match=r"chat_template is for input_format='messages'"):
        tc.build_cache(inputs["text"], tmp_path / "out", gpt2_tokenizer_path, chat_template="x",
                       progress=False)


# ---------------------------------------------------------------- pre-tokenized without -t

TOKEN_RECORDS = [{"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8]},
                 {"input_ids": [900, 10], "loss_mask": [1, 0]},
                 {"input_ids": [11, 12, 13], "labels": [-100, -100, 13]}]


def test_build_pre_tokenized_records_without_a_tokenizer(tmp_path):
    src = write_records(tmp_path / "tokens.jsonl", TOKEN_RECORDS)
    done = cli("build", src, "-o", tmp_path / "cli", "--input-format", "tokens",
               "--vocab-size", "1000", "--eos", "999")
    assert done.returncode == 0, done.stderr
    cache = tc.TokenCache(tmp_path / "cli")
    assert cache.complete and cache.spec["tokenizer"] is None
    assert cache.vocab_size == 1000 and cache.spec["dtype"] == "U16"
    for i, record in enumerate(TOKEN_RECORDS):
        assert cache.document(i).tolist() == record["input_ids"] + [999]
        mask = record.get("loss_mask") or [int(x != -100) for x in record["labels"]]
        assert cache.document_loss_mask(i).tolist() == [bool(m) for m in mask] + [bool(mask[-1])]
    # the same cache as the Python call
    python = tc.build_cache(src, tmp_path / "py", None, input_format="tokens", vocab_size=1000,
                            eos=999, progress=False)
    assert python.fingerprint == cache.fingerprint
    # without --eos: the records as given, as build_cache's default does without a tokenizer
    done = cli("build", src, "-o", tmp_path / "plain", "--input-format", "tokens",
               "--vocab-size", "1000")
    assert done.returncode == 0, done.stderr
    plain = tc.TokenCache(tmp_path / "plain")
    assert [plain.document(i).tolist() for i in range(3)] == [r["input_ids"] for r in TOKEN_RECORDS]
    python = tc.build_cache(src, tmp_path / "py-plain", None, input_format="tokens",
                            vocab_size=1000, progress=False)
    assert python.fingerprint == plain.fingerprint
    shown = cli("show", tmp_path / "plain", "-d", "1", "--no-mask")
    assert shown.returncode == 0 and shown.stdout.split() == ["900", "10"], shown
    # an id outside --vocab-size names the record
    bad = write_records(tmp_path / "bad.jsonl", [{"input_ids": [1, 2000], "loss_mask": [1, 1]}])
    line = one_line_error(cli("build", bad, "-o", tmp_path / "bad", "--input-format", "tokens",
                              "--vocab-size", "1000"), "build")
    assert "bad.jsonl:1" in line
    # a token string needs a tokenizer to look it up
    line = one_line_error(cli("build", src, "-o", tmp_path / "named", "--input-format", "tokens",
                              "--eos", "</s>"), "build")
    assert "--eos '</s>'" in line and "token id" in line


# ---------------------------------------------------------------- a failed first build

def test_a_failed_first_build_leaves_nothing_that_looks_like_a_cache(tmp_path, inputs,
                                                                       gpt2_tokenizer_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "cli"
    line = one_line_error(cli("build", empty, "-o", out, "-t", gpt2_tokenizer_path), "build")
    assert "empty cache" in line and "--allow-empty" in line
    assert not out.exists()
    info = cli("info", out)
    assert info.returncode == 2 and "not a torchcache cache" in info.stderr
    with pytest.raises(tc.BuildError, match="empty cache"):
        tc.build_cache(str(empty), tmp_path / "py", gpt2_tokenizer_path, progress=False)
    assert not (tmp_path / "py").exists()
    # a folder the user made: it stays, empty as it was
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(tc.BuildError, match="empty cache"):
        tc.build_cache(str(empty), mine, gpt2_tokenizer_path, progress=False)
    assert mine.is_dir() and os.listdir(mine) == []
    # a bad first record: nothing committed, nothing left
    bad = write_records(tmp_path / "bad.jsonl", [{"body": "no text field"}])
    with pytest.raises(tc.InputError, match="bad.jsonl:1"):
        tc.build_cache(bad, tmp_path / "bad", gpt2_tokenizer_path, progress=False)
    assert not (tmp_path / "bad").exists()
    # a folder the build refuses (not a cache): the user's file stays, nothing of ours is added
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    one_line_error(cli("build", inputs["text"], "-o", theirs, "-t", gpt2_tokenizer_path), "build")
    assert sorted(os.listdir(theirs)) == ["notes.txt"]
    assert (theirs / "notes.txt").read_text() == "keep me"
    # a build that completes but is refused (a chat template that trains nothing): its blocks
    # were committed, but what it made is not a cache to use: nothing stays
    refused = tmp_path / "refused"
    one_line_error(cli("build", inputs["chat"], "-o", refused, "-t", gpt2_tokenizer_path,
                       "--input-format", "messages", "--chat-template", "{{ messages[0].content }}",
                       "--block-tokens", "8"), "build")
    assert not refused.exists()
    # the same build with --allow-empty then makes an empty cache, from scratch
    done = cli("build", empty, "-o", out, "-t", gpt2_tokenizer_path, "--allow-empty")
    assert done.returncode == 0 and "already complete" not in done.stdout, done


def test_a_first_build_that_committed_blocks_keeps_them_and_says_it_is_unfinished(
        tmp_path, books, gpt2_tokenizer_path):
    docs = [{"text": p} for p in paragraphs(books, 200)] + [{"body": "no text"}]
    src = write_records(tmp_path / "late.jsonl", docs)
    out = tmp_path / "cache"
    with pytest.raises(tc.InputError, match="late.jsonl:201"):
        tc.build_cache(src, out, gpt2_tokenizer_path, block_tokens=500, num_workers=1,
                       progress=False)
    cache = tc.TokenCache(out)
    assert cache.num_blocks > 0 and not cache.complete  # committed work is kept, to resume
    info = cli("info", out)
    assert info.returncode == 0 and "(interrupted: rerun the same build" in info.stdout
    assert "(complete)" not in info.stdout


# ---------------------------------------------------------------- help

def test_top_level_help_names_every_command():
    done = cli("--help")
    assert done.returncode == 0
    commands = re.search(r"\{([a-z,-]+)\}", done.stdout).group(1).split(",")
    assert "trace" in commands and "show" in commands
    prose = " ".join(done.stdout.split("positional arguments:")[0].split())
    named = prose.split("The `torchcache` command line:")[1].split(".")[0]
    missing = [c for c in commands if not re.search(rf"(?<![\w-]){re.escape(c)}(?![\w-])", named)]
    assert not missing, f"not named in the help's first sentence: {missing} ({named!r})"
    for command in commands:  # and each has its own help
        assert cli(command, "--help").returncode == 0


# ---------------------------------------------------------------- plain ints

def _plain(value, where: str) -> None:
    """Every number in `value` (nested dicts and lists) is a Python int, float or bool."""
    if isinstance(value, dict):
        for k, v in value.items():
            _plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]")
    elif value is not None and not isinstance(value, str):
        assert type(value) in (int, float, bool), f"{where} is {type(value).__name__}"


def test_step_functions_return_python_ints(tmp_path, books, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "docs.jsonl", paragraphs(books, 40))
    tc.build_cache(src, tmp_path / "cache", gpt2_tokenizer_path, keep_fields=("text",),
                   progress=False)
    cache = tc.TokenCache(tmp_path / "cache")
    ds = tc.TokenDataset(cache, 16)
    loader = tc.DataLoader(ds, batch_size=3, shuffle=True, seed=0)
    samples = loader.step_samples(2)
    assert len(samples) == 3 and all(type(x) is int for x in samples), [type(x) for x in samples]
    batches = iter(loader)
    next(batches), next(batches)
    first = next(batches)["input_ids"]
    assert [ds[i]["input_ids"].tolist() for i in samples] == first.tolist()
    json.dumps(samples)  # plain ints serialise
    for index in samples:
        _plain(ds.sample_documents(index), "sample_documents")
    _plain(cache.document_info(3), "document_info")
    traced = tc.trace_step(loader, 2)
    _plain(traced, "trace_step")
    assert [s["sample"] for s in traced] == samples
    mix = tc.MixtureDataset({"a": ds, "b": tc.TokenDataset(cache, 16)},
                            weights={"a": 0.5, "b": 0.5}, seed=0)
    mixed = tc.DataLoader(mix, batch_size=4, shuffle=True, seed=1)
    assert all(type(x) is int for x in mixed.step_samples(5))
    _plain(tc.trace_step(mixed, 5), "trace_step (mixture)")
    assert isinstance(np.asarray(samples), np.ndarray)  # still an easy numpy array


@pytest.mark.s3
def test_a_failed_first_build_on_an_object_store_leaves_nothing(tmp_path, s3, books,
                                                                gpt2_tokenizer_path):
    import s3fs
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(tc.BuildError, match="empty cache"):
        tc.build_cache(str(empty), "s3://bucket/failed", gpt2_tokenizer_path, storage_options=s3,
                       progress=False)
    fs = s3fs.S3FileSystem(**s3)
    fs.invalidate_cache()
    assert fs.find("bucket/failed") == []  # no manifest, head, tokenizer or lease left
    # one that committed blocks keeps them there, unfinished
    docs = [{"text": p} for p in paragraphs(books, 200)] + [{"body": "no text"}]
    src = write_records(tmp_path / "late.jsonl", docs)
    with pytest.raises(tc.InputError, match="late.jsonl:201"):
        tc.build_cache(src, "s3://bucket/late", gpt2_tokenizer_path, storage_options=s3,
                       block_tokens=500, num_workers=1, progress=False)
    cache = tc.TokenCache("s3://bucket/late", storage_options=s3, local_dir=str(tmp_path / "copies"))
    assert cache.num_blocks > 0 and not cache.complete


def test_trace_refuses_a_world_size_or_word_count_out_of_range(tmp_path, inputs,
                                                                gpt2_tokenizer_path):
    """--world-size 0 used to become 1 silently, and --words -1 was taken: both refused, naming
    the flag."""
    cache = tmp_path / "cache"
    assert cli("build", inputs["text"], "-o", cache, "-t", gpt2_tokenizer_path).returncode == 0
    trace = ("trace", cache, "--step", "0", "--seq-len", "8", "--batch-size", "2")
    line = one_line_error(cli(*trace, "--world-size", "0"), "trace")
    assert line.endswith("--world-size must be >= 1, got 0")
    line = one_line_error(cli(*trace, "--words", "-1"), "trace")
    assert line.endswith("--words must be >= 0, got -1")
    line = one_line_error(cli(*trace, "--batch-size", "0"), "trace")
    assert line.endswith("--batch-size must be >= 1, got 0")
    done = cli(*trace, "--world-size", "2", "--words", "0", "--json")
    assert done.returncode == 0, done.stderr
    traced = json.loads(done.stdout)
    assert traced["world_size"] == 2 and len(traced["samples"]) == 4
    assert all(piece["text"] == "" for s in traced["samples"] for piece in s["documents"])


def test_convert_of_a_file_that_is_not_a_tar_names_what_convert_reads(tmp_path, inputs,
                                                                       gpt2_tokenizer_path):
    """convert-webdataset on JSON lines used to suggest --input-format tokens, a flag it lacks."""
    for tokenizer in ((), ("-t", gpt2_tokenizer_path)):
        line = one_line_error(cli("convert-webdataset", inputs["text"], "-o", tmp_path / "out",
                                  *tokenizer), "convert-webdataset")
        assert "--input-format" not in line, line
        assert f"{inputs['text']} is a JSON lines file, not a webdataset tar" in line
        assert "`torchcache build`" in line
    line = one_line_error(cli("convert-webdataset", f"pipe:cat {inputs['text']}", "-o",
                              tmp_path / "out"), "convert-webdataset")
    assert "is a JSON lines file, not a webdataset tar" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="not a webdataset tar.*build them with build_cache"):
        tc.convert_webdataset(inputs["text"], tmp_path / "out", vocab_size=100)
