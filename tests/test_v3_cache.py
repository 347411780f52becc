"""Format v3 caches (chat, instruction and pre-tokenized records, kept fields) under the tools
that guard a cache: `verify` checks every documents sidecar, `verify --repair` rebuilds a damaged
one byte for byte, `upgrade` leaves a v3 cache alone, a chat build killed with SIGKILL resumes to
the bytes of an uninterrupted one, and the command line builds, describes and shows such caches.

Real GPT-2 tokenizer (with ChatML's two special tokens added), real conversations made of the
bundled Gutenberg paragraphs, JSON lines files on disk, real `torchcache` subprocesses.
"""

from __future__ import annotations

import json
import os
import pty
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import paragraphs, python_with_hooks, tree_bytes

import torchcache as tc
from torchcache.format.ledger import RECORD

CLI = [sys.executable, "-m", "torchcache"]
BLOCK = 600
OPEN, CLOSE = "\u27e6", "\u27e7"  # how `show` marks untrained tokens when stdout is not a terminal

# ChatML, assistant content and its end-of-turn token trained ({% generation %} spans)
TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- generation -%}{{- m['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- m['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}")


@pytest.fixture(scope="module")
def chat_tokenizer(chatml_tokenizer_path) -> str:
    return chatml_tokenizer_path


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return str(path)


def write_chats(folder: Path, books: list[dict], files: int, per_file: int) -> list[str]:
    """`files` JSON lines files of conversations (one or two exchanges, real paragraphs), each
    record with an "id" and a "url" beside its messages."""
    docs = paragraphs(books)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for f in range(files):
        path = folder / f"chats-{f}.jsonl"
        with open(path, "w", encoding="utf-8") as out:
            for r in range(per_file):
                k = (f * per_file + r) * 4
                messages = [{"role": "user", "content": docs[k % len(docs)][:200]},
                            {"role": "assistant", "content": docs[(k + 1) % len(docs)]}]
                if r % 3 == 0:
                    messages += [{"role": "user", "content": docs[(k + 2) % len(docs)][:80]},
                                 {"role": "assistant", "content": docs[(k + 3) % len(docs)][:300]}]
                record = {"messages": messages, "id": f"c{f}-{r}", "url": f"https://x.example/{k}"}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
        paths.append(str(path))
    return paths


def cli(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, TQDM_DISABLE="1")
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=env)


def chat_build(inputs, out, tokenizer: str, template: str, **options) -> tc.BuildResult:
    options = {"block_tokens": BLOCK, "num_workers": 1, "progress": False, **options}
    return tc.build_cache(inputs, out, tokenizer, input_format="messages", chat_template=template,
                          keep_fields=["id"], **options)


@pytest.fixture(scope="module")
def chat_cache(tmp_path_factory, books, chat_tokenizer, template_file):
    """A chat cache of two JSON lines files, several blocks each (read only: tests copy it)."""
    root = tmp_path_factory.mktemp("chat")
    inputs = write_chats(root / "in", books, files=2, per_file=40)
    result = chat_build(inputs, root / "cache", chat_tokenizer, template_file)
    assert result.num_blocks >= 6
    return str(root / "cache")


def copy_of(cache: str, tmp_path: Path) -> str:
    out = str(tmp_path / "cache")
    shutil.copytree(cache, out)
    return out


# ---------------------------------------------------------------- verify and repair

def test_a_chat_cache_is_v3_and_verifies(chat_cache):
    manifest = json.loads(Path(chat_cache, "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["spec"]["documents"]["input_format"] == "messages"
    sidecars = sorted(p.name for p in Path(chat_cache, "blocks").glob("*.docs.safetensors"))
    assert len(sidecars) == tc.TokenCache(chat_cache).num_blocks
    assert tc.check_cache(chat_cache) == []
    done = cli("verify", chat_cache)
    assert done.returncode == 0 and "all checksums match" in done.stdout, done.stderr


def test_damaged_sidecars_are_reported_by_name_and_repaired_to_the_same_bytes(chat_cache, tmp_path):
    out = copy_of(chat_cache, tmp_path)
    before = tree_bytes(out)
    blocks = Path(out, "blocks")
    flipped = blocks / "000000-000001.docs.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (blocks / "000001-000000.docs.safetensors").unlink()
    tokens = blocks / "000001-000001.safetensors"
    tokens.write_bytes(tokens.read_bytes()[:-2])

    damaged = {"blocks/000000-000001.docs.safetensors", "blocks/000001-000000.docs.safetensors",
               "blocks/000001-000001.safetensors"}
    assert {p.file for p in tc.check_cache(out)} == damaged
    done = cli("verify", out)
    assert done.returncode == 1
    for rel in damaged:
        assert rel in done.stderr, done.stderr
    assert "--repair" in done.stderr

    repaired = cli("verify", "--repair", out)
    assert repaired.returncode == 0, repaired.stderr
    assert {line.removeprefix("rebuilt ") for line in repaired.stdout.splitlines()
            if line.startswith("rebuilt ")} == damaged
    assert tree_bytes(out) == before
    assert cli("verify", out).returncode == 0


def test_a_lost_head_of_a_chat_cache_is_restored(chat_cache, tmp_path):
    out = copy_of(chat_cache, tmp_path)
    before = tree_bytes(out)
    Path(out, "head.json").unlink()
    result = tc.repair_cache(out)
    assert result.repaired == ["head.json"]
    assert tree_bytes(out) == before


def test_a_sidecar_that_does_not_fit_its_block_is_reported(chat_cache, tmp_path):
    """A sidecar whose checksum the index vouches for but that holds another block's documents
    (an edited cache, or a writer's bug): verify checks its content against the block."""
    out = copy_of(chat_cache, tmp_path)
    index = Path(out, "index", "000000.bin")
    records = np.frombuffer(index.read_bytes(), dtype=RECORD).copy()
    a, b = next((a, b) for a in range(len(records)) for b in range(len(records))
                if records["num_documents"][a] != records["num_documents"][b])
    table = tc.TokenCache(out).block_table
    shutil.copyfile(Path(out, table.docs_path(b)), Path(out, table.docs_path(a)))
    records["keys_checksum"][a] = records["keys_checksum"][b]
    index.write_bytes(records.tobytes())
    problems = tc.check_cache(out)
    assert [p.file for p in problems] == [table.docs_path(a)]
    assert "records holds" in problems[0].message and "corrupted" in problems[0].message


@pytest.mark.parametrize("options", [
    {"input_format": "text", "keep_fields": ["id"]},  # v3 only for its kept fields: no mask
    {"input_format": "prompt_completion"},
], ids=["text-kept-fields", "prompt-completion"])
def test_other_v3_formats_repair_their_sidecars_too(tmp_path, books, gpt2_tokenizer_path, options):
    docs = paragraphs(books, 200)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": k, "text": docs[k], "prompt": docs[k][:50],
                                          "completion": docs[k + 1]}) + "\n" for k in range(120)))
    out = str(tmp_path / "cache")
    tc.build_cache(str(inputs), out, gpt2_tokenizer_path, block_tokens=BLOCK, num_workers=1,
                   progress=False, **options)
    before = tree_bytes(out)
    sidecar = Path(out, "blocks", "000000-000002.docs.safetensors")
    sidecar.unlink()
    assert [p.file for p in tc.check_cache(out)] == ["blocks/000000-000002.docs.safetensors"]
    assert tc.repair_cache(out).repaired == ["blocks/000000-000002.docs.safetensors"]
    assert tree_bytes(out) == before


