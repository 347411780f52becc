"""A batch of documents' arrays is read in one gather per field (`cache.gather_arrays`, spans by
`cache.document_spans`), and `pad_collate` in a DataLoader worker pads them straight into shared
memory; what comes out equals the per-document reads bit for bit (issue 32, read speed)."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

import torchcache as tc
from torchcache.train.transfer import items_become_the_batch


def _cache(tmp_path, tokenizer):
    """20 documents over several blocks: 'b' int32 [k % 3, 2] boxes (some with none), 'img'
    uint8 images of random shapes [h, w, 3], 'w' float32 [n] per document."""
    rng = np.random.default_rng(0)
    with open(tmp_path / "a.jsonl", "w") as f:
        for k in range(20):
            h, w = (int(x) for x in rng.integers(1, 9, size=2))
            f.write(json.dumps({"text": f"document {k} " * (1 + k % 4),
                                "b": [[k, k + 1]] * (k % 3),
                                "img": rng.integers(0, 256, size=(h, w, 3)).tolist(),
                                "w": rng.standard_normal(1 + k % 5).tolist()}) + "\n")
    result = tc.build_cache(str(tmp_path / "a.jsonl"), tmp_path / "c", tokenizer, progress=False,
                            arrays={"b": "int32[*, 2]", "img": "uint8[*, *, 3]", "w": "float32[*]"},
                            block_tokens=16)
    cache = tc.TokenCache(result.path)
    assert cache.num_blocks > 3
    return cache


def test_gather_arrays_and_document_spans_equal_the_per_document_reads(tmp_path, gpt2_tokenizer_path):
    cache = _cache(tmp_path, gpt2_tokenizer_path)
    indices = [7, 0, 19, 7, -1, 3, 12, 1]  # across blocks, out of order, repeated, from the end
    got = cache.gather_arrays(indices)
    assert sorted(got) == ["b", "img", "w"]
    for name, (values, shapes) in got.items():
        assert values.flags.writeable and values.ndim == 1 and shapes.dtype == np.int64
        at = 0
        for k, d in enumerate(indices):
            expected = cache.document_arrays(d)[name]
            assert shapes[k].tolist() == list(expected.shape)
            piece = values[at: at + expected.size].reshape(expected.shape)
            assert piece.dtype == expected.dtype and piece.tobytes() == expected.tobytes()
            at += expected.size
        assert at == values.size
    assert cache.document_spans(indices).tolist() == [list(cache.document_span(d)) for d in indices]
    empty_values, empty_shapes = cache.gather_arrays([])["img"]
    assert empty_values.dtype == np.uint8 and empty_values.size == 0 and empty_shapes.shape == (0, 3)
    assert cache.document_spans([]).shape == (0, 2)
    with pytest.raises(IndexError, match="document 20 outside"):
        cache.gather_arrays([1, 20])
    with pytest.raises(IndexError, match="document -21 outside"):
        cache.document_spans([-21])
    with pytest.raises(TypeError, match="indices"):
        cache.gather_arrays([1.5])


def test_document_dataset_items_are_the_cache_arrays(tmp_path, gpt2_tokenizer_path):
    cache = _cache(tmp_path, gpt2_tokenizer_path)
    docs = tc.DocumentDataset(cache)
    indices = [5, 2, 18, 2]
    for d, item in zip(indices, docs.__getitems__(indices)):
        assert item["input_ids"].tolist() == cache.document(d).tolist()
        for name, expected in cache.document_arrays(d).items():
            assert item[name].dtype == torch.from_numpy(expected.copy()).dtype
            assert item[name].numpy().tobytes() == expected.tobytes()
            assert list(item[name].shape) == list(expected.shape)
    assert docs.__getitems__([]) == []


def shared_padding(items):
    """pad_collate in a worker, reporting whether its padded arrays were made in shared memory."""
    batch = tc.pad_collate(items)
    batch["made_shared"] = torch.tensor([batch[n].is_shared() for n in ("b", "img", "w")])
    return batch


def test_pad_collate_in_a_worker_pads_into_shared_memory_with_zero_padding(tmp_path,
                                                                           gpt2_tokenizer_path):
    """In a worker, pad_collate makes the batches it pads in shared memory (sent without another
    copy); the rows a DocumentDataset read for a collate function of one's own stay in ordinary
    memory (that collate may copy them). Padding is zero in every dimension, as a numpy oracle
    pads, in workers and in-process, with pad_collate itself or a partial of it too."""
    cache = _cache(tmp_path, gpt2_tokenizer_path)
    docs = tc.DocumentDataset(cache)
    for workers, collate in ((0, shared_padding), (2, shared_padding),
                             (2, functools.partial(tc.pad_collate, pad_id=7))):
        loader = tc.DataLoader(docs, batch_size=6, collate_fn=collate, num_workers=workers,
                               shuffle=True, seed=3)
        order = [i for i in iter(tc.DistributedSampler(docs, seed=3))]
        for k, batch in enumerate(loader):
            if collate is shared_padding:  # b and w: rows, taken as they are; img: padded here
                assert batch["made_shared"].tolist() == [False, workers > 0, False]
            chosen = order[6 * k: 6 * k + 6]
            for name in ("b", "img", "w"):
                arrays = [cache.document_arrays(d)[name] for d in chosen]
                largest = np.max([a.shape for a in arrays], axis=0)
                oracle = np.zeros((len(arrays), *largest), dtype=arrays[0].dtype)
                for i, a in enumerate(arrays):
                    oracle[(i, *(slice(0, n) for n in a.shape))] = a
                assert batch[name].numpy().tobytes() == oracle.tobytes()
                assert batch[name].shape == oracle.shape
                assert batch[f"{name}_shape"].tolist() == [list(a.shape) for a in arrays]


class PaddedInWorker(torch.utils.data.Dataset):
    """Item k: whether pad_collate's batch of 4 DocumentDataset items lies in shared memory,
    with the items read inside items_become_the_batch(k == 1), in a worker process."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self) -> int:
        return 2

    def __getitem__(self, k: int) -> list[bool]:
        with items_become_the_batch(k == 1):
            items = self.docs.__getitems__([0, 5, 9, 13])
        batch = tc.pad_collate(items)
        return [batch[name].is_shared() for name in ("b", "w")] + \
            [batch["b"].untyped_storage().data_ptr() == items[0]["b"].untyped_storage().data_ptr()]


