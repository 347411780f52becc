"""Reading a bad or malicious cache is safe: clear errors naming the file, never a hang, a huge
allocation, an internal exception or data from outside the cache (and the bounded block-file pool).

Every test works on a copy of one small real cache (two webdataset shards of real paragraphs,
tokenized with GPT-2: blocks, offsets sidecars, keys files, tokenizer.json). Cases that could
hang run in a subprocess with a timeout, so a regression fails instead of stalling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import random
import resource
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from conftest import as_format_v1, paragraphs, write_jsonl
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import torchcache as tc
from torchcache import cli
from torchcache.format import blocks as fmt
from torchcache.read import cache as read_module
from torchcache.builder.verify import Problem, check_cache
from torchcache.format.ledger import read_manifest
from torchcache.format.storage import LocalStorage

TESTS = Path(__file__).parent
TIMEOUT = 60


# ---------------------------------------------------------------- the cache every test damages

@pytest.fixture(scope="module")
def pristine(tmp_path_factory, books, gpt2_tokenizer_path):
    """A small real cache in format v1 (2 inputs, 7 blocks, 40 documents, keys files), and its
    documents."""
    d = tmp_path_factory.mktemp("pristine")
    docs = paragraphs(books, 40)
    shards = []
    for s in range(2):
        path = str(d / f"shard-{s}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(s, len(docs), 2):
                sink.write({"__key__": f"doc{i:04d}", "txt": docs[i]})
        shards.append(path)
    root = str(d / "cache")
    tc.convert_webdataset(shards, root, tokenizer=gpt2_tokenizer_path, block_tokens=300,
                          num_workers=1, progress=False)
    as_format_v1(root)  # this module damages v1 manifests (test_format_v2.py damages v2 files)
    cache = tc.TokenCache(root)
    assert cache.num_blocks >= 6 and tc.verify_cache(root) == []
    documents = [cache.document(i) for i in range(cache.num_documents)]
    keys = [cache.document_key(i) for i in range(cache.num_documents)]
    cache.close()
    return root, documents, keys


@pytest.fixture()
def root(pristine, tmp_path) -> Path:
    """A fresh copy of the pristine cache."""
    return Path(shutil.copytree(pristine[0], tmp_path / "cache", symlinks=True))


def load(root) -> dict:
    return json.loads((Path(root) / fmt.MANIFEST_NAME).read_text())


def save(root, manifest: dict) -> None:
    (Path(root) / fmt.MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))


def refingerprint(manifest: dict) -> dict:
    manifest["fingerprint"] = fmt.spec_fingerprint(manifest["spec"])
    return manifest


def rewrite_tensor(root, entry: dict, field: str, name: str, array: np.ndarray) -> None:
    """Replace a block's tensor file with `array`, keeping the manifest's checksum and size in step
    (a consistent-looking but wrong file: only the structural checks can catch it)."""
    written = fmt.write_tensor_file(LocalStorage(str(root)), entry[field], name, array,
                                    {"format": "torchcache", "version": "1"})
    entry["checksum" if field == "path" else f"{field}_checksum"] = written.checksum
    if field == "path":
        entry["size"] = written.size


def offsets_of(root, entry: dict) -> np.ndarray:
    return fmt.read_tensor_file(str(Path(root) / entry["offsets"]), "offsets").copy()


def run_python(code: str, *args: str, timeout: int = TIMEOUT, env: dict | None = None):
    """Run code in a fresh interpreter (hang-prone cases): a hang fails the test by timeout."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=str(TESTS.parent),
                          env={**os.environ, **(env or {})})


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchcache", *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=str(TESTS.parent))


# ---------------------------------------------------------------- every operation, as outcomes

def outcome(fn) -> str:
    """'ok', or the exception type and message, so subprocesses can report it as JSON."""
    try:
        fn()
        return "ok"
    except tc.CacheFormatError as e:
        return f"CacheFormatError: {e}"
    except OSError as e:
        return f"OSError: {e}"
    except Exception as e:  # noqa: BLE001 - reported (and failed on) by the caller
        return f"UNEXPECTED {type(e).__name__}: {e}"


