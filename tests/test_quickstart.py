"""Quick start: training on the committed prefix of a cache while the builder is still running."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from conftest import paragraphs, wait_for_blocks, write_jsonl

import torchcache as tc

SEQ, WINDOW, BATCH = 32, 256, 8


class _GatedDocuments:
    """Yields the first `gate` documents, then waits until released: a build that is
    deterministically incomplete while the test starts training."""

    def __init__(self, docs: list[str], gate: int):
        self.docs, self.gate, self.release = docs, gate, threading.Event()

    def __iter__(self):
        for i, doc in enumerate(self.docs):
            if i == self.gate:
                assert self.release.wait(120), "test never released the build"
            yield doc


def _batches(loader, count):
    out, it = [], iter(loader)
    while len(out) < count:
        try:
            out.append(next(it)["input_ids"])
        except StopIteration:
            it = iter(loader)
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_training_starts_on_a_growing_cache_and_matches_the_final_stream(tmp_path, books, workers,
                                                                        gpt2_tokenizer_path):
    docs = paragraphs(books)
    gated = _GatedDocuments(docs, gate=1050)
    handle = tc.build_cache(iter(gated), tmp_path / "c", gpt2_tokenizer_path, block_tokens=500,
                            background=True)
    cache = wait_for_blocks(tmp_path / "c", handle, minimum=20)
    ds = tc.TokenDataset(cache, SEQ)
    assert not ds.complete and len(ds) >= WINDOW
    sampler = tc.DistributedSampler(ds, seed=5, window=WINDOW, build=handle)
    loader = tc.DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=workers)
    it = iter(loader)
    early = [next(it)["input_ids"] for _ in range(WINDOW // BATCH)]  # one whole committed window
    assert not tc.TokenCache(tmp_path / "c").complete, "these batches came from a growing cache"
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["num_samples"] is None and state["window"] == WINDOW
    gated.release.set()
    n_total = 0
    rest = []
    for batch in it:  # the sampler waits for each next window, then the epoch ends at the final n
        rest.append(batch["input_ids"])
    handle.wait(120)
    n_total = len(tc.TokenDataset(tmp_path / "c", SEQ))
    assert sum(len(b) for b in early + rest) == n_total  # exactly one epoch, nothing dropped
    more = _batches(loader, 10)  # epoch 1: a full permutation

    # the same seed and window over the finished cache gives the very same stream
    final = tc.TokenDataset(tmp_path / "c", SEQ)
    ref_loader = tc.DataLoader(final, batch_size=BATCH, sampler=tc.DistributedSampler(final, seed=5, window=WINDOW))
    ref = _batches(ref_loader, len(early) + len(rest) + 10)
    got = early + rest + more
    assert all(torch.equal(a, b) for a, b in zip(got, ref))

    # a state saved while the cache was growing resumes exactly on the finished cache
    resumed = tc.DataLoader(final, batch_size=BATCH,
                            sampler=tc.DistributedSampler(final, seed=5, window=WINDOW))
    resumed.load_state_dict(state)
    again = _batches(resumed, len(rest) + 10)
    assert all(torch.equal(a, b) for a, b in zip(again, rest + more))


def test_first_epoch_is_shuffled_within_windows_later_epochs_fully(tmp_path, books, gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "d.jsonl", paragraphs(books, 400))
    tc.build_cache(src, tmp_path / "c", gpt2_tokenizer_path, progress=False)
    ds = tc.TokenDataset(tmp_path / "c", 8)
    n = len(ds)
    sampler = tc.DistributedSampler(ds, seed=1, window=100)
    epoch0 = sampler.indices_for_positions(np.arange(n))
    for k in range(0, n, 100):
        window = epoch0[k:k + 100]
        assert sorted(window.tolist()) == list(range(k, min(k + 100, n)))
        if len(window) > 10:
            assert window.tolist() != sorted(window.tolist())
    epoch1 = sampler.indices_for_positions(np.arange(n, 2 * n))
    assert sorted(epoch1.tolist()) == list(range(n))
    assert np.mean(np.abs(epoch1 - np.arange(n))) > n / 10  # moved far, not window-local


def test_a_failed_build_stops_the_waiting_sampler_with_its_error(tmp_path, books, gpt2_tokenizer_path):
    docs = [json.dumps({"text": t}) for t in paragraphs(books, 1200)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(docs[:1000] + ["{broken"] + docs[1000:]) + "\n")
    handle = tc.build_cache(str(bad), tmp_path / "c", gpt2_tokenizer_path, block_tokens=500,
                            num_workers=1, background=True)
    cache = wait_for_blocks(tmp_path / "c", handle)
    ds = tc.TokenDataset(cache, SEQ)
    sampler = tc.DistributedSampler(ds, seed=0, window=64, build=handle, wait_timeout=60)
    with pytest.raises(RuntimeError, match="background build failed.*bad.jsonl:1001"):
        list(sampler)


def test_a_stalled_build_times_out_with_a_clear_error(tmp_path, books, gpt2_tokenizer_path):
    gated = _GatedDocuments(paragraphs(books), gate=1050)
    handle = tc.build_cache(iter(gated), tmp_path / "c", gpt2_tokenizer_path, block_tokens=500,
                            background=True)
    try:
        ds = tc.TokenDataset(wait_for_blocks(tmp_path / "c", handle), SEQ)
        with pytest.raises(ValueError, match="window="):
            tc.DistributedSampler(ds)
        sampler = tc.DistributedSampler(ds, window=64, wait_timeout=0.3)
        with pytest.raises(TimeoutError, match="did not grow"):
            list(sampler)
    finally:
        gated.release.set()
        handle.wait(60)
