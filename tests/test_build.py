"""Builder promises: determinism, round trip, no-op re-runs, refusal of mixed settings, locking."""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np
import pytest
from conftest import paragraphs, tree_bytes, write_jsonl

import torchcache as tc
from torchcache.format.ledger import read_manifest


def test_round_trip_decodes_every_document(tmp_path, books, gpt2_tokenizer_path, gpt2):
    src = str(tmp_path / "books.jsonl")
    write_jsonl(tmp_path / "books.jsonl", [b["text"] for b in books])
    result = tc.build_cache(src, tmp_path / "cache", gpt2_tokenizer_path, block_tokens=8_000,
                            num_workers=1, progress=False)
    cache = tc.TokenCache(tmp_path / "cache")
    assert cache.complete and result.num_documents == len(books) == cache.num_documents
    assert cache.num_blocks > 5, "small block_tokens must give many blocks"
    assert cache.dtype == np.uint16
    eos = gpt2.token_to_id("<|endoftext|>")
    for i, book in enumerate(books):
        doc = cache.document(i)
        assert doc[-1] == eos and eos not in doc[:-1]
        assert gpt2.decode(doc[:-1].tolist()) == book["text"]
        assert doc[:-1].tolist() == gpt2.encode(book["text"], add_special_tokens=False).ids
    assert cache.num_tokens == sum(len(cache.document(i)) for i in range(len(books)))


def test_one_and_two_workers_give_identical_bytes(tmp_path, shards, gpt2_tokenizer_path):
    one = tc.build_cache(shards, tmp_path / "one", gpt2_tokenizer_path, block_tokens=3_000,
                         num_workers=1, progress=False)
    two = tc.build_cache(shards, tmp_path / "two", gpt2_tokenizer_path, block_tokens=3_000,
                         num_workers=2, progress=False)
    a, b = tree_bytes(one.path), tree_bytes(two.path)
    assert a == b
    manifest = read_manifest(one.path)
    assert manifest["complete"] and not manifest["pending"]
    order = [(e["input"], e["index"]) for e in manifest["blocks"]]
    per_input = [sum(1 for e in order if e[0] == i) for i in range(3)]
    assert min(per_input) >= 3
    # round robin: input 0 block 0, input 1 block 0, input 2 block 0, input 0 block 1, ...
    expected = [(i, r) for r in range(max(per_input)) for i in range(3) if r < per_input[i]]
    assert order == expected


def test_rerun_is_noop_and_changed_settings_are_refused(tmp_path, shards, gpt2_tokenizer_path):
    out = tmp_path / "cache"
    tc.build_cache(shards, out, gpt2_tokenizer_path, block_tokens=5_000, num_workers=1, progress=False)
    before = tree_bytes(str(out))
    mtime = os.stat(out / "manifest.json").st_mtime_ns
    again = tc.build_cache(shards, out, gpt2_tokenizer_path, block_tokens=5_000, num_workers=1,
                           progress=False)
    assert again.tokens_built == 0 and os.stat(out / "manifest.json").st_mtime_ns == mtime
    assert tree_bytes(str(out)) == before
    with pytest.raises(tc.BuildError, match="block_tokens"):
        tc.build_cache(shards, out, gpt2_tokenizer_path, block_tokens=6_000, progress=False)
    with pytest.raises(tc.BuildError, match="eos_id"):
        tc.build_cache(shards, out, gpt2_tokenizer_path, block_tokens=5_000, eos=None, progress=False)
    with pytest.raises(tc.BuildError, match="inputs"):
        tc.build_cache(shards[:2], out, gpt2_tokenizer_path, block_tokens=5_000, progress=False)
    from tokenizers import Tokenizer
    other = Tokenizer.from_file(gpt2_tokenizer_path)
    other.add_tokens(["<extra>"])
    with pytest.raises(tc.BuildError, match="tokenizer"):
        tc.build_cache(shards, out, other, block_tokens=5_000, progress=False)
    assert tree_bytes(str(out)) == before