def cli_main(*args: str) -> tuple[int, str]:
    """torchcache.cli.main in this process: (exit code, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, err.getvalue()


def operations(root: str) -> dict[str, str]:
    """Outcome of every reading operation on the cache at `root`."""
    state: dict = {}
    out = {"open": outcome(lambda: state.update(cache=tc.TokenCache(root)))}
    cache = state.get("cache")
    if cache is not None:
        out["documents"] = outcome(lambda: [cache.document(i) for i in range(cache.num_documents)])
        out["keys"] = outcome(lambda: [cache.document_key(i) for i in range(cache.num_documents)])
        out["read"] = outcome(lambda: cache.read(0, cache.num_tokens))
        out["decode"] = outcome(lambda: cache.decode(cache.read(0, min(5, cache.num_tokens))))
    out["verify"] = outcome(lambda: state.update(problems=tc.verify_cache(root)))
    if state.get("problems"):
        out["verify"] = "problems: " + " | ".join(state["problems"])
    for command in ("info", "show"):
        extra = ["-d", "0"] if command == "show" else []
        out[command] = outcome(lambda: state.update(cli=cli_main(command, root, *extra)))
        if out[command] == "ok" and state["cli"][0] != 0:
            out[command] = f"exit {state['cli'][0]}: {state['cli'][1]}"
    return out


def operations_in_subprocess(root, timeout: int = TIMEOUT) -> dict[str, str]:
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_corruption import operations; "
            "print(json.dumps(operations(sys.argv[1])))")
    done = run_python(code, root, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


# ---------------------------------------------------------------- 2, 3: FIFOs and /dev/zero

@pytest.mark.parametrize("which", ["manifest", "block", "offsets", "keys", "tokenizer"])
def test_a_fifo_in_place_of_a_cache_file_gives_an_error_naming_it_not_a_hang(root, which):
    entry = load(root)["blocks"][2]
    rel = {"manifest": fmt.MANIFEST_NAME, "block": entry["path"], "offsets": entry["offsets"],
           "keys": entry["keys"], "tokenizer": fmt.TOKENIZER_NAME}[which]
    os.unlink(root / rel)
    os.mkfifo(root / rel)
    results = operations_in_subprocess(root)
    fifo = str(root / rel)
    failed = {op: r for op, r in results.items() if r != "ok"}
    assert failed, results
    for op, result in failed.items():
        assert "UNEXPECTED" not in result and fifo in result, (op, result)
    assert "FIFO" in " ".join(failed.values())
    needs = {"manifest": ["open", "verify", "info", "show"], "block": ["documents", "read", "verify"],
             "offsets": ["documents", "verify", "info"], "keys": ["keys", "verify"],
             "tokenizer": ["decode", "show"]}[which]
    assert set(needs) <= set(failed), results


def test_cli_on_a_fifo_manifest_returns_an_error(root):
    os.unlink(root / fmt.MANIFEST_NAME)
    os.mkfifo(root / fmt.MANIFEST_NAME)
    for args in (["info", root], ["verify", root], ["show", root, "-d", "0"]):
        done = run_cli(*args)  # times out (and fails) if the manifest is opened blocking
        assert done.returncode != 0 and "FIFO" in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize("which", ["path", "offsets"])
def test_dev_zero_in_place_of_a_block_file_is_refused_by_verify_and_reads(root, which):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    rel = load(root)["blocks"][1][which]
    os.unlink(root / rel)
    os.symlink("/dev/zero", root / rel)
    code = ("import sys, torchcache as tc; "
            "print('\\n'.join(tc.verify_cache(sys.argv[1])))")
    done = run_python(code, root)  # verify used to checksum /dev/zero forever
    assert done.returncode == 0, done.stderr
    assert str(root / rel) in done.stdout
    cache = tc.TokenCache(root)
    with pytest.raises(tc.CacheFormatError, match=str(root / rel)):
        [cache.document(i) for i in range(cache.num_documents)]
    assert run_cli("verify", root).returncode == 1


def test_special_files_are_refused_by_every_reader_helper(root):
    entry = load(root)["blocks"][0]
    os.unlink(root / entry["path"])
    try:  # a character device inside the cache itself, like /dev/zero (needs the right to make one)
        os.mknod(root / entry["path"], 0o644 | stat.S_IFCHR, os.makedev(1, 5))
        kind = "is a device"
    except PermissionError:
        os.symlink("/dev/zero", root / entry["path"])
        kind = "outside the cache"
    code = ("import sys, torchcache as tc; from torchcache.format import blocks as fmt\n"
            "for call in (lambda: fmt.file_checksum('/dev/zero'),\n"
            "             lambda: fmt.read_tensor_file('/dev/zero', 'offsets'),\n"
            "             lambda: tc.TokenCache(sys.argv[1]).read(0, 10),\n"
            "             lambda: print(*tc.verify_cache(sys.argv[1]), sep='\\n')):\n"
            "    try:\n"
            "        call()\n"
            "    except fmt.CacheFormatError as e:\n"
            "        print(e)\n")
    lines = run_python(code, root).stdout.splitlines()
    assert len(lines) == 4, lines
    assert all("/dev/zero: is a device, not a regular file" in line for line in lines[:2])
    assert all(f"{root / entry['path']}: " in line and kind in line for line in lines[2:])
    os.unlink(root / fmt.MANIFEST_NAME)
    os.mkdir(root / fmt.MANIFEST_NAME)
    with pytest.raises(tc.CacheFormatError, match=f"{root / fmt.MANIFEST_NAME}: is a directory"):
        tc.TokenCache(root)


# ---------------------------------------------------------------- 5: symlinks out of the cache

def test_a_block_symlinked_outside_the_cache_is_refused(root, tmp_path):
    entry = load(root)["blocks"][1]
    outside = tmp_path / "outside.safetensors"
    shutil.move(root / entry["path"], outside)
    os.symlink(outside, root / entry["path"])
    cache = tc.TokenCache(root)
    with pytest.raises(tc.CacheFormatError, match=f"{root / entry['path']}.*outside the cache"):
        cache.read(0, cache.num_tokens)
    problems = check_cache(root)
    assert [(p.entry, p.file) for p in problems] == [(1, entry["path"])]
    assert "outside the cache" in problems[0].message


def test_the_blocks_directory_symlinked_outside_is_refused(root, tmp_path):
    shutil.move(root / fmt.BLOCK_DIR, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", root / fmt.BLOCK_DIR)
    cache = tc.TokenCache(root)
    with pytest.raises(tc.CacheFormatError, match="outside the cache"):
        cache.document(0)
    problems = tc.verify_cache(root)
    assert problems and all("outside the cache" in p and str(root / fmt.BLOCK_DIR) in p for p in problems)
    done = run_cli("verify", root)
    assert done.returncode == 1 and "all checksums match" not in done.stdout


def test_symlinks_that_stay_inside_the_cache_are_fine(root, pristine):
    _, documents, _ = pristine
    entry = load(root)["blocks"][3]
    (root / "store").mkdir()
    shutil.move(root / entry["path"], root / "store" / "b.safetensors")
    os.symlink(os.path.join("..", "store", "b.safetensors"), root / entry["path"])
    cache = tc.TokenCache(root)
    assert all(np.array_equal(cache.document(i), d) for i, d in enumerate(documents))
    assert tc.verify_cache(root) == []


# ---------------------------------------------------------------- 6: sizes checked before reading

LIMITED = """
import resource, sys
sys.path.insert(0, 'tests')
import torchcache as tc
from test_corruption import operations
# a reader must not allocate more than 1 GB for a corrupted cache: give it 1 GiB of headroom
with open('/proc/self/status') as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith('VmSize:'))
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
import json
print(json.dumps(operations(sys.argv[1])))
"""


def sparse_file(path: Path, head: bytes, size: int) -> None:
    """A file of `size` bytes starting with `head`, sparse (takes no disk space)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


