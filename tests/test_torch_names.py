"""Torch names mean torch things: the sampler's num_samples/total_size/drop_last, and `labels`.

`DistributedSampler.num_samples` is torch's per-rank count (the dataset length is
`dataset_size`), `drop_last` binds positionally as in torch, and `labels` means one of two named
alignments ("shifted", "same") wherever a batch is made.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
import torch.utils.data
from conftest import paragraphs, write_jsonl

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset  # noqa: E402

import torchcache as tc  # noqa: E402

SIZES = [(10, 4), (12, 4), (7, 2), (5, 5), (1000, 3), (9, 1)]


def torch_sampler(n, *args):
    return torch.utils.data.DistributedSampler(IdDataset(n), *args)


@pytest.mark.parametrize("n, world", SIZES)
@pytest.mark.parametrize("drop_last", [False, True])
def test_num_samples_and_total_size_are_torchs(n, world, drop_last):
    for rank in range(world):
        ours = tc.DistributedSampler(IdDataset(n), world, rank, False, 0, drop_last)
        theirs = torch_sampler(n, world, rank, False, 0, drop_last)
        assert ours.num_samples == theirs.num_samples
        assert ours.total_size == theirs.total_size == ours.epoch_size
        assert len(ours) == len(theirs)
        assert ours.dataset_size == n
        assert list(ours) == list(theirs)  # the first epoch, drop_last or not


def test_drop_last_binds_positionally_and_by_keyword_as_in_torch():
    ds = IdDataset(10)
    s = tc.DistributedSampler(ds, 3, 2, False, 5, True)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last) == (3, 2, False, 5, True)
    assert tc.DistributedSampler(ds, 3, 2, drop_last=True).drop_last is True
    assert tc.DistributedSampler(ds).drop_last is False
    with pytest.raises(TypeError):  # everything after drop_last is keyword-only
        tc.DistributedSampler(ds, 3, 2, False, 5, True, 3)


def test_drop_last_shortens_the_epoch_but_the_stream_goes_on():
    n, world = 10, 3  # epochs of 9 positions: position 9 (index 9) opens the next epoch
    ranks = [tc.DistributedSampler(IdDataset(n), world, r, False, 0, True) for r in range(world)]
    first = [list(s) for s in ranks]
    second = [list(s) for s in ranks]
    assert first == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert second == [[9, 2, 5], [0, 3, 6], [1, 4, 7]]
    shuffled = [tc.DistributedSampler(IdDataset(n), world, r, True, 7, True) for r in range(world)]
    stream = [tc.DistributedSampler(IdDataset(n), world, r, True, 7) for r in range(world)]
    for ours, plain in zip(shuffled, stream):  # the same stream, only cut elsewhere
        taken = list(ours) + list(ours)
        assert taken == plain.indices_for_positions(np.arange(2 * 9)[ours.rank::world]).tolist()


def test_a_state_saved_with_drop_last_loads_without_it():
    saved = tc.DistributedSampler(IdDataset(10), 3, 0, True, 4, True)
    next(iter(saved))
    other = tc.DistributedSampler(IdDataset(10), 3, 0, True, 4)
    other.load_state_dict(saved.state_dict())
    assert other.position == saved.position == 3


def test_drop_last_refuses_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match="drop_last=True with len\\(dataset\\)=3 < num_replicas=4"):
        tc.DistributedSampler(IdDataset(3), 4, 0, drop_last=True)


def test_the_saved_num_samples_field_is_still_the_dataset_length():
    sampler = tc.DistributedSampler(IdDataset(10), 4, 1)
    assert sampler.num_samples == 3 and sampler.dataset_size == 10
    assert sampler.state_dict()["num_samples"] == 10
    with pytest.raises(ValueError, match="num_samples: saved 3, this DistributedSampler has 10"):
        sampler.load_state_dict({**sampler.state_dict(), "num_samples": 3})


class Recording(IdDataset):
    """A dataset that records whether anything called its follow_sampler."""

    def __init__(self, n):
        super().__init__(n)
        self.followed = []

    def follow_sampler(self, sampler):
        self.followed.append(sampler)


def test_making_a_sampler_never_touches_the_dataset():
    ds = Recording(10)
    sampler = tc.DistributedSampler(ds, 2, 0, seed=1)
    list(sampler)
    assert ds.followed == []


# -- labels -----------------------------------------------------------------------------------

DOCS = [torch.tensor([5, 6, 7, 8]), torch.tensor([9]), torch.tensor([10, 11, 12])]


def moved_left(labels: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``labels`` one place to the left along the last dimension, ``last`` entering at the end."""
    return torch.cat([labels[..., 1:], last.reshape(labels.shape[:-1] + (1,))], dim=-1)


