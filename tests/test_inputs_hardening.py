"""Input hardening: content digests for resume, transient I/O errors, truncated tars, bad text.

Inputs are real: paragraphs of the Gutenberg books in tests/data, tars written with the tarfile
module, Parquet files written with pyarrow. Transient I/O errors come from a real fsspec
filesystem (`flaky://`, local files whose reads fail like a dropped connection).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import fsspec
import pytest
from conftest import DATA, paragraphs, tree_bytes, write_jsonl
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import stringify_path

import torchcache as tc
import torchcache.builder.inputs as inputs_module
from torchcache.format.ledger import read_manifest
from torchcache.errors import InputChangedError, InputError
from torchcache.builder.inputs import iter_records, iter_strings, resolve_inputs

BLOCK = 2_000


# ------------------------------------------------------------------ helpers

def _records(path: str, text_key: str = "text", start: int = 0, on_error: str = "skip",
             start_digest: str | None = None, **kwargs) -> list:
    (source,) = resolve_inputs(path)
    return list(iter_records(source, text_key, start, on_error, start_digest=start_digest, **kwargs))


def _write_tar(path: Path, samples: list[dict[str, bytes]]) -> str:
    """A webdataset shard written with the tarfile module: {"__key__": k, ext: bytes, ...}."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            for ext, data in sample.items():
                if ext == "__key__":
                    continue
                info = tarfile.TarInfo(f"{sample['__key__']}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return str(path)


def _write_parquet(path: Path, column, row_group_size: int) -> str:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": column}), str(path), row_group_size=row_group_size)
    return str(path)


def _content(records: list) -> list[tuple]:
    """What records say about their input, without the byte positions (for progress)."""
    return [(r.number, r.text, r.problem, r.key, r.digest) for r in records]


def _docs(cache: tc.TokenCache) -> list[str]:
    return [cache.decode(cache.document(i)[:-1]) for i in range(cache.num_documents)]


@pytest.fixture()
def texts(books) -> list[str]:
    return paragraphs(books, 300)


# ------------------------------------------------------------------ 9: digests identify inputs

def test_digest_is_a_running_sha256_of_every_raw_line(tmp_path, texts):
    """Blank and malformed lines count; the digest is of the decompressed bytes, so the same
    content has the same digests plain, gzip or zstd."""
    zstandard = pytest.importorskip("zstandard")
    lines = [json.dumps({"text": t}).encode() + b"\n" for t in texts[:40]]
    lines[3], lines[9], lines[17] = b"\n", b"  \n", b"{not json\n"
    raw = b"".join(lines)
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(raw))
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    digests = []
    for name in ("a.jsonl", "a.jsonl.gz", "a.jsonl.zst"):
        records = _records(str(tmp_path / name))
        assert [r.number for r in records] == [n for n in range(1, 41) if n not in (4, 10)]
        for r in records:
            assert r.digest == hashlib.sha256(b"".join(lines[: r.number])).hexdigest()
        digests.append([r.digest for r in records])
    assert digests[0] == digests[1] == digests[2]


@pytest.mark.parametrize("kind", ["jsonl", "txt", "parquet", "tar", "iterable"])
def test_resume_checks_the_records_it_skips(tmp_path, texts, kind):
    """Every kind of input: resuming after record k with its digest gives exactly the rest; an
    edit of the first k records, even one that keeps the size, is an InputChangedError
    (on_error='skip' too); so is an input now shorter than k; no digest means no check."""
    docs = texts[:30]
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "a.jsonl", docs)
    elif kind == "txt":
        path = str(tmp_path / "a.txt")
        Path(path).write_text(docs[0])
    elif kind == "parquet":
        path = _write_parquet(tmp_path / "a.parquet", docs, row_group_size=7)
    elif kind == "tar":
        path = _write_tar(tmp_path / "a.tar", [{"__key__": f"k{i:03d}", "txt": t.encode()}
                                               for i, t in enumerate(docs)])
    items = list(docs)

    def read(start: int = 0, digest: str | None = None, on_error: str = "raise") -> list:
        if kind == "iterable":
            return list(iter_strings(iter(items), start, on_error, start_digest=digest))
        return _records(path, "txt" if kind == "tar" else "text", start, on_error, digest)

    full = read()
    assert full == read(), "reading is deterministic, digests included"
    k = 1 if kind == "txt" else 12
    assert read(k, full[k - 1].digest) == full[k:]
    assert read(k, None) == full[k:]
    # edit record 1 in place, same size: replace its first letter
    first = docs[0]
    edited = ("X" if first[0] != "X" else "Y") + first[1:]
    if kind == "iterable":
        items[0] = edited
    elif kind == "parquet":
        _write_parquet(tmp_path / "a.parquet", [edited] + docs[1:], row_group_size=7)
    else:
        data = Path(path).read_bytes()
        i = {"jsonl": len('{"text": "'), "txt": 0, "tar": 512}[kind]  # the first text's first byte
        assert data[i:i + 1] == first[:1].encode()
        Path(path).write_bytes(data[:i] + edited[:1].encode() + data[i + 1:])
    name = "<iterable>" if kind == "iterable" else path
    for on_error in ("raise", "skip"):
        with pytest.raises(InputChangedError) as info:
            read(k, full[k - 1].digest, on_error)
        assert str(info.value).startswith(f"{name}: the input changed since the interrupted build "
                                          f"(its first {k} records differ")
        assert "restore it, or build into a new output" in str(info.value)
        assert isinstance(info.value, InputError)
    assert len(read(k, None)) == len(full) - k, "no digest (an older cache): no check"
    with pytest.raises(InputChangedError, match=f"it now has only {len(full)} records"):
        read(len(full) + 5, full[-1].digest)


