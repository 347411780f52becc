"""tc.pad_collate and tc.packed_collate: batching whole documents, through real loaders with workers."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.utils.data
from conftest import paragraphs, write_jsonl

import torchcache as tc


@pytest.fixture(scope="module")
def docs(tmp_path_factory, books, gpt2_tokenizer_path):
    d = tmp_path_factory.mktemp("collate")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 200))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=900, progress=False)
    return tc.DocumentDataset(d / "cache")


def check_padded(batch, documents, pad_id, max_length=None):
    documents = [d[:max_length] for d in documents]
    lengths = [len(d) for d in documents]
    assert batch["lengths"].tolist() == lengths
    assert batch["input_ids"].shape == (len(documents), max(lengths))
    for row, doc in enumerate(documents):
        n = len(doc)
        assert torch.equal(batch["input_ids"][row, :n], doc)
        assert (batch["input_ids"][row, n:] == pad_id).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert torch.equal(batch["labels"][row, :n], doc) and (batch["labels"][row, n:] == -100).all()
    assert all(t.dtype == torch.int64 for t in batch.values())


def check_packed(batch, documents, max_length=None):
    documents = [d[:max_length] for d in documents]
    assert torch.equal(batch["input_ids"], torch.cat(documents))
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu.tolist() == np.cumsum([0] + [len(d) for d in documents]).tolist()
    assert batch["max_seqlen"] == max(len(d) for d in documents)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        assert batch["position_ids"][a:b].tolist() == list(range(b - a))
        assert batch["labels"][a] == -100 and torch.equal(batch["labels"][a + 1:b], batch["input_ids"][a + 1:b])


def test_pad_collate_through_a_torchcache_loader_with_workers(docs):
    eos = docs.cache.eos_id
    collate = functools.partial(tc.pad_collate, pad_id=eos)
    loader = tc.DataLoader(docs, batch_size=8, collate_fn=collate, num_workers=2)
    batches = list(loader)
    assert len(batches) == -(-len(docs) // 8)
    for b, batch in enumerate(batches):
        check_padded(batch, [docs[i] for i in range(8 * b, min(8 * b + 8, len(docs)))], eos)


def test_packed_collate_through_a_torch_loader_with_workers(docs):
    collate = functools.partial(tc.packed_collate, max_length=64)
    loader = torch.utils.data.DataLoader(docs, batch_size=5, collate_fn=collate, num_workers=2)
    for b, batch in enumerate(loader):
        if b == 6:
            break
        check_packed(batch, [docs[i] for i in range(5 * b, 5 * b + 5)], max_length=64)


def test_options_and_errors():
    a, b = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([1, 2])
    batch = tc.pad_collate([a, b], pad_id=0, max_length=3, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [1, 2, 0, 0]]
    assert batch["lengths"].tolist() == [3, 2]
    check_padded(tc.pad_collate([a, b], pad_id=-1), [a, b], -1)
    check_packed(tc.packed_collate([a, b, torch.tensor([3])]), [a, b, torch.tensor([3])])
    np_docs = [np.array([1, 2], dtype=np.uint16), np.array([3], dtype=np.int64)]  # any int type
    assert tc.packed_collate(np_docs)["input_ids"].tolist() == [1, 2, 3]
    for call, error, match in [
        (lambda: tc.pad_collate([]), ValueError, "empty"),
        (lambda: tc.pad_collate(torch.zeros(2, 3, dtype=torch.long)), TypeError, "list of documents"),
        (lambda: tc.pad_collate([torch.zeros(2, 3, dtype=torch.long)]), TypeError, r"batch\[0\]"),
        (lambda: tc.packed_collate([torch.tensor([1.5])]), TypeError, r"batch\[0\]"),
        (lambda: tc.pad_collate([a], pad_id=1.0), TypeError, "pad_id"),
        (lambda: tc.pad_collate([a], max_length=0), ValueError, "max_length"),
        (lambda: tc.pad_collate([a], pad_to_multiple_of=0), ValueError, "pad_to_multiple_of"),
        (lambda: tc.packed_collate([a], max_length="8"), TypeError, "max_length"),
    ]:
        with pytest.raises(error, match=match):
            call()
