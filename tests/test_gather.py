"""One gather for every dataset: rows of several caches in one array (gather_rows), and a
mixture of TokenDatasets reading its batch through it, equal to its sources' own items."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import torchcache as tc
from torchcache.read.cache import gather_rows
from conftest import paragraphs, write_jsonl


@pytest.fixture(scope="module")
def two_caches(tmp_path_factory, books, gpt2_tokenizer_path):
    root = tmp_path_factory.mktemp("gather")
    texts = paragraphs(books, 400)
    out = []
    for name, part, block_tokens in (("a", texts[:250], 2048), ("b", texts[250:], 1500)):
        data = write_jsonl(root / f"{name}.jsonl", part)
        tc.build_cache(data, str(root / name), gpt2_tokenizer_path, block_tokens=block_tokens,
                       progress=False)
        out.append(str(root / name))
    return out


def test_gather_rows_equals_each_cache_read_on_its_own(two_caches):
    caches = [tc.TokenCache(p) for p in two_caches] + [tc.TokenCache(two_caches[0], map_bytes=0)]
    rng = np.random.default_rng(0)
    for _ in range(20):
        which = rng.integers(0, 3, 13)
        starts = np.array([rng.integers(0, caches[k].num_tokens - 300) for k in which])
        rows = gather_rows(caches, which, starts, 300)
        for row, k, s in zip(rows, which, starts):  # rows crossing block ends included
            assert np.array_equal(row, caches[k].read(int(s), int(s) + 300))
    assert gather_rows(caches[:1], [0], [5], 7)[0].tolist() == caches[0].read(5, 12).tolist()


def test_gather_rows_names_what_is_wrong(two_caches):
    a, b = (tc.TokenCache(p) for p in two_caches)
    with pytest.raises(IndexError, match=f"outside \\[0, {b.num_tokens}\\) of .*b"):
        gather_rows([a, b], [0, 1], [0, b.num_tokens - 5], 10)
    with pytest.raises(IndexError, match="which must be in \\[0, 2\\)"):
        gather_rows([a, b], [2], [0], 10)
    with pytest.raises(ValueError, match="one entry per row"):
        gather_rows([a, b], [0, 1], [0], 10)
    with pytest.raises(TypeError, match="non-empty sequence of TokenCache"):
        gather_rows([], [], [], 10)
    with pytest.raises(ValueError, match="C-contiguous"):
        gather_rows([a], [0], [0], 10, out=np.empty((1, 9), dtype=a.dtype))


def test_a_mixture_of_token_datasets_reads_one_array_and_equals_its_items(two_caches):
    a, b = (tc.TokenDataset(p, 64) for p in two_caches)
    mix = tc.MixtureDataset({"a": a, "b": b}, weights={"a": 2, "b": 1}, block_size=30, seed=3)
    # a period read again (RowPlan), any subset of it, and indices all over (located each time)
    for idx in (np.arange(0, 16), np.arange(16, 30), np.array([29, 3, 3, 17]),
                np.array([5, 900, 3, 10**9, 17]), np.arange(60, 61), np.arange(61, 63)):
        batch = mix.get_batch(idx)
        expected = default_collate([mix[int(i)] for i in idx])
        assert batch.keys() == expected.keys()
        for key in batch:
            assert batch[key].dtype == torch.int64 and torch.equal(batch[key], expected[key])
    same = tc.TokenDataset(two_caches[0], 64, labels="same")  # other labels: each source's batch
    other = tc.MixtureDataset({"a": same, "b": b}, weights={"a": 2, "b": 1}, block_size=30)
    idx = np.arange(0, 16)
    assert torch.equal(other.get_batch(idx)["labels"],
                       default_collate([other[int(i)] for i in idx])["labels"])