def test_huge_claims_are_refused_before_reading(root):
    manifest = load(root)
    entry = manifest["blocks"][2]
    # an offsets sidecar whose header claims 2**30 offsets, consistent with its (sparse) size
    n = 1 << 30
    head, start = fmt.safetensors_bytes("offsets", np.zeros(1, dtype=np.int64), {})
    head = head.replace(b'"shape":[1]', f'"shape":[{n}]'.encode()).replace(
        b'"data_offsets":[0,8]', f'"data_offsets":[0,{8 * n}]'.encode())
    head = struct.pack("<Q", len(head) - 8) + head[8:]
    sparse_file(root / entry["offsets"], head, len(head) + 8 * n)
    sparse_file(root / entry["keys"], b"[", 3 << 30)  # a 3 GB keys file
    results = json.loads(run_python(LIMITED, root).stdout.splitlines()[-1])
    assert str(root / entry["offsets"]) in results["documents"] and str(n) in results["documents"]
    assert str(root / entry["offsets"]) in results["verify"]
    assert str(root / entry["keys"]) in results["keys"] and "allowed" in results["keys"]
    assert all("UNEXPECTED" not in r for r in results.values()), results
    # a multi-GB manifest: refused by its size, before it is read
    sparse_file(root / fmt.MANIFEST_NAME, b"{", 3 << 30)
    results = json.loads(run_python(LIMITED, root).stdout.splitlines()[-1])
    assert "allowed" in results["open"] and str(root / fmt.MANIFEST_NAME) in results["open"]
    assert all("UNEXPECTED" not in r for r in results.values()), results
    with pytest.raises(tc.CacheFormatError, match="allowed"):
        read_manifest(str(root))


def test_the_manifest_size_cap_can_be_raised_for_a_genuine_large_manifest(root, monkeypatch):
    size = (root / fmt.MANIFEST_NAME).stat().st_size
    monkeypatch.setenv("TORCHCACHE_MAX_MANIFEST_BYTES", str(size - 1))
    with pytest.raises(tc.CacheFormatError, match=f"{fmt.MANIFEST_NAME}: .*allowed"):
        tc.TokenCache(root)
    monkeypatch.setenv("TORCHCACHE_MAX_MANIFEST_BYTES", str(size))
    tc.TokenCache(root)


# ---------------------------------------------------------------- 7: structural checks at first open

