"""Every public argument is checked up front: a wrong type or value fails at once, naming it.

Datasets, the sampler, the loader (and the states it loads) and mixtures, through the public API
over small real caches. Also: a seq_len too long for a finished cache, and mixtures of sources
that were tokenized differently or give items of different shapes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch
import webdataset as wds
from conftest import paragraphs, write_jsonl

sys.path.insert(0, os.path.dirname(__file__))
from _helpers_resume import IdDataset  # noqa: E402

import torchcache as tc  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_cache(tmp_path_factory, books, gpt2_tokenizer_path) -> str:
    d = tmp_path_factory.mktemp("args-gpt2")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 150))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=2000, progress=False)
    return str(d / "cache")


@pytest.fixture(scope="module")
def other_tokenizer_path(tmp_path_factory, gpt2_tokenizer_path) -> str:
    """GPT-2 with one more special token: another tokenizer (fingerprint), same ids otherwise."""
    with open(gpt2_tokenizer_path, encoding="utf-8") as f:
        spec = json.load(f)
    spec["added_tokens"].append({"id": 50257, "content": "<|tc-other|>", "single_word": False,
                                 "lstrip": False, "rstrip": False, "normalized": False,
                                 "special": True})
    path = tmp_path_factory.mktemp("args-tok") / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def other_cache(tmp_path_factory, books, other_tokenizer_path) -> str:
    d = tmp_path_factory.mktemp("args-other")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 150))
    tc.build_cache(src, d / "cache", other_tokenizer_path, block_tokens=2000, progress=False)
    return str(d / "cache")


def _datasets(gpt2_cache: str) -> dict[str, object]:
    tokens = tc.TokenDataset(gpt2_cache, 16)
    return {
        "TokenDataset": tokens,
        "DocumentDataset": tc.DocumentDataset(gpt2_cache),
        "MixtureDataset": tc.MixtureDataset({"a": tokens, "b": tc.TokenDataset(gpt2_cache, 16,
                                                                                labels="same")},
                                            {"a": 1, "b": 1}, block_size=4),
    }


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return torch.equal(a, b)


# -- indices --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["TokenDataset", "DocumentDataset", "MixtureDataset"])
def test_index_must_be_an_integer(gpt2_cache, kind):
    ds = _datasets(gpt2_cache)[kind]
    for bad in (1.5, "3", True, np.float64(3.0), torch.tensor(3.0), None, [1, 2]):
        with pytest.raises(TypeError, match="index"):
            ds[bad]
    for bad in ([1.5], [0, "3"], [True], np.array([1.0, 2.0]), torch.tensor([1.0]),
                [[1, 2], [3]]):
        with pytest.raises(TypeError, match=r"indices"):
            ds.__getitems__(bad)
    want = ds[3]
    for good in (np.int64(3), np.uint8(3), np.int32(3), torch.tensor(3), torch.tensor(3, dtype=torch.int16)):
        assert _same(ds[good], want)
    for good in ([1, 3], np.array([1, 3], dtype=np.uint16), torch.tensor([1, 3]),
                 [np.int64(1), torch.tensor(3)]):
        assert all(_same(x, ds[i]) for x, i in zip(ds.__getitems__(good), (1, 3)))


@pytest.mark.parametrize("kind", ["TokenDataset", "DocumentDataset", "MixtureDataset"])
def test_huge_index_is_an_index_error(gpt2_cache, kind):
    ds = _datasets(gpt2_cache)[kind]
    for bad in (10**20, -10**20, 2**63, np.uint64(2**64 - 1)):
        with pytest.raises(IndexError):
            ds[bad]
    for bad in ([0, 10**20], [2**63], [1, -10**20], np.array([2**64 - 1], dtype=np.uint64)):
        with pytest.raises(IndexError):
            ds.__getitems__(bad)


def test_token_dataset_arguments(gpt2_cache):
    cases = [
        (dict(seq_len=True), TypeError, "seq_len"),
        (dict(seq_len=16.0), TypeError, "seq_len"),
        (dict(seq_len="16"), TypeError, "seq_len"),
        (dict(seq_len=0), ValueError, "seq_len"),
        (dict(seq_len=16, max_segments=True), TypeError, "max_segments"),
        (dict(seq_len=16, max_segments=2.0), TypeError, "max_segments"),
        (dict(seq_len=16, max_segments=0), ValueError, "max_segments"),
        (dict(seq_len=16, max_segments=17), ValueError, "max_segments"),
        (dict(seq_len=16, document_boundaries="yes"), TypeError, "document_boundaries"),
        (dict(seq_len=16, labels="next"), ValueError, "labels"),
        (dict(seq_len=16, labels=None), ValueError, "labels"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            tc.TokenDataset(gpt2_cache, **kwargs)
    with pytest.raises(TypeError, match="cache"):
        tc.TokenDataset(12, 16)
    with pytest.raises(TypeError, match="cache"):
        tc.DocumentDataset(None)
    ds = tc.TokenDataset(gpt2_cache, np.int64(16), max_segments=np.int32(4),
                         document_boundaries=np.bool_(True))
    assert (ds.seq_len, ds.max_segments, ds.document_boundaries) == (16, 4, True)
    assert type(ds.seq_len) is int
    with pytest.raises(TypeError, match="compact"):
        ds.expand_batch({"input_ids": torch.zeros(1, 16)})


# -- seq_len against the cache's size (issue 19) --------------------------------------------------

class _Gated:
    """Yields ``gate`` documents, then waits for ``release``: a build that stays incomplete."""

    def __init__(self, docs: list[str], gate: int) -> None:
        self.docs, self.gate, self.release = docs, gate, threading.Event()

    def __iter__(self):
        for i, doc in enumerate(self.docs):
            if i == self.gate:
                assert self.release.wait(60), "the test never released the build"
            yield doc


def _open_when_committed(path, handle) -> tc.TokenCache:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert handle.error is None, handle.error
        try:
            cache = tc.TokenCache(path)
            if cache.num_blocks:
                return cache
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise AssertionError("no block was committed in 60 s")


def test_seq_len_longer_than_a_finished_cache_is_refused(gpt2_cache, tmp_path, books, gpt2_tokenizer_path):
    tokens = tc.TokenCache(gpt2_cache).num_tokens
    with pytest.raises(ValueError, match=rf"seq_len={tokens}\b.*holds {tokens} tokens.*needs "
                                         rf"seq_len \+ 1 = {tokens + 1}.*seq_len <= {tokens - 1}\b"):
        tc.TokenDataset(gpt2_cache, tokens)
    assert len(tc.TokenDataset(gpt2_cache, tokens - 1)) == 1  # the longest that fits

    gated = _Gated(paragraphs(books), gate=1050)  # past the first batch of 1024 documents
    handle = tc.build_cache(iter(gated), tmp_path / "growing", gpt2_tokenizer_path,
                            block_tokens=500, background=True)
    try:
        cache = _open_when_committed(tmp_path / "growing", handle)
        early = tc.TokenDataset(cache, 10**9)  # a growing cache may be too short at first
        assert not early.complete and len(early) == 0
    finally:
        gated.release.set()
        handle.wait(60)
    with pytest.raises(ValueError, match="seq_len=1000000000 is too long"):
        tc.TokenDataset(tmp_path / "growing", 10**9)


# -- the DataLoader's state -----------------------------------------------------------------------

def _loader(n: int = 50, **kw) -> tc.DataLoader:
    ds = IdDataset(n)
    return tc.DataLoader(ds, batch_size=5, sampler=tc.DistributedSampler(ds, seed=3), **kw)


def _loader_state(**changes) -> dict:
    state = _loader().state_dict()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    "changes, error, match",
    [
        (dict(consumed=2**63 - 5), ValueError, r"consumed.*2\*\*62"),
        (dict(consumed=2**62), ValueError, r"consumed.*2\*\*62"),
        (dict(consumed=-1), ValueError, "consumed"),
        (dict(consumed=5.0), TypeError, "consumed"),
        (dict(consumed=True), TypeError, "consumed"),
        (dict(consumed="5"), TypeError, "consumed"),
        (dict(consumed=None), TypeError, "consumed"),
        (dict(seed=3.0), TypeError, "seed"),
        (dict(seed=True), TypeError, "seed"),
        (dict(shuffle=1), TypeError, "shuffle"),
        (dict(world_size=0), ValueError, "world_size"),
        (dict(world_size=1.0), TypeError, "world_size"),
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(window=0), ValueError, "window"),
        (dict(num_samples=-1), ValueError, "num_samples"),
        (dict(num_samples=50.0), TypeError, "num_samples"),
        (dict(fingerprint=1.5), TypeError, "fingerprint"),
        (dict(version="1"), ValueError, "version"),
        (dict(counts="dispatched"), ValueError, "counts"),
        (dict(extra=1), ValueError, r"unknown \['extra'\]"),
    ],
)
def test_loader_state_fields_are_validated_at_load(changes, error, match):
    loader = _loader()
    next(iter(loader))
    with pytest.raises(error, match=match):
        loader.load_state_dict(_loader_state(**changes))
    assert loader.consumed == 5  # unchanged
    assert next(iter(loader)).flatten().tolist() == \
        loader.sampler.indices_for_positions(np.arange(5, 10)).tolist()


def test_loader_state_missing_field_or_not_a_dict():
    loader = _loader()
    state = _loader_state()
    del state["consumed"]
    with pytest.raises(ValueError, match=r"missing \['consumed'\]"):
        loader.load_state_dict(state)
    with pytest.raises(TypeError, match="state"):
        loader.load_state_dict([("consumed", 5)])


def test_far_consumed_position_within_the_limit_still_works():
    loader = _loader()
    far = (2**62 - 10**6) // 5 * 5  # a whole number of batches of 5 (a step boundary)
    loader.load_state_dict(_loader_state(consumed=far))
    batch = next(iter(loader)).flatten().tolist()
    assert batch == loader.sampler.indices_for_positions(np.arange(far, far + 5)).tolist()
    assert loader.consumed == far + 5


def test_a_state_that_identifies_no_dataset_is_refused(gpt2_cache):
    ds = tc.TokenDataset(gpt2_cache, 16)
    loader = tc.DataLoader(ds, batch_size=4)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="fingerprint and num_samples"):
        loader.load_state_dict({**state, "fingerprint": None, "num_samples": None})
    with pytest.raises(ValueError, match="fingerprint and num_samples"):  # a quick-start one too
        loader.load_state_dict({**state, "fingerprint": None, "num_samples": None, "window": 8})
    with pytest.raises(ValueError, match="num_samples: saved null without a window"):
        loader.load_state_dict({**state, "num_samples": None})
    # one of them is enough to identify the dataset
    loader.load_state_dict({**state, "fingerprint": None, "consumed": 8})
    assert loader.consumed == 8


class _GrowingIds(IdDataset):
    """A dataset without a fingerprint whose cache is still being built."""

    complete = False

    def __init__(self, n: int) -> None:
        super().__init__(n, fingerprint=None)


def test_a_quick_start_state_without_fingerprint_still_loads():
    """What this library saves for a growing dataset without a fingerprint: both null, a window."""
    def make() -> tc.DataLoader:
        ds = _GrowingIds(64)
        return tc.DataLoader(ds, batch_size=4, sampler=tc.DistributedSampler(ds, seed=1, window=16))

    first = make()
    it = iter(first)
    next(it), next(it)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["fingerprint"] is None and state["num_samples"] is None and state["window"] == 16
    second = make()
    second.load_state_dict(state)
    assert second.consumed == 8
    # the same state with the window removed is not one this library writes
    with pytest.raises(ValueError, match="num_samples"):
        second.load_state_dict({**state, "window": None})


# -- the sampler ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seed=1.5), TypeError, "seed"),
        (dict(seed=True), TypeError, "seed"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(shuffle="no"), TypeError, "shuffle"),
        (dict(drop_last="yes"), TypeError, "drop_last"),
        (dict(world_size=2.0), TypeError, "world_size"),
        (dict(rank=-1), ValueError, "rank"),
        (dict(rank=True, world_size=2), TypeError, "rank"),
        (dict(infinite=1), TypeError, "infinite"),
        (dict(max_epochs=-1), ValueError, "max_epochs"),
        (dict(max_samples="3"), TypeError, "max_samples"),
        (dict(window=0), ValueError, "window"),
        (dict(wait_timeout=float("nan")), ValueError, "wait_timeout"),
        (dict(wait_timeout=0), ValueError, "wait_timeout"),
        (dict(wait_timeout="10"), TypeError, "wait_timeout"),
        (dict(build=object()), TypeError, "build"),
    ],
)
def test_sampler_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tc.DistributedSampler(IdDataset(10), **kwargs)


def test_sampler_methods_and_state():
    with pytest.raises(TypeError, match="dataset"):
        tc.DistributedSampler(5)
    s = tc.DistributedSampler(IdDataset(10), seed=2)
    for call, error, match in [
        (lambda: s.set_position(2**62), ValueError, "position"),
        (lambda: s.set_position(1.0), TypeError, "position"),
        (lambda: s.set_epoch(True), TypeError, "epoch"),
        (lambda: s.set_epoch(2**62), ValueError, "epoch"),
        (lambda: s.indices_for_positions([1.5]), TypeError, "positions"),
        (lambda: s.indices_for_positions([-1]), ValueError, "positions"),
        (lambda: s.iteration_length(-1), ValueError, "position"),
    ]:
        with pytest.raises(error, match=match):
            call()
    state = s.state_dict()
    for changes, error, match in [
        (dict(position=2**63), ValueError, "position"),
        (dict(position=3.0), TypeError, "position"),
        (dict(world_size=0), ValueError, "world_size"),
        (dict(counts="consumed"), ValueError, "counts"),
        (dict(num_samples=None), ValueError, "num_samples"),
        (dict(shuffle="yes"), TypeError, "shuffle"),
    ]:
        with pytest.raises(error, match=match):
            s.load_state_dict({**state, **changes})
    assert s.position == 0
    s.load_state_dict({**state, "position": 7})
    assert s.position == 7
    it = iter(s)
    it_state = it.state_dict()
    with pytest.raises(ValueError, match="remaining"):
        iter(s).load_state_dict({**it_state, "remaining": -1})


# -- the loader's own arguments -------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=True), TypeError, "batch_size"),
        (dict(batch_size=2.5), TypeError, "batch_size"),
        (dict(num_workers=-1), ValueError, "num_workers"),
        (dict(num_workers=1.5), TypeError, "num_workers"),
        (dict(drop_last="yes"), ValueError, "drop_last"),  # torch's BatchSampler's check
        (dict(pin_memory="yes"), TypeError, "pin_memory"),
        (dict(timeout=-1), ValueError, "timeout"),
        (dict(timeout=float("inf")), ValueError, "timeout"),
        (dict(prefetch_batches=True), TypeError, "prefetch_batches"),
        (dict(prefetch_batches=-1), ValueError, "prefetch_batches"),
        (dict(compact_transfer=None), TypeError, "compact_transfer"),
        (dict(seed="0"), TypeError, "seed"),
        (dict(shuffle="no"), TypeError, "shuffle"),
    ],
)
def test_loader_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        tc.DataLoader(IdDataset(10), **kwargs)


# -- mixtures: arguments --------------------------------------------------------------------------

@pytest.mark.parametrize(
    "weights, kwargs, error, match",
    [
        ({"a": float("nan"), "b": 1}, {}, ValueError, r"'a'.*finite"),
        ({"a": float("inf"), "b": 1}, {}, ValueError, r"'a'.*finite"),
        ({"a": -1, "b": 1}, {}, ValueError, r"'a'.*>= 0"),
        ({"a": True, "b": 1}, {}, TypeError, r"'a'.*number"),
        ({"a": np.bool_(True), "b": 1}, {}, TypeError, r"'a'.*number"),
        ({"a": "1", "b": 1}, {}, TypeError, r"'a'.*number"),
        ({"a": 1j, "b": 1}, {}, TypeError, r"'a'.*number"),
        ({"a": 1, "b": 1}, dict(seed=1.5), TypeError, "seed"),
        ({"a": 1, "b": 1}, dict(seed=True), TypeError, "seed"),
        ({"a": 1, "b": 1}, dict(block_size=True), TypeError, "block_size"),
        ({"a": 1, "b": 1}, dict(block_size=8.0), TypeError, "block_size"),
        ({"a": 1, "b": 1}, dict(block_size=2**63), ValueError, "block_size"),
        ({"a": 1, "b": 1}, dict(num_samples=0), ValueError, "num_samples"),
        ({"a": 1, "b": 1}, dict(num_samples=True), TypeError, "num_samples"),
        ({"a": 1, "b": 1}, dict(allow_mixed_tokenizers="yes"), TypeError, "allow_mixed_tokenizers"),
        ({"a": 1, "b": 1}, dict(allow_mixed_items=1), TypeError, "allow_mixed_items"),
        (None, dict(schedule=5), TypeError, "schedule"),
        (None, dict(schedule="0:1"), TypeError, "schedule"),
        (None, dict(schedule=[(1.5, {"a": 1, "b": 1})]), TypeError, "schedule stage 0 start"),
    ],
)
def test_mixture_arguments(weights, kwargs, error, match):
    with pytest.raises(error, match=match):
        tc.MixtureDataset({"a": IdDataset(10), "b": IdDataset(10)}, weights, **kwargs)


def test_mixture_methods():
    with pytest.raises(TypeError, match="datasets"):
        tc.MixtureDataset([IdDataset(10)])
    mix = tc.MixtureDataset({"a": IdDataset(10), "b": IdDataset(10)}, {"a": 1, "b": 1}, block_size=4)
    for call, error, match in [
        (lambda: mix.source_counts(1.5, 3), TypeError, "start"),
        (lambda: mix.source_counts(0, "3"), TypeError, "stop"),
        (lambda: mix.locate([1.5]), TypeError, "indices"),
        (lambda: mix.locate([2**64]), IndexError, "int64"),
        (lambda: mix.source_of(True), TypeError, "index"),
        (lambda: mix[-1], IndexError, "negative"),
    ]:
        with pytest.raises(error, match=match):
            call()


# -- mixtures: incompatible sources (issue 20) ----------------------------------------------------

def test_mixture_refuses_sources_from_different_tokenizers(gpt2_cache, other_cache):
    gpt2, other = tc.TokenDataset(gpt2_cache, 16), tc.TokenDataset(other_cache, 16)
    assert gpt2.tokenizer_identity != other.tokenizer_identity
    with pytest.raises(ValueError, match=r"'web' and 'code' were tokenized differently.*"
                                         r"allow_mixed_tokenizers=True"):
        tc.MixtureDataset({"web": gpt2, "code": other}, {"web": 1, "code": 1}, block_size=2)
    with pytest.raises(ValueError, match="tokenized differently"):
        tc.MixtureDataset({"a": tc.DocumentDataset(gpt2_cache), "b": tc.DocumentDataset(other_cache)},
                          {"a": 1, "b": 1}, block_size=2)
    mixed = tc.MixtureDataset({"web": gpt2, "code": other}, {"web": 1, "code": 1}, block_size=2,
                              allow_mixed_tokenizers=True)
    assert mixed[0]["input_ids"].shape == (16,)
    # a mixture nested in another keeps its sources' tokenizer: checked there too
    with pytest.raises(ValueError, match="tokenized differently"):
        tc.MixtureDataset({"inner": mixed, "more": tc.TokenDataset(gpt2_cache, 16)},
                          {"inner": 1, "more": 1}, block_size=2)
    inner = tc.MixtureDataset({"x": gpt2, "y": tc.TokenDataset(gpt2_cache, 16, labels="same")},
                              {"x": 1, "y": 1}, block_size=2)
    tc.MixtureDataset({"inner": inner, "more": gpt2}, {"inner": 1, "more": 1}, block_size=2)
    with pytest.raises(ValueError, match="tokenized differently"):
        tc.MixtureDataset({"inner": inner, "more": other}, {"inner": 1, "more": 1}, block_size=2)


def _pretokenized_cache(directory, vocab_size: int) -> str:
    directory.mkdir()
    rng = np.random.default_rng(vocab_size)
    with wds.TarWriter(str(directory / "shard-000.tar")) as sink:
        for i in range(20):
            sink.write({"__key__": f"s{i:03d}", "npy": rng.integers(0, 900, 50).astype(np.int64)})
    tc.convert_webdataset(str(directory / "shard-000.tar"), directory / "cache", text_key="npy",
                          vocab_size=vocab_size, progress=False)
    return str(directory / "cache")


def test_mixture_refuses_pretokenized_caches_with_other_vocabularies(tmp_path):
    a = tc.TokenDataset(_pretokenized_cache(tmp_path / "a", 1000), 16)
    b = tc.TokenDataset(_pretokenized_cache(tmp_path / "b", 2000), 16)
    same = tc.TokenDataset(_pretokenized_cache(tmp_path / "c", 1000), 16)
    assert "vocab_size=1000" in a.tokenizer_identity
    with pytest.raises(ValueError, match=r"tokenized differently.*vocab_size=1000.*vocab_size=2000"):
        tc.MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=2)
    tc.MixtureDataset({"a": a, "c": same}, {"a": 1, "c": 1}, block_size=2)


def test_mixture_refuses_items_of_other_shapes(gpt2_cache):
    def mix(a, b, **kw):
        return tc.MixtureDataset({"a": a, "b": b}, {"a": 1, "b": 1}, block_size=2, **kw)

    s16 = tc.TokenDataset(gpt2_cache, 16)
    for other, match in [
        (tc.TokenDataset(gpt2_cache, 32), "seq_len=16.*seq_len=32"),
        (tc.TokenDataset(gpt2_cache, 16, document_boundaries=True), "position_ids"),
        (tc.DocumentDataset(gpt2_cache), "whole documents"),
    ]:
        with pytest.raises(ValueError, match=rf"different shapes.*{match}.*allow_mixed_items=True"):
            mix(s16, other)
        mix(s16, other, allow_mixed_items=True)
    boundaries = tc.TokenDataset(gpt2_cache, 16, document_boundaries=True, max_segments=4)
    with pytest.raises(ValueError, match=r"cu_seqlens\[5\].*cu_seqlens\[9\]"):
        mix(boundaries, tc.TokenDataset(gpt2_cache, 16, document_boundaries=True, max_segments=8))
    # labels="same" changes values, not keys or shapes: these batch together
    both = mix(s16, tc.TokenDataset(gpt2_cache, 16, labels="same"))
    loader = tc.DataLoader(both, batch_size=4)
    assert next(iter(loader))["input_ids"].shape == (4, 16)
