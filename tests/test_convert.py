"""WebDataset conversion and Parquet inputs: round trips, key tracing, resume, bad shards."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from conftest import DATA, paragraphs, python_with_hooks, tree_bytes

import torchcache as tc
from torchcache.format.ledger import read_manifest


def write_shards(directory: Path, samples: list[dict], per_shard: int, suffix: str = ".tar") -> list[str]:
    """Write webdataset shards with webdataset's own TarWriter; return their paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(samples), per_shard):
        path = directory / f"shard-{s // per_shard:03d}{suffix}"
        with wds.TarWriter(str(path), compress=suffix.endswith("gz")) as sink:
            for sample in samples[s:s + per_shard]:
                sink.write(sample)
        paths.append(str(path))
    return paths


@pytest.fixture()
def texts(books) -> list[str]:
    return paragraphs(books, 90)


def _docs(cache) -> list[np.ndarray]:
    return [cache.document(i) for i in range(cache.num_documents)]


def test_text_shards_round_trip_with_brace_expansion_and_keys(tmp_path, texts, gpt2_tokenizer_path):
    samples = [{"__key__": f"doc{i:04d}", "txt": t, "json": {"i": i}} for i, t in enumerate(texts)]
    write_shards(tmp_path / "wds", samples, per_shard=30)
    pattern = str(tmp_path / "wds" / "shard-{000..002}.tar")
    result = tc.convert_webdataset(pattern, tmp_path / "c", tokenizer=gpt2_tokenizer_path,
                                   block_tokens=800, progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    assert result.num_documents == len(texts) and len(cache.spec["inputs"]) == 3
    by_key = {cache.document_key(i): cache.decode(cache.document(i)[:-1])
              for i in range(cache.num_documents)}
    assert by_key == {f"doc{i:04d}": t for i, t in enumerate(texts)}
    # a token range traces back to its source sample and shard
    i = cache.num_documents // 2
    start, stop = cache.document_span(i)
    where = cache.trace(start + (stop - start) // 2)
    assert where["document"] == i and where["key"] == cache.document_key(i)
    assert where["input"].endswith(f"shard-{int(where['key'][3:]) // 30:03d}.tar")


def test_gzipped_tars_gzipped_members_and_json_fields(tmp_path, texts, gpt2_tokenizer_path):
    samples = [{"__key__": f"k{i}", "txt.gz": t,  # TarWriter gzips .gz members itself
                "json": json.dumps({"body": t.upper()}).encode()} for i, t in enumerate(texts[:20])]
    shards = write_shards(tmp_path / "gz", samples, per_shard=10, suffix=".tar.gz")
    tc.convert_webdataset(shards, tmp_path / "a", tokenizer=gpt2_tokenizer_path,
                          text_key="txt.gz", progress=False)
    a = tc.TokenCache(tmp_path / "a")
    assert [a.decode(d[:-1]) for d in _docs(a)] == texts[:20]
    tc.convert_webdataset(shards, tmp_path / "b", tokenizer=gpt2_tokenizer_path,
                          text_key="json:body", progress=False)
    b = tc.TokenCache(tmp_path / "b")
    assert [b.decode(d[:-1]) for d in _docs(b)] == [t.upper() for t in texts[:20]]


def test_real_webdataset_shard_with_directory_keys(tmp_path, gpt2_tokenizer_path):
    tc.convert_webdataset(str(DATA / "compressed.tar"), tmp_path / "c",
                          tokenizer=gpt2_tokenizer_path, text_key="txt.gz", progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    assert [cache.document_key(i) for i in range(3)] == [f"compressed/000{i}" for i in (1, 2, 3)]
    assert all(cache.decode(cache.document(i)[:-1]) for i in range(3))


def _safetensors_bytes(array: np.ndarray) -> bytes:
    from safetensors.numpy import save
    return save({"ids": array})


def test_pretokenized_members_are_written_as_they_are(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 1000, size=rng.integers(1, 300)).astype(np.int32) for _ in range(40)]
    for member, encode in (("npy", lambda a: a),
                           ("safetensors", _safetensors_bytes),
                           ("json", lambda a: json.dumps(a.tolist()).encode())):
        samples = [{"__key__": f"s{i}", member: encode(a)} for i, a in enumerate(arrays)]
        shards = write_shards(tmp_path / member, samples, per_shard=15)
        out = tmp_path / f"c-{member}"
        tc.convert_webdataset(shards, out, text_key=member, vocab_size=1000, eos_id=999,
                              block_tokens=500, progress=False)
        cache = tc.TokenCache(out)
        assert cache.dtype == np.uint16 and cache.spec["tokenizer"] is None
        by_key = {cache.document_key(i): cache.document(i).tolist() for i in range(cache.num_documents)}
        assert by_key == {f"s{i}": a.tolist() + [999] for i, a in enumerate(arrays)}
    # a vocabulary beyond uint16 gives uint32 blocks; no EOS unless asked
    big = [np.array([70_000, 1, 65_536])]
    shards = write_shards(tmp_path / "big", [{"__key__": "b", "npy": big[0]}], per_shard=1)
    tc.convert_webdataset(shards, tmp_path / "c-big", vocab_size=100_000, progress=False)
    cache = tc.TokenCache(tmp_path / "c-big")
    assert cache.dtype == np.uint32 and cache.document(0).tolist() == [70_000, 1, 65_536]


def test_bad_shards_name_the_shard_and_member(tmp_path, texts, gpt2_tokenizer_path):
    good = write_shards(tmp_path / "good", [{"__key__": f"g{i}", "txt": t} for i, t in
                                            enumerate(texts[:30])], per_shard=30)[0]
    data = Path(good).read_bytes()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(data[: len(data) // 2 + 100])
    missing = write_shards(tmp_path / "missing", [{"__key__": "m0", "txt": "fine"},
                                                  {"__key__": "m1", "cls": b"3"}], per_shard=2)[0]
    floats = write_shards(tmp_path / "floats", [{"__key__": "f0", "npy": np.ones(3)}], per_shard=1)[0]
    beyond = write_shards(tmp_path / "beyond", [{"__key__": "b0", "npy": np.array([5, 1200])}],
                          per_shard=1)[0]
    cases = [
        (str(truncated), dict(tokenizer=gpt2_tokenizer_path), "truncated.tar: cannot read the tar"),
        (missing, dict(tokenizer=gpt2_tokenizer_path), "sample 'm1' (member m1.txt): no 'txt' member"),
        (floats, dict(vocab_size=1000), "sample 'f0' (member f0.npy): holds a float64 array"),
        (beyond, dict(vocab_size=1000), "sample 'b0': token id 1200 is outside the vocabulary"),
    ]
    for path, options, expect in cases:
        key = options.get("vocab_size") and "npy"
        with pytest.raises(tc.InputError) as info:
            tc.convert_webdataset(path, tmp_path / f"out{len(expect)}", text_key=key,
                                  progress=False, **options)
        assert expect in str(info.value) and path in str(info.value), str(info.value)
    tc.convert_webdataset([str(truncated), missing], tmp_path / "skip", tokenizer=gpt2_tokenizer_path,
                          on_error="skip", progress=False)
    skipped = tc.TokenCache(tmp_path / "skip").skipped
    assert skipped == {"unreadable": 1, "missing_text": 1}
    tc.convert_webdataset([floats, beyond], tmp_path / "skip2", text_key="npy", vocab_size=1000,
                          allow_empty=True,
                          on_error="skip", progress=False)
    assert tc.TokenCache(tmp_path / "skip2").skipped == {"bad_tokens": 2}


@pytest.mark.slow
def test_kill_9_during_conversion_then_resume_gives_the_same_cache(tmp_path, books, gpt2_tokenizer_path):
    docs = paragraphs(books)
    samples = [{"__key__": f"d{i:05d}", "txt": t} for i, t in enumerate(docs + docs)]
    shards = write_shards(tmp_path / "wds", samples, per_shard=len(samples) // 4 + 1)
    ref = tc.convert_webdataset(shards, tmp_path / "ref", tokenizer=gpt2_tokenizer_path,
                                block_tokens=1500, num_workers=1, progress=False)
    out = str(tmp_path / "killed")
    script = ("import torchcache as tc; tc.convert_webdataset(json.loads(sys.argv[1]), "
              "sys.argv[2], tokenizer=sys.argv[3], block_tokens=1500, num_workers=2, progress=False)")
    count = 0
    for commits in (3, 8):  # SIGKILL right after the 3rd manifest write, then the 8th of a resume
        command = python_with_hooks(script, json.dumps(shards), out, gpt2_tokenizer_path,
                                    kill_after_commits=commits)
        proc = subprocess.run(command, timeout=300)
        assert proc.returncode == -signal.SIGKILL, "the conversion ended before its kill point"
        m = read_manifest(str(out))
        assert not m["complete"] and len(m["blocks"]) + len(m["pending"]) > count
        count = len(m["blocks"]) + len(m["pending"])
    result = tc.convert_webdataset(shards, out, tokenizer=gpt2_tokenizer_path, block_tokens=1500,
                                   num_workers=2, progress=False)
    assert 0 < result.tokens_built < ref.num_tokens
    assert tree_bytes(out) == tree_bytes(ref.path)


def test_cli_convert_webdataset(tmp_path, texts, gpt2_tokenizer_path):
    write_shards(tmp_path / "wds", [{"__key__": f"k{i}", "txt": t} for i, t in enumerate(texts[:12])],
                 per_shard=6)
    out = tmp_path / "c"
    run = subprocess.run([sys.executable, "-m", "torchcache", "convert-webdataset",
                          str(tmp_path / "wds" / "shard-{000..001}.tar"), "-o", str(out),
                          "-t", gpt2_tokenizer_path], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "12 documents" in run.stdout and "tokenizing" in run.stderr
    shown = subprocess.run([sys.executable, "-m", "torchcache", "show", str(out), "-d", "4"],
                           capture_output=True, text=True)
    assert shown.stdout.startswith(texts[4]) and "sample key 'k4'" in shown.stderr


# ------------------------------------------------------------------ Parquet

def _write_parquet(path: Path, texts: list, row_group_size: int) -> str:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"id": list(range(len(texts))), "content": texts})
    pq.write_table(table, str(path), row_group_size=row_group_size)
    return str(path)


def test_parquet_text_column_in_row_groups(tmp_path, texts, gpt2_tokenizer_path):
    path = _write_parquet(tmp_path / "t.parquet", texts, row_group_size=7)
    import pyarrow.parquet as pq
    assert pq.ParquetFile(path).num_row_groups > 10
    tc.build_cache(path, tmp_path / "c", gpt2_tokenizer_path, text_key="content", block_tokens=600,
                   progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    assert [cache.decode(d[:-1]) for d in _docs(cache)] == texts
    with pytest.raises(tc.InputError, match="no column 'text'"):
        tc.build_cache(path, tmp_path / "x", gpt2_tokenizer_path, progress=False)


def test_parquet_bad_row_then_resume_with_skip(tmp_path, texts, gpt2_tokenizer_path):
    rows = texts[:60] + [None] + texts[60:]
    path = _write_parquet(tmp_path / "t.parquet", rows, row_group_size=8)
    out = tmp_path / "c"
    with pytest.raises(tc.InputError, match=r"t.parquet:61: row 61: column 'content' is NoneType"):
        tc.build_cache(path, out, gpt2_tokenizer_path, text_key="content", block_tokens=600,
                       progress=False)
    assert read_manifest(str(out))["blocks"], "blocks before the bad row are kept"
    tc.build_cache(path, out, gpt2_tokenizer_path, text_key="content", block_tokens=600,
                   on_error="skip", progress=False)
    fresh = tc.build_cache(path, tmp_path / "fresh", gpt2_tokenizer_path, text_key="content",
                           block_tokens=600, on_error="skip", progress=False)
    assert tree_bytes(str(out)) == tree_bytes(fresh.path)
    assert tc.TokenCache(out).skipped == {"missing_text": 1}