def test_offsets_that_decrease_or_do_not_span_the_block_are_refused(root):
    manifest = load(root)
    entry = manifest["blocks"][1]
    original = offsets_of(root, entry)
    n_before = int(manifest["blocks"][0]["num_documents"])
    for bad in ("decreasing", "first", "last"):
        offsets = original.copy()
        if bad == "decreasing":
            offsets[1], offsets[2] = offsets[2], offsets[1]
        elif bad == "first":
            offsets[0] = 1
        else:
            offsets[-1] += 1
        rewrite_tensor(root, entry, "offsets", "offsets", offsets)
        save(root, manifest)
        cache = tc.TokenCache(root)
        with pytest.raises(tc.CacheFormatError, match=str(root / entry["offsets"])):
            cache.document(n_before)
        problems = check_cache(root)
        assert [(p.entry, p.file) for p in problems] == [(1, entry["offsets"])], problems


def test_a_document_count_off_by_one_is_caught_when_the_block_is_opened(root, pristine):
    _, documents, _ = pristine
    manifest = load(root)
    manifest["blocks"][1]["num_documents"] += 1
    save(root, manifest)
    with pytest.raises(tc.CacheFormatError, match=f"{fmt.MANIFEST_NAME}: num_documents"):
        tc.TokenCache(root)  # the stream's total no longer adds up
    manifest["num_documents"] += 1
    save(root, manifest)
    cache = tc.TokenCache(root)
    first = manifest["blocks"][0]["num_documents"]
    assert all(np.array_equal(cache.document(i), documents[i]) for i in range(first))
    with pytest.raises(tc.CacheFormatError, match=f"{manifest['blocks'][1]['offsets']}.*documents"):
        cache.document(first)  # the block's own offsets are checked before any of its documents
    problems = check_cache(root)
    entry = manifest["blocks"][1]
    assert [(p.entry, p.file) for p in problems] == [(1, entry["offsets"]), (1, entry["keys"])]


def test_a_block_whose_dtype_differs_from_the_spec_is_refused(root):
    manifest = load(root)
    entry = manifest["blocks"][2]
    tokens = fmt.read_tensor_file(str(root / entry["path"]), "tokens", max_length=1 << 20)
    rewrite_tensor(root, entry, "path", "tokens", tokens.astype(np.uint32))
    save(root, manifest)
    cache = tc.TokenCache(root)
    with pytest.raises(tc.CacheFormatError, match=f"{root / entry['path']}.*U32 tokens.*U16"):
        cache.read(0, cache.num_tokens)
    assert [(p.entry, p.file) for p in check_cache(root)] == [(2, entry["path"])]


@pytest.mark.parametrize("field, value, message", [
    ("dtype", "U32", "spec.dtype"),    # GPT-2's 50,257 ids fit U16: U32 is not what was built
    ("dtype", "I64", "spec.dtype"),
    ("dtype", "F16", "spec.dtype"),
    ("vocab_size", 1 << 17, "spec.dtype"),  # the dtype no longer fits the vocabulary
    ("eos_id", 50257, "spec.eos_id"),  # outside the vocabulary
])
def test_token_dtypes_must_be_u16_or_u32_and_fit_the_vocabulary(root, field, value, message):
    manifest = load(root)
    manifest["spec"][field] = value
    save(root, refingerprint(manifest))
    with pytest.raises(tc.CacheFormatError, match=f"{fmt.MANIFEST_NAME}: {message}"):
        tc.TokenCache(root)


# ---------------------------------------------------------------- 8: stream order

def test_swapped_or_duplicated_block_entries_are_caught_by_verify_and_open(root):
    manifest = load(root)
    blocks = manifest["blocks"]
    blocks[2], blocks[3] = blocks[3], blocks[2]
    save(root, manifest)
    order = r"manifest.json: blocks\[2\] is input 1 block 1.*stream order"
    with pytest.raises(tc.CacheFormatError, match=order):
        tc.TokenCache(root)
    problems = check_cache(root)
    assert [(p.entry, p.file) for p in problems] == [(None, fmt.MANIFEST_NAME)]
    assert str(root / fmt.MANIFEST_NAME) in problems[0].message
    done = run_cli("verify", root)
    assert done.returncode == 1 and "stream order" in done.stderr

    manifest = load(root)
    blocks = manifest["blocks"]
    blocks[2], blocks[3] = blocks[3], blocks[2]
    blocks[3] = dict(blocks[2])  # duplicated: the totals made to add up, the files all intact
    manifest["num_tokens"] = sum(b["num_tokens"] for b in blocks)
    manifest["num_documents"] = sum(b["num_documents"] for b in blocks)
    save(root, manifest)
    with pytest.raises(tc.CacheFormatError, match=r"blocks\[3\] is input 0 block 1"):
        tc.TokenCache(root)
    assert [p.entry for p in check_cache(root)] == [None]


