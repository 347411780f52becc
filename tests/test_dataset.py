"""TokenDataset and DocumentDataset: windows, labels, document boundaries, batched reads, pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import paragraphs, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcache as tc


@pytest.fixture(scope="module")
def cache_path(tmp_path_factory, books, gpt2_tokenizer_path):
    d = tmp_path_factory.mktemp("ds")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 500))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=700, progress=False)
    return d / "cache"


@settings(max_examples=40, deadline=None)
@given(seq_len=st.integers(1, 300))
def test_windows_tile_the_stream_with_one_token_overlap(cache_path, seq_len):
    cache = tc.TokenCache(cache_path)
    ds = tc.TokenDataset(cache, seq_len)
    stream = cache.read(0, cache.num_tokens).astype(np.int64)
    assert len(ds) == (cache.num_tokens - 1) // seq_len
    picks = sorted({0, len(ds) - 1, len(ds) // 2, len(ds) // 3})
    for s, item in zip(picks, ds.__getitems__(picks)):
        window = stream[s * seq_len: s * seq_len + seq_len + 1]
        assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (seq_len,)
        assert item["input_ids"].tolist() == window[:-1].tolist()
        assert item["labels"].tolist() == window[1:].tolist()
    # every token but the very first is a target exactly once (up to the stream's tail)
    targets = np.concatenate([ds[s]["labels"].numpy() for s in range(min(len(ds), 40))])
    assert targets.tolist() == stream[1:1 + len(targets)].tolist()


def test_hf_style_labels_equal_input_ids(cache_path):
    ds = tc.TokenDataset(cache_path, 64, labels="same")
    item = ds[5]
    assert torch.equal(item["labels"], item["input_ids"])
    with pytest.raises(ValueError, match="labels"):
        tc.TokenDataset(cache_path, 64, labels="next")


def test_document_boundaries_come_from_the_offsets(cache_path):
    cache = tc.TokenCache(cache_path)
    eos = cache.eos_id
    ds = tc.TokenDataset(cache, 128, document_boundaries=True, max_segments=16)
    doc_starts = {cache.document_span(i)[0] for i in range(cache.num_documents)}
    multi = 0
    for s in range(len(ds)):
        item = ds[s]
        k = int(item["num_segments"])
        cu = item["cu_seqlens"].tolist()
        assert cu[0] == 0 and cu[k] == 128 and cu[k:] == [128] * (17 - k)
        assert all(a < b for a, b in zip(cu[:k], cu[1:k + 1]))
        for cut in cu[1:k]:
            assert s * 128 + cut in doc_starts  # a cut is exactly a document start
            assert item["input_ids"][cut - 1] == eos  # ... right after an EOS
            assert item["position_ids"][cut] == 0
        pos = item["position_ids"]
        for a, b in zip(cu[:k], cu[1:k + 1]):
            assert (pos[a + 1:b] - pos[a:b - 1] == 1).all()
        multi += k > 1
    assert multi > 10
    with pytest.raises(ValueError, match="max_segments"):
        tiny = tc.TokenDataset(cache, 128, document_boundaries=True, max_segments=1)
        [tiny[s] for s in range(len(tiny))]


def test_batched_reads_equal_single_reads_and_errors(cache_path):
    ds = tc.TokenDataset(cache_path, 50)
    idx = [3, 0, len(ds) - 1, 3, -1]
    batch = ds.__getitems__(idx)
    for i, item in zip(idx, batch):
        assert torch.equal(item["input_ids"], ds[i]["input_ids"])
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]
    with pytest.raises(ValueError, match="seq_len"):
        tc.TokenDataset(cache_path, 0)


def test_document_dataset_returns_documents(cache_path, books):
    docs = tc.DocumentDataset(cache_path)
    cache = tc.TokenCache(cache_path)
    texts = paragraphs(books, 500)
    assert len(docs) == len(texts)
    for i in (0, 7, len(docs) - 1):
        assert docs[i].dtype == torch.int64
        assert cache.decode(docs[i][:-1]) == texts[i]
    loader = tc.DataLoader(docs, batch_size=4, collate_fn=list, shuffle=False)
    first = next(iter(loader))
    assert [cache.decode(d[:-1]) for d in first] == texts[:4]


def test_dataset_pickles_small_for_workers(cache_path):
    ds = tc.TokenDataset(cache_path, 2048)
    ds[0]
    assert len(pickle.dumps(ds)) < 64 * 1024
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[1]["input_ids"], ds[1]["input_ids"])


def test_shuffled_loader_over_a_real_cache_resumes_exactly(cache_path):
    ds = tc.TokenDataset(cache_path, 16)
    def make():
        return tc.DataLoader(ds, batch_size=4, sampler=tc.DistributedSampler(ds, seed=9),
                             num_workers=2)
    full = [b["input_ids"] for _, b in zip(range(len(ds) // 4 + 30), _forever(make()))]
    first = make()
    it = _forever(first)
    head = [next(it)["input_ids"] for _ in range(37)]
    state = first.state_dict()
    assert state["fingerprint"] == ds.fingerprint
    second = make()
    second.load_state_dict(state)
    tail = [b["input_ids"] for _, b in zip(range(len(full) - 37), _forever(second))]
    assert all(torch.equal(a, b) for a, b in zip(head + tail, full))
    other = tc.DataLoader(tc.TokenDataset(cache_path, 17), batch_size=4)
    with pytest.raises(ValueError, match="fingerprint"):
        other.load_state_dict(state)


def _forever(loader):
    while True:
        yield from loader


@pytest.mark.parametrize("options", [{}, {"labels": "same"},
                                     {"document_boundaries": True, "max_segments": 32}])
def test_compact_transfer_from_workers_gives_identical_batches(cache_path, options):
    ds = tc.TokenDataset(cache_path, 32, **options)

    def batches(compact):
        loader = tc.DataLoader(ds, batch_size=8, sampler=tc.DistributedSampler(ds, seed=4),
                               num_workers=2, compact_transfer=compact)
        return [b for _, b in zip(range(12), loader)], loader

    plain, _ = batches(False)
    compact, loader = batches(True)
    assert loader.dataset is ds and set(ds[0]) >= {"input_ids", "labels"}
    for a, b in zip(plain, compact):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _describe_items(items):
    """collate_fn: what torch's fetcher handed over, as plain data."""
    return [type(items).__name__, len(items), [sorted(item) for item in items]]


def test_getitems_returns_a_list_of_samples_in_workers_too(cache_path):
    ds = tc.TokenDataset(cache_path, 32)
    next(iter(tc.DataLoader(ds, batch_size=4, num_workers=2)))  # compact transfer on this dataset
    plain = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_describe_items)
    kind, count, keys = next(iter(plain))
    assert (kind, count, keys) == ("list", 4, [["input_ids", "labels"]] * 4)
