"""TokenCache conveniences: decode and document_key are cheap after the first call; checked indices."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import torchcache as tc
from torchcache.format.ledger import read_manifest

DATA = Path(__file__).parent / "data"


@pytest.fixture()
def keyed_cache(tmp_path, gpt2_tokenizer_path):
    tc.convert_webdataset(str(DATA / "compressed.tar"), tmp_path / "c",
                          tokenizer=gpt2_tokenizer_path, text_key="txt.gz", progress=False)
    return tmp_path / "c"


def test_decode_loads_the_tokenizer_once(keyed_cache, monkeypatch):
    import torchcache.read.cache as cache_module
    loads = []
    real = cache_module.cache_tokenizer
    monkeypatch.setattr(cache_module, "cache_tokenizer", lambda *a: loads.append(1) or real(*a))
    cache = tc.TokenCache(keyed_cache)
    ids = cache.document(0)[:50]
    text = cache.decode(ids)
    for _ in range(20):
        assert cache.decode(ids) == text
    assert len(loads) == 1, f"the tokenizer was loaded {len(loads)} times for 21 decodes"
    assert cache.tokenizer() is cache.tokenizer()


def test_document_keys_are_read_once_per_block(keyed_cache):
    cache = tc.TokenCache(keyed_cache)
    keys = [cache.document_key(i) for i in range(cache.num_documents)]
    assert keys[:3] == [f"compressed/000{i}" for i in (1, 2, 3)]
    manifest = read_manifest(str(keyed_cache))
    for entry in manifest["blocks"]:  # the keys files are gone: only what was read remains
        os.remove(keyed_cache / entry["keys"])
    assert [cache.document_key(i) for i in range(cache.num_documents)] == keys
    with pytest.raises(tc.CacheFormatError, match="missing"):
        tc.TokenCache(keyed_cache).document_key(0)


def test_indices_are_checked_not_truncated(keyed_cache):
    cache = tc.TokenCache(keyed_cache)
    assert np.array_equal(cache.document(np.int64(1)), cache.document(1))
    assert np.array_equal(cache.document(-1), cache.document(cache.num_documents - 1))
    for call, error, match in [
        (lambda: cache.document(1.0), TypeError, "i must be an integer"),
        (lambda: cache.document(True), TypeError, "i must be an integer"),
        (lambda: cache.read(0.5, 3), TypeError, "start"),
        (lambda: cache.read(0, cache.num_tokens + 1), IndexError, "token range"),
        (lambda: cache.document_at(2.0), TypeError, "token"),
        (lambda: cache.block_offsets(cache.num_blocks), IndexError, "block"),
        (lambda: cache.read_many(np.array([0]), 1.5), TypeError, "length"),
    ]:
        with pytest.raises(error, match=match):
            call()