def test_block_names_must_follow_from_input_and_index(root):
    manifest = load(root)
    manifest["blocks"][4]["path"], manifest["blocks"][5]["path"] = (
        manifest["blocks"][5]["path"], manifest["blocks"][4]["path"])
    save(root, manifest)
    with pytest.raises(tc.CacheFormatError, match=r"blocks\[4\].path .*expected 'blocks/000000-000002"):
        tc.TokenCache(root)
    assert [p.file for p in check_cache(root)] == [fmt.MANIFEST_NAME]


def builder_stream(counts: list[int], done: list[bool]) -> tuple[list[tuple[int, int]], bool]:
    """The round robin as the builder committed it before format.stream_order existed: an
    independent reference for the rule (the builder now calls stream_order itself)."""
    visible, r = [], 0
    while True:
        advanced = False
        for i, n in enumerate(counts):
            if r < n:
                visible.append((i, r))
                advanced = True
            elif not done[i]:
                return visible, False
        if not advanced:
            return visible, True
        r += 1


@settings(derandomize=True, database=None, max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=5))
def test_stream_order_is_the_builders_round_robin(inputs):
    counts, done = [c for c, _ in inputs], [d for _, d in inputs]
    assert fmt.stream_order(counts, done) == builder_stream(counts, done)


def test_stream_order_examples():
    assert fmt.stream_order([2, 1, 3], [True, True, True]) == (
        [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (2, 2)], True)
    assert fmt.stream_order([2, 1, 3], [True, False, True]) == ([(0, 0), (1, 0), (2, 0), (0, 1)], False)
    assert fmt.stream_order([0, 2], [True, True]) == ([(1, 0), (1, 1)], True)
    assert fmt.stream_order([], []) == ([], True)


# ---------------------------------------------------------------- 14: the manifest's schema

def _set(manifest: dict, where: str, value) -> None:
    *parents, last = where.split(".")
    obj = manifest
    for key in parents:
        obj = obj[int(key)] if isinstance(obj, list) else obj[key]
    if isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value


@pytest.mark.parametrize("where, value, field", [
    ("version", True, "format version"),
    ("fingerprint", 7, "fingerprint"),
    ("fingerprint", "../../etc", "fingerprint"),
    ("complete", "yes", "complete"),
    ("spec", [], "spec"),
    ("spec.vocab_size", "50257", "spec.vocab_size"),
    ("spec.bos_id", 1.5, "spec.bos_id"),
    ("spec.eos_id", -1, "spec.eos_id"),
    ("spec.tokenizer", {"fingerprint": None}, "spec.tokenizer.fingerprint"),
    ("spec.inputs", {}, "spec.inputs"),
    ("spec.inputs.0", "x.tar", r"spec.inputs\[0\]"),
    ("spec.inputs.1.path", None, r"spec.inputs\[1\].path"),
    ("inputs", [], "inputs"),
    ("inputs.0.done", 1, r"inputs\[0\].done"),
    ("inputs.1.blocks", 10 ** 12, r"inputs\[1\].blocks"),
    ("skipped", ["empty", 1], "skipped"),
    ("blocks", {}, "blocks"),
    ("blocks.0", None, r"blocks\[0\]"),
    ("blocks.1.path", 5, r"blocks\[1\].path"),
    ("blocks.1.path", "blocks/\x00.safetensors", r"blocks\[1\].path"),
    ("blocks.1.offsets", "blocks/000000-000000.offsets.safetensors", r"blocks\[1\].offsets"),
    ("blocks.1.keys", ["k"], r"blocks\[1\].keys"),
    ("blocks.1.checksum", None, r"blocks\[1\].checksum"),
    ("blocks.1.offsets_checksum", "md5:0", r"blocks\[1\].offsets_checksum"),
    ("blocks.1.num_tokens", -1, r"blocks\[1\].num_tokens"),
    ("blocks.1.num_tokens", True, r"blocks\[1\].num_tokens"),
    ("blocks.1.num_tokens", 2 ** 70, r"blocks\[1\].num_tokens"),
    ("blocks.1.num_documents", 2.0, r"blocks\[1\].num_documents"),
    ("blocks.1.size", "682", r"blocks\[1\].size"),
    ("blocks.1.input", 2, r"blocks\[1\].input"),
    ("blocks.1.input", False, r"blocks\[1\].input"),
    ("blocks.1.index", -1, r"blocks\[1\].index"),
    ("pending", {"a": 1}, "pending"),
    ("num_tokens", "many", "num_tokens"),
])
def test_every_manifest_field_is_validated(root, where, value, field):
    manifest = load(root)
    _set(manifest, where, value)
    if where.startswith("spec"):
        refingerprint(manifest)  # so the field's own check speaks, not the fingerprint's
    save(root, manifest)
    with pytest.raises(tc.CacheFormatError, match=f"{fmt.MANIFEST_NAME}: {field}"):
        tc.TokenCache(root)
    problems = check_cache(root)
    assert [(p.entry, p.file) for p in problems] == [(None, fmt.MANIFEST_NAME)]
    code, err = cli_main("info", str(root))
    assert code == 2 and fmt.MANIFEST_NAME in err