# ------------------------------------------------------------------ 10: transient I/O errors

class _FlakyFile(io.RawIOBase):
    """A local file whose reads fail with ConnectionResetError: once at each byte offset in
    `fail_at` (a list shared by every open of the file), or always past `broken_from`. `chunk`
    caps the bytes of one read, as a network stream does."""

    def __init__(self, f, fail_at: list[int], broken_from: int | None, chunk: int | None):
        self.f, self.fail_at, self.broken_from, self.chunk = f, fail_at, broken_from, chunk

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def tell(self) -> int:
        return self.f.tell()

    def readinto(self, buffer) -> int:
        pos = self.f.tell()
        n = len(buffer) if self.chunk is None else min(len(buffer), self.chunk)
        if self.broken_from is not None and pos + n > self.broken_from:
            raise ConnectionResetError(104, "Connection reset by peer")
        for offset in self.fail_at:
            if pos <= offset < pos + n:
                self.fail_at.remove(offset)
                for hook in FlakyFileSystem.on_failure:
                    hook()
                raise ConnectionResetError(104, f"Connection reset by peer (byte {offset})")
        data = self.f.read(n)
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        self.f.close()
        super().close()


class FlakyFileSystem(LocalFileSystem):
    """Local files under `flaky://`, with read failures planned per file name."""

    protocol = ("flaky",)
    fail_at: dict[str, list[int]] = {}
    broken_from: dict[str, int] = {}
    chunk: int | None = 32 << 10
    opened: list[str] = []
    on_failure: list = []  # called at each planned failure

    @classmethod
    def _strip_protocol(cls, path):
        path = stringify_path(path)
        if path.startswith("flaky://"):
            path = path[len("flaky://"):]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return f"flaky://{self._strip_protocol(name)}"

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        name = os.path.basename(path)
        FlakyFileSystem.opened.append(name)
        return _FlakyFile(f, self.fail_at.setdefault(name, []), self.broken_from.get(name), self.chunk)


@pytest.fixture()
def flaky(monkeypatch):
    fsspec.register_implementation("flaky", FlakyFileSystem, clobber=True)
    monkeypatch.setattr(inputs_module, "_RETRY_DELAY", 0.001)
    monkeypatch.setattr(FlakyFileSystem, "fail_at", {})
    monkeypatch.setattr(FlakyFileSystem, "broken_from", {})
    monkeypatch.setattr(FlakyFileSystem, "opened", [])
    monkeypatch.setattr(FlakyFileSystem, "on_failure", [])
    monkeypatch.setattr(FlakyFileSystem, "chunk", 32 << 10)
    return FlakyFileSystem