def test_rows_read_for_pad_collate_in_a_worker_are_made_in_shared_memory(tmp_path, gpt2_tokenizer_path):
    docs = tc.DocumentDataset(_cache(tmp_path, gpt2_tokenizer_path))
    loader = torch.utils.data.DataLoader(PaddedInWorker(docs), batch_size=None, num_workers=1)
    assert list(loader) == [[False, False, True], [True, True, True]]


def test_pad_collate_takes_the_padded_batch_the_items_are_rows_of(tmp_path, gpt2_tokenizer_path):
    """DocumentDataset items of a field whose records differ only in their first dimension are
    rows of one zero-padded batch: pad_collate returns it (no second copy). Items in another
    order, a part of them, or rows of a tensor of one's own are padded anew, with zeros."""
    cache = _cache(tmp_path, gpt2_tokenizer_path)
    docs = tc.DocumentDataset(cache)
    items = docs.__getitems__([3, 11, 4, 0])
    batch = tc.pad_collate(items)
    for name in ("b", "w"):  # rows: only the first dimension differs
        assert batch[name].untyped_storage().data_ptr() == items[0][name].untyped_storage().data_ptr()
        assert all(item[name].is_contiguous() for item in items)
    assert batch["img"].untyped_storage().data_ptr() != items[0]["img"].untyped_storage().data_ptr()
    for chosen in (items[::-1], items[:3], [items[1], items[1], items[2], items[3]]):
        again = tc.pad_collate(chosen)
        for name in ("b", "w"):
            arrays = [item[name].numpy() for item in chosen]
            oracle = np.zeros((len(arrays), *np.max([a.shape for a in arrays], axis=0)),
                              dtype=arrays[0].dtype)
            for i, a in enumerate(arrays):
                oracle[(i, *(slice(0, n) for n in a.shape))] = a
            assert again[name].numpy().tobytes() == oracle.tobytes() and again[name].shape == oracle.shape
            assert again[name].untyped_storage().data_ptr() != batch[name].untyped_storage().data_ptr()
    mine = torch.arange(1, 25, dtype=torch.float32).reshape(3, 4, 2)  # no zeros to borrow
    rows = [{"input_ids": torch.tensor([1]), "x": mine[i, :n]} for i, n in enumerate((4, 1, 2))]
    padded = tc.pad_collate(rows)["x"]
    assert padded[1, 1:].eq(0).all() and padded[2, 2:].eq(0).all() and padded[0].equal(mine[0])