@pytest.mark.parametrize("text", [
    b"\xff\xfe not utf-8", b"[" * 100_000, b'{"format": "torchcache", "version": 1e999}',
    b'{"format": "torchcache", "version": ' + b"9" * 5000 + b"}", b"", b"null", b'"torchcache"',
])
def test_a_manifest_that_is_not_valid_json_gives_a_clear_error(root, text):
    (root / fmt.MANIFEST_NAME).write_bytes(text)
    with pytest.raises(tc.CacheFormatError, match=str(root / fmt.MANIFEST_NAME)):
        tc.TokenCache(root)
    assert [p.entry for p in check_cache(root)] == [None]


def test_a_spec_edited_without_its_fingerprint_is_refused(root):
    manifest = load(root)
    manifest["spec"]["text_key"] = "other"
    save(root, manifest)
    with pytest.raises(tc.CacheFormatError, match="fingerprint does not match the spec"):
        tc.TokenCache(root)


def test_a_corrupt_tokenizer_names_the_file_and_a_good_one_is_loaded_once(root):
    cache = tc.TokenCache(root)
    first = cache.tokenizer()
    assert cache.tokenizer() is first and cache.decode([464, 3290]) == cache.decode([464, 3290])
    assert "_tokenizer" not in cache.__getstate__() and pickle.loads(pickle.dumps(cache))._tokenizer is None
    (root / fmt.TOKENIZER_NAME).write_bytes(b'{"version": "1.0", "model": 5}')
    cache = tc.TokenCache(root)
    with pytest.raises(tc.CacheFormatError, match=str(root / fmt.TOKENIZER_NAME)):
        cache.decode([464])
    (root / fmt.TOKENIZER_NAME).write_bytes(b"\xff\xfe")
    with pytest.raises(tc.CacheFormatError, match=str(root / fmt.TOKENIZER_NAME)):
        tc.TokenCache(root).tokenizer()
    code, err = cli_main("show", str(root), "-d", "0")
    assert code == 2 and str(root / fmt.TOKENIZER_NAME) in err


# ---------------------------------------------------------------- verify's structured result

def test_check_cache_reports_each_damaged_file_with_its_entry(root):
    manifest = load(root)
    block, keys = manifest["blocks"][1]["path"], manifest["blocks"][4]["keys"]
    data = bytearray((root / block).read_bytes())
    data[-2] ^= 0xFF
    (root / block).write_bytes(bytes(data))
    (root / keys).write_text('["a"]')
    os.unlink(root / manifest["blocks"][6]["offsets"])
    problems = check_cache(root)
    assert [(p.entry, p.file) for p in problems] == [
        (1, block), (4, keys), (6, manifest["blocks"][6]["offsets"])]
    assert all(isinstance(p, Problem) and str(root / p.file) in p.message for p in problems)
    assert "checksum" in problems[0].message and "missing" in problems[2].message
    assert tc.verify_cache(root) == [p.message for p in problems]
    with pytest.raises(dataclasses.FrozenInstanceError):
        problems[0].entry = 2


# ---------------------------------------------------------------- 16: a bounded pool of open files

@pytest.fixture(scope="module")
def many_blocks(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    d = tmp_path_factory.mktemp("many")
    src = write_jsonl(d / "docs.jsonl", paragraphs(books, 400))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=120, num_workers=1, progress=False)
    return str(d / "cache")


MANY_CACHES = """
import os, resource, sys
import numpy as np
import torchcache as tc
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
base = len(os.listdir('/proc/self/fd'))
caches = [tc.TokenCache(sys.argv[1]) for _ in range(20)]
n = caches[0].num_tokens
assert caches[0].num_blocks > 150, caches[0].num_blocks
reference = caches[0].read(0, n)
ds = [tc.TokenDataset(c, 64) for c in caches]
rng = np.random.default_rng(0)
for step in range(40):
    for c, d in zip(caches, ds):
        idx = rng.integers(0, len(d), 16)
        rows = d.read_windows(idx)
        assert all(np.array_equal(r, reference[s * 64:s * 64 + 65]) for s, r in zip(idx, rows))
    assert len(os.listdir('/proc/self/fd')) <= base + 128 + 4
for c in caches:
    assert np.array_equal(c.read(0, n), reference)
print('max open ok', len(os.listdir('/proc/self/fd')) - base)
"""


def test_twenty_caches_share_a_bounded_pool_of_open_files(many_blocks):
    done = run_python(MANY_CACHES, many_blocks)
    assert done.returncode == 0 and "max open ok" in done.stdout, done.stderr