def test_pad_collate_shifted_labels_are_the_same_labels_moved_left():
    same = tc.pad_collate(DOCS)
    shifted = tc.pad_collate(DOCS, labels="shifted")
    assert torch.equal(shifted["input_ids"], same["input_ids"])
    assert torch.equal(shifted["labels"], moved_left(same["labels"], torch.full((3,), -100)))
    assert shifted["labels"].tolist() == [[6, 7, 8, -100], [-100] * 4, [11, 12, -100, -100]]


def test_packed_collate_shifted_labels_are_the_same_labels_moved_left():
    same = tc.packed_collate(DOCS)
    shifted = tc.packed_collate(DOCS, labels="shifted")
    assert torch.equal(shifted["labels"], moved_left(same["labels"], torch.tensor(-100)))
    assert shifted["labels"].tolist() == [6, 7, 8, -100, -100, 11, 12, -100]


def test_shifted_labels_of_a_cut_document_end_with_the_token_after_the_cut():
    padded = tc.pad_collate(DOCS, max_length=2, labels="shifted")
    assert padded["input_ids"].tolist() == [[5, 6], [9, 0], [10, 11]]
    assert padded["labels"].tolist() == [[6, 7], [-100, -100], [11, 12]]
    packed = tc.packed_collate(DOCS, max_length=2, labels="shifted")
    assert packed["labels"].tolist() == [6, 7, -100, 11, 12]
    assert tc.pad_collate(DOCS, max_length=2)["labels"].tolist() == [[5, 6], [9, -100], [10, 11]]


def test_an_unknown_label_alignment_is_refused():
    for collate in (tc.pad_collate, tc.packed_collate):
        with pytest.raises(ValueError, match="labels must be one of 'same', 'shifted'"):
            collate(DOCS, labels="next")


@pytest.fixture(scope="module")
def cache(tmp_path_factory, books, gpt2_tokenizer_path):
    d = tmp_path_factory.mktemp("names")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 120))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=900, progress=False)
    return tc.TokenCache(d / "cache")


def test_token_windows_shifted_and_same_labels_differ_by_one_place(cache):
    a, b = tc.TokenDataset(cache, 32), tc.TokenDataset(cache, 32, labels="same")
    for i in range(0, len(a), max(1, len(a) // 7)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(y["labels"], y["input_ids"])
        assert torch.equal(x["labels"][:-1], y["labels"][1:])


def test_packed_rows_have_the_shifted_labels_packed_collate_gives(cache):
    ds = tc.PackedDataset(cache, seq_len=48)
    docs = tc.DocumentDataset(cache)
    split = False
    for i in range(len(ds)):
        row, expected = ds[i], []
        for doc, start, end in ds.row_documents(i):
            piece = docs[doc][start:end + 1]  # one token more when the document goes on
            split |= end < len(docs[doc])
            expected.append(tc.packed_collate([piece], max_length=end - start, labels="shifted"))
        labels = torch.cat([e["labels"] for e in expected])
        filled = len(labels)
        assert torch.equal(row["labels"][:filled], labels), i
        assert (row["labels"][filled:] == -100).all()
        assert torch.equal(row["input_ids"][:filled], torch.cat([e["input_ids"] for e in expected]))
    assert split  # the cache has documents longer than a row: their pieces were checked too