def test_upgrade_leaves_a_v3_cache_as_it_is(chat_cache, tmp_path):
    out = copy_of(chat_cache, tmp_path)
    before = tree_bytes(out)
    done = cli("upgrade", out)
    assert (done.returncode, done.stdout) == (0, f"{out}: already in format v3\n"), done.stderr
    assert tree_bytes(out) == before


# ---------------------------------------------------------------- kill -9 and resume

@pytest.mark.slow
def test_a_chat_build_killed_mid_way_resumes_to_the_same_bytes(tmp_path, books, chat_tokenizer,
                                                                template_file):
    inputs = write_chats(tmp_path / "in", books, files=4, per_file=60)
    reference = chat_build(inputs, tmp_path / "reference", chat_tokenizer, template_file,
                           block_tokens=300)
    assert reference.num_blocks > 30
    out = str(tmp_path / "killed")
    script = ("import torchcache as tc\n"
              "tc.build_cache(json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], "
              "input_format='messages', chat_template=sys.argv[4], keep_fields=['id'], "
              "block_tokens=300, num_workers=2, progress=False)\n")
    for commits in (3, 7):
        command = python_with_hooks(script, json.dumps(inputs), out, chat_tokenizer, template_file,
                                    kill_after_commits=commits)
        code = subprocess.run(command, timeout=300).returncode
        assert code == -signal.SIGKILL, f"the build ended with {code} before its kill point"
        assert not tc.TokenCache(out).complete
    result = chat_build(inputs, out, chat_tokenizer, template_file, block_tokens=300, num_workers=2)
    assert 0 < result.tokens_built < reference.num_tokens
    assert tree_bytes(out) == tree_bytes(reference.path)
    assert tc.check_cache(out) == []


# ---------------------------------------------------------------- the command line

def test_cli_build_makes_the_cache_the_python_api_makes(tmp_path, books, chat_tokenizer,
                                                        template_file):
    inputs = write_chats(tmp_path / "in", books, files=2, per_file=15)
    done = cli("build", *inputs, "-o", tmp_path / "cli", "-t", chat_tokenizer, "-j", 1,
               "--block-tokens", BLOCK, "--input-format", "messages", "--chat-template",
               template_file, "--train-on", "last_assistant", "--keep-field", "id",
               "--keep-field", "url")
    assert done.returncode == 0, done.stderr
    tc.build_cache(inputs, tmp_path / "api", chat_tokenizer, input_format="messages",
                   chat_template=template_file, train_on="last_assistant",
                   keep_fields=["id", "url"], block_tokens=BLOCK, num_workers=1, progress=False)
    assert tree_bytes(str(tmp_path / "cli")) == tree_bytes(str(tmp_path / "api"))
    cache = tc.TokenCache(tmp_path / "cli")
    assert cache.has_loss_mask and cache.spec["documents"]["train_on"] == "last_assistant"
    for d in range(cache.num_documents):  # each document keeps its record's fields
        info = cache.document_info(d)
        f = inputs.index(info["input"])
        k = (f * 15 + info["record"]) * 4
        assert info["fields"] == {"id": f"c{f}-{info['record']}", "url": f"https://x.example/{k}"}