def test_the_pool_is_safe_across_threads(many_blocks, monkeypatch):
    monkeypatch.setattr(read_module._POOL, "limit", 3)  # constant eviction across caches
    caches = [tc.TokenCache(many_blocks) for _ in range(4)]
    reference = caches[0].read(0, caches[0].num_tokens)
    errors = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                cache = rng.choice(caches)
                a = rng.randrange(0, len(reference) - 300)
                b = a + rng.randrange(0, 300)
                if not np.array_equal(cache.read(a, b), reference[a:b]):
                    errors.append(("read", seed, a, b))
                starts = np.array([rng.randrange(0, len(reference) - 50) for _ in range(8)])
                rows = cache.read_many(starts, 50)
                if not all(np.array_equal(r, reference[s:s + 50]) for s, r in zip(starts, rows)):
                    errors.append(("read_many", seed))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert len(read_module._POOL.blocks) <= 3
    for cache in caches:
        cache.close()
    assert not any(b.owner() in caches for b in read_module._POOL.blocks)


def _open_files(root: Path) -> set[int]:
    """This process's descriptors open on files inside the cache directory ``root``."""
    inside = os.path.join(os.path.realpath(root), "")
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if os.readlink(f"/proc/self/fd/{name}").startswith(inside):
                found.add(int(name))
    return found


def test_after_fork_the_child_reopens_its_own_files(many_blocks, tmp_path):
    root = Path(shutil.copytree(many_blocks, tmp_path / "cache"))  # no other reader holds its files
    cache = tc.TokenCache(root)
    reference = cache.read(0, cache.num_tokens)  # the parent holds open blocks
    held = _open_files(root)
    assert held
    pid = os.fork()
    if pid == 0:  # child: the inherited descriptors are closed; every read re-opens
        ok = not _open_files(root) and np.array_equal(cache.read(0, cache.num_tokens), reference)
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _open_files(root) == held  # the child's closes did not touch ours
    assert np.array_equal(cache.read(0, cache.num_tokens), reference)


def test_closing_a_cache_closes_its_files_and_pickles_stay_small(many_blocks, tmp_path):
    root = Path(shutil.copytree(many_blocks, tmp_path / "cache"))
    cache = tc.TokenCache(root)
    cache.read(0, cache.num_tokens)
    held = _open_files(root)
    assert 0 < len(held) <= 128  # the process-wide pool's bound
    clone = pickle.loads(pickle.dumps(cache))
    assert len(pickle.dumps(cache)) < 64_000
    assert _open_files(root) == held  # no descriptor travels, none is opened on unpickling
    cache.close()
    assert not _open_files(root)
    for fd in held:  # nothing opened since: the numbers are free
        with pytest.raises(OSError):
            os.fstat(fd)
    assert np.array_equal(clone.read(5, 500), cache.read(5, 500))  # both open their own again


# ---------------------------------------------------------------- fuzz: random damage, any file