def test_transient_errors_are_retried_and_give_the_same_cache(tmp_path, books, gpt2_tokenizer_path,
                                                              flaky):
    docs = paragraphs(books)
    plain = write_jsonl(tmp_path / "a.jsonl", docs[0::2])
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                             for t in docs[1::2]).encode()))
    urls = [f"flaky://{plain}", f"flaky://{packed}"]
    options = dict(block_tokens=BLOCK, num_workers=1, progress=False)
    ref = tc.build_cache(urls, tmp_path / "ref", gpt2_tokenizer_path, **options)
    assert flaky.opened == ["a.jsonl", "b.jsonl.gz"]
    flaky.opened.clear()
    a, b = os.path.getsize(plain), os.path.getsize(packed)
    # a.jsonl: two failures far apart; b.jsonl.gz: two failures in a row at the same place
    flaky.fail_at.update({"a.jsonl": [a // 3, 2 * a // 3], "b.jsonl.gz": [b // 2, b // 2]})
    got = tc.build_cache(urls, tmp_path / "got", gpt2_tokenizer_path, **options)
    assert flaky.opened == ["a.jsonl"] * 3 + ["b.jsonl.gz"] * 3
    assert tree_bytes(got.path) == tree_bytes(ref.path)


def test_a_persistent_error_raises_oserror_and_marks_nothing_done(tmp_path, books,
                                                                  gpt2_tokenizer_path, flaky):
    docs = paragraphs(books)
    paths = [write_jsonl(tmp_path / f"{name}.jsonl", docs[i::2]) for i, name in enumerate("ab")]
    urls = [f"flaky://{p}" for p in paths]
    options = dict(block_tokens=BLOCK, num_workers=1, progress=False)
    ref = tc.build_cache(urls, tmp_path / "ref", gpt2_tokenizer_path, **options)
    flaky.broken_from["b.jsonl"] = os.path.getsize(paths[1]) // 2
    out = tmp_path / "c"
    for on_error in ("raise", "skip"):
        flaky.opened.clear()
        with pytest.raises(OSError) as info:
            tc.build_cache(urls, out, gpt2_tokenizer_path, on_error=on_error, **options)
        message = str(info.value)
        assert not isinstance(info.value, InputError)
        assert message.startswith(f"{urls[1]}: reading failed 3 times (ConnectionResetError: ")
        assert " at record " in message and "re-run the build to resume" in message
        assert flaky.opened.count("b.jsonl") == 3
        manifest = read_manifest(str(out))
        assert [i["done"] for i in manifest["inputs"]] == [True, False]
        assert not manifest["complete"] and manifest["skipped"] == {}
    del flaky.broken_from["b.jsonl"]
    tc.build_cache(urls, out, gpt2_tokenizer_path, **options)
    assert tree_bytes(str(out)) == tree_bytes(ref.path)


@pytest.mark.parametrize("kind", ["gzip", "tar", "parquet", "parquet-rows"])
def test_a_retry_resumes_after_the_last_record_with_the_same_digests(tmp_path, texts, flaky, kind):
    """Failures after some records were read (a gzip stream is read 1 MiB of text at a time, a
    Parquet file a row group at a time after its last 64 KiB): the records and their digests are
    those of a clean read."""
    docs = [f"{n}: {t}" for n in range(100 if kind == "gzip" else 24) for t in texts]
    flaky.chunk = 4 << 10
    key = "text"
    if kind == "gzip":
        path = tmp_path / "a.jsonl.gz"
        path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in docs).encode(),
                                       compresslevel=1))
    elif kind == "tar":
        path = Path(_write_tar(tmp_path / "a.tar", [{"__key__": f"k{i:04d}", "txt": t.encode()}
                                                    for i, t in enumerate(docs)]))
        key = "txt"
    else:
        path = Path(_write_parquet(tmp_path / "a.parquet", docs, row_group_size=200))
        flaky.chunk = None  # pyarrow reads byte ranges in full
        key = None if kind == "parquet-rows" else key  # rows read whole (records of a pipeline)
    clean = _records(f"flaky://{path}", key)
    size = path.stat().st_size
    assert size > 500_000
    flaky.fail_at[path.name] = [size // 3, size // 3, 2 * size // 3]
    flaky.opened.clear()
    assert _records(f"flaky://{path}", key) == clean
    assert flaky.opened == [path.name] * 4


def test_an_input_edited_between_two_reads_is_refused(tmp_path, texts, flaky):
    path = Path(write_jsonl(tmp_path / "a.jsonl", texts))
    data = path.read_bytes()
    assert len(data) > 40 << 10
    edited = data[:10] + (b"X" if data[10:11] != b"X" else b"Y") + data[11:]
    flaky.fail_at["a.jsonl"] = [len(data) - 1000]  # in the second read of 32 KiB
    flaky.on_failure.append(lambda: path.write_bytes(edited))
    with pytest.raises(InputChangedError, match="the input changed while it was being read"):
        _records(f"flaky://{path}")
    assert flaky.opened == ["a.jsonl"] * 2


def test_damage_is_not_retried(tmp_path, texts, flaky):
    """A truncated gzip file and a Parquet file whose page header is garbage (pyarrow reports
    it as an OSError) are damage: one read, an InputError, skippable."""
    data = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts).encode())
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    pq = pytest.importorskip("pyarrow.parquet")
    path = _write_parquet(tmp_path / "bad.parquet", texts, row_group_size=50)
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    offset = column.dictionary_page_offset or column.data_page_offset
    raw = bytearray(Path(path).read_bytes())
    raw[offset:offset + 8] = b"\xff" * 8
    Path(path).write_bytes(bytes(raw))
    flaky.chunk = None
    for name, expect in (("cut.jsonl.gz", "cannot read the gzip stream before its first line"),
                         ("bad.parquet", "cannot read row group 2 (OSError: ")):
        url = f"flaky://{tmp_path / name}"
        flaky.opened.clear()
        with pytest.raises(InputError, match="truncated or corrupted") as info:
            _records(url, on_error="raise")
        assert str(info.value).startswith(f"{url}: {expect}")
        assert flaky.opened == [name]
        records = _records(url)
        assert records[-1].problem == "unreadable" and all(r.problem is None for r in records[:-1])
    assert len(_records(f"flaky://{tmp_path / 'bad.parquet'}")) == 101