def test_output_that_is_not_a_cache_is_refused(tmp_path, shards, gpt2_tokenizer_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(tc.BuildError, match="not a torchcache cache"):
        tc.build_cache(shards, tmp_path / "mine", gpt2_tokenizer_path, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_second_builder_on_same_output_is_refused(tmp_path, gpt2_tokenizer_path):
    release = threading.Event()

    def slow_documents():
        yield "first document"
        release.wait(60)
        yield "second document"

    handle = tc.build_cache(slow_documents(), tmp_path / "c", gpt2_tokenizer_path, background=True)
    try:
        while not (tmp_path / "c" / "manifest.json").exists():
            assert not handle.done, handle.error
            time.sleep(0.01)
        with pytest.raises(tc.BuildError, match="another builder"):
            tc.build_cache(iter(["x"]), tmp_path / "c", gpt2_tokenizer_path, progress=False)
    finally:
        release.set()
    result = handle.wait(60)
    assert result.num_documents == 2 and handle.done and handle.error is None
    # the lock died with the first builder: a re-run is a no-op, not a refusal
    assert tc.build_cache(iter(["first document", "second document"]), tmp_path / "c",
                          gpt2_tokenizer_path, progress=False).tokens_built == 0


def test_iterable_of_strings_and_special_tokens_stay_text(tmp_path, gpt2_tokenizer_path, gpt2):
    texts = ["hello <|endoftext|> world", "", "plain", "ends with <|endoftext|>"]
    tc.build_cache(iter(texts), tmp_path / "a", gpt2_tokenizer_path, progress=False)
    cache = tc.TokenCache(tmp_path / "a")
    eos = gpt2.token_to_id("<|endoftext|>")
    assert cache.num_documents == 3 and cache.skipped == {"empty": 1}
    for i, text in enumerate(t for t in texts if t):
        doc = cache.document(i)
        assert eos not in doc[:-1].tolist() and doc[-1] == eos
        assert gpt2.decode(doc[:-1].tolist()) == text
    tc.build_cache(iter(texts), tmp_path / "b", gpt2_tokenizer_path, special_tokens_as_text=False,
                   bos="<|endoftext|>", progress=False)
    raw = tc.TokenCache(tmp_path / "b")
    assert eos in raw.document(0)[1:-1].tolist() and raw.document(0)[0] == eos


def test_input_formats_and_fsspec_urls(tmp_path, books, gpt2_tokenizer_path):
    import gzip

    import fsspec
    import zstandard
    texts = paragraphs(books, 60)
    plain = write_jsonl(tmp_path / "a.jsonl", texts[:20], key="content")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"content": t}) + "\n" for t in texts[20:40])
    with open(tmp_path / "c.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(
            "".join(json.dumps({"content": t}) + "\n" for t in texts[40:60]).encode()))
    (tmp_path / "txt").mkdir()
    for i in range(3):
        (tmp_path / "txt" / f"{i}.txt").write_text(texts[i])
    with fsspec.open("memory://corpus/m.jsonl", "w") as f:
        f.write(json.dumps({"content": "from memory"}) + "\n")
    inputs = [f"file://{plain}", str(tmp_path / "b.jsonl.gz"), str(tmp_path / "*.zst"),
              str(tmp_path / "txt"), "memory://corpus/m.jsonl"]
    tc.build_cache(inputs, tmp_path / "cache", gpt2_tokenizer_path, text_key="content",
                   block_tokens=10 ** 9, progress=False)
    cache = tc.TokenCache(tmp_path / "cache")
    got = sorted(cache.decode(cache.document(i)[:-1]) for i in range(cache.num_documents))
    assert got == sorted(texts + texts[:3] + ["from memory"])
    assert [i["path"] for i in cache.spec["inputs"]][:1] == [plain]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        tc.build_cache(str(tmp_path / "*.nothing"), tmp_path / "x", gpt2_tokenizer_path)
    with pytest.raises(ValueError, match="unsupported file type"):
        (tmp_path / "data.csv").write_text("a,b")
        tc.build_cache(str(tmp_path / "data.csv"), tmp_path / "x", gpt2_tokenizer_path)


def test_large_vocabulary_uses_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[EOS]"] = 70_000
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tc.build_cache(iter(["w1 w69999 w65536", "w5"]), tmp_path / "c", tok, eos="[EOS]", progress=False)
    cache = tc.TokenCache(tmp_path / "c")
    assert cache.dtype == np.uint32
    assert cache.document(0).tolist() == [1, 69999, 65536, 70000]
    assert read_manifest(str(tmp_path / "c"))["spec"]["dtype"] == "U32"


def test_missing_eos_token_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer, models
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    with pytest.raises(ValueError, match="end-of-document token"):
        tc.build_cache(iter(["a"]), tmp_path / "c", tok)
    tc.build_cache(iter(["a b"]), tmp_path / "c", tok, eos=None, progress=False)