class _Hang(Exception):
    """An operation ran past its time limit (a hang)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def hang(*_):
        raise _Hang(f"no result after {seconds} s")
    previous = signal.signal(signal.SIGALRM, hang)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def memory_headroom(extra: int = 1 << 30):
    """Fail any allocation that takes the process past its current size plus `extra` bytes."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
    st.sampled_from([-1, 0, 1, 2, 7, 2 ** 31, 2 ** 32, 2 ** 63, 10 ** 30, "U16", "U32", "I64", "",
                     "blocks/000000-000000.safetensors", "../manifest.json", "/dev/zero"]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _json_paths(obj, prefix=()) -> list[tuple]:
    """Every path to a value inside a JSON document."""
    out = [prefix]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for key, value in items:
        out += _json_paths(value, prefix + (key,))
    return out


def mutate_json(data, manifest: dict) -> None:
    """Delete or replace one value anywhere in the manifest, or reorder its block entries."""
    action = data.draw(st.sampled_from(["replace", "delete", "swap", "duplicate", "drop", "pend"]))
    blocks = manifest["blocks"]
    if action in ("swap", "duplicate"):
        i, j = data.draw(st.integers(0, len(blocks) - 1)), data.draw(st.integers(0, len(blocks) - 1))
        if action == "swap":
            blocks[i], blocks[j] = blocks[j], blocks[i]
        else:
            blocks[i] = dict(blocks[j])
        if data.draw(st.booleans()):  # make the totals add up, so only the order can tell
            manifest["num_tokens"] = sum(b["num_tokens"] for b in blocks)
            manifest["num_documents"] = sum(b["num_documents"] for b in blocks)
        return
    if action in ("drop", "pend"):
        entry = blocks.pop(data.draw(st.integers(0, len(blocks) - 1)))
        if action == "pend":
            manifest["pending"].append(entry)
        return
    path = data.draw(st.sampled_from(_json_paths(manifest)[1:]))
    parent = manifest
    for key in path[:-1]:
        parent = parent[key]
    if action == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(VALUES)


def mutate_header(data, path: Path) -> None:
    """Edit a safetensors header: its length field, or one value of its JSON."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if data.draw(st.booleans()):
        new_len = data.draw(st.one_of(st.integers(0, 2 ** 64 - 1), st.integers(max(0, n - 16), n + 16)))
        path.write_bytes(struct.pack("<Q", new_len) + raw[8:])
        return
    header = json.loads(raw[8:8 + n])
    paths = _json_paths(header)[1:]
    where = data.draw(st.sampled_from(paths))
    parent = header
    for key in where[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()) and not isinstance(parent, list):
        del parent[where[-1]]
    else:
        parent[where[-1]] = data.draw(VALUES)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


def mutate_offsets(data, path: Path) -> None:
    """Set one offset of a sidecar to another value (the header stays valid)."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    count = (len(raw) - 8 - n) // 8
    i = data.draw(st.integers(0, count - 1))
    value = data.draw(st.one_of(st.integers(-2 ** 63, 2 ** 63 - 1), st.integers(-3, 3),
                                st.sampled_from([2 ** 31, 2 ** 40])))
    current = struct.unpack_from("<q", raw, 8 + n + 8 * i)[0]
    struct.pack_into("<q", raw, 8 + n + 8 * i, value if abs(value) > 3 else current + value)
    path.write_bytes(bytes(raw))


def mutate(data, root: Path, files: list[str]) -> str:
    """Damage the cache at `root` at random; a description of what was done."""
    kind = data.draw(st.sampled_from(["flip", "truncate", "manifest", "header", "offsets"]))
    if kind == "manifest":
        manifest = load(root)
        mutate_json(data, manifest)
        save(root, manifest)
        return kind
    pool = {"header": [f for f in files if f.endswith(".safetensors")],
            "offsets": [f for f in files if f.endswith(".offsets.safetensors")]}.get(kind, files)
    rel = data.draw(st.sampled_from(pool))
    path = root / rel
    if kind == "header":
        mutate_header(data, path)
    elif kind == "offsets":
        mutate_offsets(data, path)
    else:
        raw = bytearray(path.read_bytes())
        at = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[at] ^= data.draw(st.integers(1, 255))
        else:
            del raw[at:]
        path.write_bytes(bytes(raw))
    return f"{kind} {rel}"


def check_error(e: BaseException, root: Path, what: str) -> None:
    assert isinstance(e, (tc.CacheFormatError, OSError)) and not isinstance(e, _Hang), (
        f"{what}: {type(e).__name__}: {e}")
    assert str(root) in str(e), f"{what}: the error does not name a file of the cache: {e}"


def read_all(cache) -> tuple[list[np.ndarray], list]:
    documents = [cache.document(i) for i in range(cache.num_documents)]
    return documents, [cache.document_key(i) for i in range(cache.num_documents)]


def same(documents, keys, reference) -> bool:
    ref_docs, ref_keys = reference
    return (len(documents) == len(ref_docs) and keys == ref_keys
            and all(np.array_equal(a, b) for a, b in zip(documents, ref_docs)))


@settings(derandomize=True, database=None, max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_damaged_caches_give_the_right_data_or_a_clear_error(pristine, data):
    source, ref_documents, ref_keys = pristine
    files = sorted(str(p.relative_to(source)) for p in Path(source).rglob("*")
                   if p.is_file() and p.name != ".lock")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(shutil.copytree(source, Path(tmp) / "cache"))
        what = mutate(data, root, files)
        with time_limit(20), memory_headroom():
            wrong = False
            try:
                cache = tc.TokenCache(root)
                wrong = not same(*read_all(cache), (ref_documents, ref_keys))
                cache.read(0, cache.num_tokens)
                if what.startswith(("flip tokenizer", "truncate tokenizer")):
                    cache.decode([464, 3290])
                event(f"{what.split()[0]}: {'wrong data (verify must see it)' if wrong else 'right data'}")
            except Exception as e:  # noqa: BLE001 - checked: only clear errors naming a file
                check_error(e, root, what)
                event(f"{what.split()[0]}: {type(e).__name__}")
            try:  # with checksums verified, the data is right or refused
                cache = tc.TokenCache(root, verify_checksums=True)
                assert same(*read_all(cache), (ref_documents, ref_keys)), f"{what}: wrong data"
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 - checked
                check_error(e, root, what)
            try:
                problems = check_cache(root)
            except Exception as e:  # noqa: BLE001 - checked
                check_error(e, root, what)
            else:
                assert all(str(root) in p.message for p in problems), (what, problems)
                assert problems or not wrong, f"{what}: wrong data, yet verify finds nothing"
            code, err = cli_main("info", str(root))
            assert code == 0 or str(root) in err, (what, err)