# ------------------------------------------------------------------ 12: truncated tars

def _tar_cuts(data: bytes) -> dict[str, int]:
    """Where to cut a tar: at a member boundary (no end-of-archive), inside a header, inside
    member data, at the end of the last member (only the end-of-archive blocks missing)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    middle, last = members[len(members) // 2], members[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    return {"boundary": middle.offset, "header": middle.offset + 100,
            "data": middle.offset_data + middle.size // 2, "end": end}


@pytest.mark.slow
def test_a_tar_cut_anywhere_is_truncated(tmp_path, texts, gpt2_tokenizer_path):
    samples = [{"__key__": f"k{i:03d}", "txt": t.encode(), "json": json.dumps({"i": i}).encode()}
               for i, t in enumerate(texts[:40])]
    data = Path(_write_tar(tmp_path / "whole.tar", samples)).read_bytes()
    whole = _records(str(tmp_path / "whole.tar"), "txt")
    assert [r.problem for r in whole] == [None] * 40
    cuts = _tar_cuts(data)
    paths = []
    for where, cut in cuts.items():
        path = tmp_path / f"cut-{where}.tar"
        path.write_bytes(data[:cut])
        paths.append(str(path))
        with pytest.raises(InputError) as info:
            tc.convert_webdataset(str(path), tmp_path / f"raise-{where}", tokenizer=gpt2_tokenizer_path,
                                  progress=False)
        message = str(info.value)
        assert message.startswith(f"{path}: cannot read the tar after member "), message
        assert "the shard is truncated or corrupted" in message and "on_error='skip'" in message
        # the same damage in a gzipped shard
        (tmp_path / f"cut-{where}.tar.gz").write_bytes(gzip.compress(data[:cut]))
        records = _records(str(tmp_path / f"cut-{where}.tar.gz"), "txt")
        assert _content(records[:-1]) == _content(whole[: len(records) - 1])
        assert records[-1].problem == "unreadable"
    tc.convert_webdataset(paths, tmp_path / "skip", tokenizer=gpt2_tokenizer_path, on_error="skip",
                          progress=False)
    cache = tc.TokenCache(tmp_path / "skip")
    manifest = read_manifest(str(tmp_path / "skip"))
    assert [i["skipped"] for i in manifest["inputs"]] == [{"unreadable": 1}] * len(cuts)
    docs = iter(_docs(cache))
    for block in manifest["blocks"]:  # one block per shard, in shard order
        kept = [next(docs) for _ in range(block["num_documents"])]
        assert 0 < len(kept) < 40 and kept == [r.text for r in whole[: len(kept)]]
    # the end-of-archive marker (two zero blocks, or at least one) is all a whole tar adds
    for cut in (cuts["end"] + 512, len(data)):
        (tmp_path / "ok.tar").write_bytes(data[:cut])
        assert _content(_records(str(tmp_path / "ok.tar"), "txt")) == _content(whole)


def test_a_real_shard_cut_at_a_member_boundary_is_truncated(tmp_path):
    shutil.copy(DATA / "compressed.tar", tmp_path / "compressed.tar")
    whole = _records(str(tmp_path / "compressed.tar"), "txt.gz")
    assert [(r.key, r.text) for r in whole] == [("compressed/0001", "hello\n"),
                                                ("compressed/0002", "world\n"),
                                                ("compressed/0003", "gzip\n")]
    data = (tmp_path / "compressed.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[: _tar_cuts(data)["boundary"]])
    cut = _records(str(tmp_path / "cut.tar"), "txt.gz")
    assert cut[:-1] == whole[: len(cut) - 1] and cut[-1].problem == "unreadable"
    with pytest.raises(InputError, match="without its end-of-archive marker"):
        _records(str(tmp_path / "cut.tar"), "txt.gz", on_error="raise")


# ------------------------------------------------------------------ 13: bad text, named

def test_lone_surrogates_and_deep_nesting_in_jsonl_name_file_and_line(tmp_path, texts,
                                                                       gpt2_tokenizer_path):
    lines = [json.dumps({"text": t}) for t in texts[:30]]
    lines[8] = '{"text": "a pair \\ud83d\\ude00 is fine"}'
    bad = {8: ('{"text": "a lone \\ud800 surrogate"}',
               "field 'text' is not valid UTF-8 (a lone surrogate '\\ud800' at character 7)"),
           20: ("[" * 200_000, "malformed JSON (nested too deeply to parse)")}
    for number, (line, expect) in bad.items():
        path = tmp_path / f"bad-{number}.jsonl"
        path.write_text("\n".join(lines[:number - 1] + [line] + lines[number:]) + "\n")
        with pytest.raises(InputError) as info:
            tc.build_cache(str(path), tmp_path / f"raise-{number}", gpt2_tokenizer_path, progress=False)
        assert str(info.value).startswith(f"{path}:{number}: {expect}"), str(info.value)
    for number, (line, _) in bad.items():
        lines[number - 1] = line
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    tc.build_cache(str(path), tmp_path / "skip", gpt2_tokenizer_path, on_error="skip", progress=False)
    cache = tc.TokenCache(tmp_path / "skip")
    assert cache.skipped == {"invalid_utf8": 1, "malformed_json": 1}
    assert _docs(cache) == [json.loads(line)["text"] for i, line in enumerate(lines) if i not in (7, 19)]
    assert "\U0001f600" in _docs(cache)[7]


@pytest.mark.slow
def test_bad_text_in_tars_parquet_and_iterables_is_named_and_skippable(tmp_path, texts,
                                                                        gpt2_tokenizer_path):
    pa = pytest.importorskip("pyarrow")
    good = texts[:6]
    shard = _write_tar(tmp_path / "s.tar", [
        {"__key__": "a", "json": json.dumps({"body": good[0]}).encode()},
        {"__key__": "b", "json": b'{"body": "lone \\udc00"}'},
        {"__key__": "c", "json": b"[" * 200_000},
        {"__key__": "d", "json": json.dumps({"body": good[1]}).encode()},
    ])
    column = pa.array([good[2].encode(), b"bad \xed\xa0\x80 bytes", good[3].encode()],
                      pa.binary()).view(pa.string())
    table = _write_parquet(tmp_path / "t.parquet", column, row_group_size=2)
    items = [good[4], "lone \udbff", good[5]]
    cases = [
        (lambda out, **kw: tc.convert_webdataset(shard, out, tokenizer=gpt2_tokenizer_path,
                                                 text_key="json:body", progress=False, **kw),
         f"{shard}: sample 'b' (member b.json): field 'body' is not valid UTF-8",
         {"invalid_utf8": 1, "malformed_json": 1}, [good[0], good[1]]),
        (lambda out, **kw: tc.build_cache(table, out, gpt2_tokenizer_path, progress=False, **kw),
         f"{table}:2: invalid UTF-8 at byte 4 of the row",
         {"invalid_utf8": 1}, [good[2], good[3]]),
        (lambda out, **kw: tc.build_cache(iter(items), out, gpt2_tokenizer_path, progress=False, **kw),
         "inputs item 2: is not valid UTF-8 (a lone surrogate '\\udbff' at character 5)",
         {"invalid_utf8": 1}, [good[4], good[5]]),
    ]
    for i, (build, expect, skipped, kept) in enumerate(cases):
        with pytest.raises(InputError) as info:
            build(tmp_path / f"raise-{i}")
        assert str(info.value).startswith(expect), str(info.value)
        build(tmp_path / f"skip-{i}", on_error="skip")
        cache = tc.TokenCache(tmp_path / f"skip-{i}")
        assert cache.skipped == skipped and _docs(cache) == kept
