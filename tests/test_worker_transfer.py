"""A DataLoader worker sends a batch's small tensors through the pipe (not a shared-memory
segment each) and its large ones in shared memory; both arrive with their dtype, shape and
bytes (torchcache.train.transfer)."""

from __future__ import annotations

import pickle

import torch

import torchcache as tc
from torchcache.train.transfer import INLINE_BYTES, inline_small_tensors


def small_tensors():
    """One tensor of each kind a batch may hold, all at most INLINE_BYTES."""
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.randint(0, 50_000, (8, 30), generator=g),
            "mask": torch.rand(8, 30, generator=g) > 0.5,
            "half": torch.randn(4, 5, generator=g).half(),
            "bf16": torch.randn(3, 7, generator=g).bfloat16(),
            "u8": torch.randint(0, 256, (2, 3, 3), dtype=torch.uint8, generator=g),
            "scalar": torch.tensor(7, dtype=torch.int32),
            "empty": torch.zeros(0, 80),
            "limit": torch.ones(INLINE_BYTES // 4, dtype=torch.float32),
            "nested": [torch.arange(5), (torch.tensor([1.5, 2.5]),)]}


class Batches(torch.utils.data.Dataset):
    """Item i: the small tensors, plus a large tensor and a non-contiguous small one."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict:
        return {**small_tensors(), "large": torch.full((INLINE_BYTES // 4 + 1,), float(i)),
                "strided": torch.arange(12).reshape(3, 4).t()}


def same(a, b) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.reshape(-1).contiguous().view(torch.uint8).equal(b.reshape(-1).contiguous().view(torch.uint8)))


def test_small_tensors_pickle_as_bytes_and_come_back_equal():
    batch = small_tensors()
    back = pickle.loads(pickle.dumps(inline_small_tensors(batch)))
    assert type(back["nested"]) is list and type(back["nested"][1]) is tuple
    for key in ("ids", "mask", "half", "bf16", "u8", "scalar", "empty", "limit"):
        assert same(back[key], batch[key]), key
        back[key].reshape(-1)[:1] = 0  # writable memory of its own
    assert same(back["nested"][0], batch["nested"][0]) and same(back["nested"][1][0], batch["nested"][1][0])


def test_a_worker_sends_small_tensors_inline_and_large_ones_in_shared_memory():
    loader = tc.DataLoader(Batches(), batch_size=None, num_workers=2)
    seen = 0
    for i, batch in enumerate(loader):
        expected = Batches()[i]
        for key in ("ids", "mask", "half", "bf16", "u8", "scalar", "empty", "limit"):
            assert same(batch[key], expected[key]), key
            assert not batch[key].is_shared(), f"{key} came through shared memory"
        assert same(batch["nested"][0], expected["nested"][0]) and not batch["nested"][0].is_shared()
        assert same(batch["large"], expected["large"]) and batch["large"].is_shared()
        assert same(batch["strided"], expected["strided"]) and batch["strided"].is_shared()
        assert batch["strided"].stride() == expected["strided"].stride()
        seen += 1
    assert seen == 4