def test_cli_build_refuses_an_unknown_input_format(tmp_path, chat_tokenizer):
    done = cli("build", tmp_path / "none.jsonl", "-o", tmp_path / "c", "-t", chat_tokenizer,
               "--input-format", "chats")
    assert done.returncode == 2 and "--input-format" in done.stderr and "messages" in done.stderr


def test_info_describes_a_chat_cache_and_its_trained_share(chat_cache):
    cache = tc.TokenCache(chat_cache)
    mask = np.concatenate([cache.document_loss_mask(i) for i in range(cache.num_documents)])
    assert 0 < mask.mean() < 1
    done = cli("info", chat_cache)
    assert done.returncode == 0, done.stderr
    lines = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert "input format messages (train on assistant)" in lines["format"]
    assert TEMPLATE[:40] in lines["template"] and f"({len(TEMPLATE)} characters" in lines["template"]
    assert lines["fields"].split()[1] == "id"
    assert f"{mask.mean():.2%} of tokens ({int(mask.sum()):,} " in lines["trained"]
    as_json = json.loads(cli("info", "--json", chat_cache).stdout)["documents_format"]
    assert as_json["trained_tokens"] == int(mask.sum())
    assert as_json["chat_template"] == TEMPLATE and as_json["keep_fields"] == ["id"]


def test_info_of_a_text_cache_has_no_v3_lines(tmp_path, books, gpt2_tokenizer_path):
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"text": t}) + "\n" for t in paragraphs(books, 30)))
    tc.build_cache(str(inputs), tmp_path / "c", gpt2_tokenizer_path, progress=False, num_workers=1)
    done = cli("info", tmp_path / "c")
    assert done.returncode == 0 and "  format " not in done.stdout and "trained" not in done.stdout


def unmark(text: str) -> tuple[str, str]:
    """(the text without the marks, the trained text alone) of `show`'s bracketed output."""
    plain, trained, inside = [], [], False
    for ch in text:
        if ch in (OPEN, CLOSE):
            inside = ch == OPEN
            continue
        plain.append(ch)
        if not inside:
            trained.append(ch)
    return "".join(plain), "".join(trained)


def test_show_brackets_untrained_tokens_when_piped(chat_cache):
    cache = tc.TokenCache(chat_cache)
    d = 3
    ids, mask = cache.document(d), cache.document_loss_mask(d)
    done = cli("show", chat_cache, "-d", d)
    assert done.returncode == 0, done.stderr
    text = done.stdout[:-1]
    assert text.startswith(OPEN + "<|im_start|>user\n")
    plain, trained = unmark(text)
    assert plain == cache.decode(ids)
    assert trained == cache.decode(ids[mask])  # the assistant turns and their <|im_end|>
    assert "<|im_end|>" in trained and "<|im_start|>" not in trained
    assert f"{OPEN}...{CLOSE}" in done.stderr and f"{int(mask.sum()):,} of {len(ids):,}" in done.stderr

    as_is = cli("show", chat_cache, "-d", d, "--no-mask")
    assert as_is.stdout[:-1] == cache.decode(ids) and OPEN not in as_is.stdout
    start, stop = cache.document_span(d)
    as_ids = cli("show", chat_cache, "--tokens", f"{start}:{stop}", "--ids").stdout
    assert marked_ids(as_ids) == (ids.tolist(), mask.tolist())


def marked_ids(text: str) -> tuple[list[int], list[bool]]:
    """(the ids, their trained flags) of `show --ids`'s bracketed output."""
    ids, trained, inside = [], [], False
    for word in text.split():
        inside = inside or word.startswith(OPEN)
        ids.append(int(word.strip(OPEN + CLOSE)))
        trained.append(not inside)
        inside = inside and not word.endswith(CLOSE)
    return ids, trained


def test_show_dims_untrained_tokens_on_a_terminal(chat_cache):
    cache = tc.TokenCache(chat_cache)
    d = int(np.argmin(cache.document_lengths()))  # short: the terminal's buffer holds it all
    controller, terminal = pty.openpty()
    try:
        done = subprocess.run([*CLI, "show", chat_cache, "-d", str(d)], stdout=terminal,
                              stderr=subprocess.PIPE, text=True, timeout=300)
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 1 << 16)
            except OSError:  # the terminal closed: all read
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    shown = b"".join(chunks).decode().replace("\r\n", "\n")
    assert done.returncode == 0 and "dimmed" in done.stderr
    assert shown.startswith("\x1b[2m<|im_start|>user") and OPEN not in shown
    assert shown.replace("\x1b[2m", "").replace("\x1b[0m", "")[:-1] == cache.decode(cache.document(d))
