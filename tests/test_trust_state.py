"""Loader states never give silently wrong data (issue 21, items 1, 2 and 6).

1. A state loaded into a live loader: the live iterator stops with an error saying to call
   ``iter(loader)`` again, with every worker count and loader mode; it never continues its old
   stream. The next ``iter()`` starts at the loaded state.
2. A state is tied to the content of the cache it was saved on (a digest of its committed
   blocks' index records), not only to the cache's fingerprint: two caches built from iterables
   that differ in one word (same size, same fingerprint) do not accept each other's states,
   while a cache that kept growing after the state was saved (quick start) does.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from conftest import paragraphs, wait_for_blocks
from torch.utils.data import default_collate

import torchcache as tc
from torchcache.train.loader import LOADER_STATE_VERSION

SEQ, BATCH, DOCS = 16, 4, 300


def _texts(books, swap: bool = False) -> list[str]:
    """300 real documents; with ``swap``, one word of one document replaced by another word of
    the same token count, so both caches hold the same number of tokens and documents."""
    docs = paragraphs(books, DOCS)
    i = next(k for k, d in enumerate(docs) if " the " in d)
    if swap:
        docs[i] = docs[i].replace(" the ", " and ", 1)
    return docs


def _build(books, tokenizer: str, out, swap: bool = False) -> str:
    tc.build_cache(iter(_texts(books, swap)), out, tokenizer, block_tokens=1_000, progress=False)
    return str(out)


@pytest.fixture(scope="module")
def caches(tmp_path_factory, books, gpt2_tokenizer_path) -> tuple[str, str]:
    """Two finished caches of the same size and fingerprint whose content differs in one word."""
    root = tmp_path_factory.mktemp("trust")
    a = _build(books, gpt2_tokenizer_path, root / "a")
    b = _build(books, gpt2_tokenizer_path, root / "b", swap=True)
    return a, b


def roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


def _loader(ds, **kw) -> tc.DataLoader:
    return tc.DataLoader(ds, batch_size=BATCH, shuffle=True, seed=3, **kw)


def _ids(batch) -> list[list[int]]:
    return batch["input_ids"].tolist()


# -- 1. a state loaded into a live loader --------------------------------------------------------

MODES = {
    "prefetch": {},  # the default for a TokenDataset: batches read ahead in a thread
    "prefetch-collate": {"prefetch_batches": 2, "collate_fn": default_collate},
    "synchronous": {"prefetch_batches": 0},
    "workers": {"num_workers": 2},  # compact transfer through an inner torch loader
    "workers-collate": {"num_workers": 2, "collate_fn": default_collate},  # torch's own iterator
    "persistent-workers": {"num_workers": 2, "persistent_workers": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_state_loaded_into_a_live_loader_stops_the_live_iterator(caches, mode):
    ds = tc.TokenDataset(caches[0], SEQ)
    full = [_ids(b) for b in _loader(ds, prefetch_batches=0)]
    loader = _loader(ds, **MODES[mode])
    it = iter(loader)
    assert _ids(next(it)) == full[0]
    state = roundtrip(loader.state_dict())
    next(it), next(it)
    loader.load_state_dict(state)
    for _ in range(2):  # stays stopped: never the old stream
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\).*call iter\(loader\) again"):
            next(it)
    assert loader.consumed == BATCH
    again = iter(loader)
    assert [_ids(next(again)) for _ in range(3)] == full[1:4]
    assert loader.consumed == 4 * BATCH


@pytest.mark.parametrize("mode", ["synchronous", "workers", "persistent-workers"])
def test_a_new_iter_or_a_sampler_move_stops_the_old_iterator(caches, mode):
    ds = tc.TokenDataset(caches[0], SEQ)
    full = [_ids(b) for b in _loader(ds, prefetch_batches=0)]
    loader = _loader(ds, **MODES[mode])
    old = iter(loader)
    next(old)
    new = iter(loader)  # continues at consumed = BATCH
    with pytest.raises(RuntimeError, match=r"newer iter\(loader\)"):
        next(old)
    assert _ids(next(new)) == full[1]
    loader.sampler.set_position(5 * BATCH)
    with pytest.raises(RuntimeError, match=r"sampler was moved.*call iter\(loader\) again"):
        next(new)
    assert _ids(next(iter(loader))) == full[5]


def test_a_refused_state_leaves_the_live_iterator_running(caches):
    a, b = caches
    first = _loader(tc.TokenDataset(a, SEQ))
    next(iter(first))
    state = first.state_dict()
    loader = _loader(tc.TokenDataset(b, SEQ), num_workers=2)
    it = iter(loader)
    next(it)
    with pytest.raises(ValueError):
        loader.load_state_dict(state)
    next(it)
    assert loader.consumed == 2 * BATCH


# -- 2. a state belongs to its cache's content ---------------------------------------------------

DATASETS = {
    "tokens": lambda cache: tc.TokenDataset(cache, SEQ),
    "documents": lambda cache: tc.DocumentDataset(cache),
    "packed": lambda cache: tc.PackedDataset(cache, SEQ),
}


def test_same_size_caches_of_different_content_have_different_digests(caches):
    a, b = (tc.TokenCache(path) for path in caches)
    assert a.num_tokens == b.num_tokens and a.num_documents == b.num_documents
    assert a.num_blocks == b.num_blocks > 3
    assert a.content_digest() != b.content_digest()
    assert a.content_digest() == tc.TokenCache(caches[0]).content_digest()
    # the blocks before the edited one are the same data: so is their digest
    differs = next(k for k in range(a.num_blocks)
                   if a.block_table.records[k].tobytes() != b.block_table.records[k].tobytes())
    assert a.content_digest(differs) == b.content_digest(differs)
    assert a.content_digest(differs + 1) != b.content_digest(differs + 1)
    with pytest.raises(ValueError, match="blocks"):
        a.content_digest(a.num_blocks + 1)


@pytest.mark.parametrize("kind", list(DATASETS))
def test_a_state_is_refused_on_a_cache_of_other_content_of_the_same_size(caches, kind):
    a, b = caches
    make = DATASETS[kind]
    saved_on = make(a)
    other = make(b)
    assert len(saved_on) == len(other)
    first = tc.DataLoader(saved_on, batch_size=BATCH, shuffle=True, seed=3,
                          collate_fn=tc.pad_collate if kind == "documents" else None)
    it = iter(first)
    next(it), next(it)
    state = roundtrip(first.state_dict())
    assert state["version"] == LOADER_STATE_VERSION and state["content"]["blocks"] > 0

    same = tc.DataLoader(make(a), batch_size=BATCH, shuffle=True, seed=3)
    same.load_state_dict(state)
    assert same.consumed == 2 * BATCH

    refused = tc.DataLoader(other, batch_size=BATCH, shuffle=True, seed=3)
    with pytest.raises(ValueError) as error:
        refused.load_state_dict(state)
    message = str(error.value)
    assert refused.consumed == 0
    if state["fingerprint"] == refused.state_dict()["fingerprint"]:  # only the content tells them apart
        assert b in message and "another cache's content" in message


def test_a_tampered_or_malformed_content_is_refused(caches):
    loader = _loader(tc.TokenDataset(caches[0], SEQ))
    state = roundtrip(loader.state_dict())
    blocks = state["content"]["blocks"]
    cases = [
        ({**state["content"], "sha256": "0" * 64}, "another cache's content"),
        ({**state["content"], "blocks": blocks + 1}, rf"{blocks} committed blocks"),
        ({"blocks": blocks}, r"state\['content'\]"),
        ({**state["content"], "blocks": -1}, r"state\['content'\]"),
        (None, r"content"),
    ]
    for content, match in cases:
        with pytest.raises(ValueError, match=match):
            loader.load_state_dict({**state, "content": content})
    with pytest.raises(TypeError, match=r"state\['content'\]"):
        loader.load_state_dict({**state, "content": "abc"})


def test_a_version_2_state_still_loads_checked_by_fingerprint_only(caches):
    a, b = caches
    first = _loader(tc.TokenDataset(a, SEQ))
    it = iter(first)
    next(it)
    v2 = {k: v for k, v in first.state_dict().items() if k not in ("content", "steps", "skips")}
    v2["version"] = 2
    for cache in (a, b):  # a version 2 state does not know the content
        loader = _loader(tc.TokenDataset(cache, SEQ))
        loader.load_state_dict(v2)
        assert loader.consumed == BATCH
    with pytest.raises(ValueError, match="unknown"):
        _loader(tc.TokenDataset(a, SEQ)).load_state_dict({**v2, "content": None})


class _GatedDocuments:
    """Yields the first ``gate`` documents, then waits until released: a build that is
    deterministically incomplete while the test saves a state."""

    def __init__(self, docs: list[str], gate: int):
        self.docs, self.gate, self.release = docs, gate, threading.Event()

    def __iter__(self):
        for i, doc in enumerate(self.docs):
            if i == self.gate:
                assert self.release.wait(120), "test never released the build"
            yield doc


def test_a_quick_start_state_loads_into_the_grown_cache_only(tmp_path, books, gpt2_tokenizer_path,
                                                             caches):
    gated = _GatedDocuments(paragraphs(books), gate=1050)  # the builder reads 1024 at a time
    handle = tc.build_cache(iter(gated), tmp_path / "c", gpt2_tokenizer_path, block_tokens=1_000,
                            background=True, progress=False)
    growing = tc.TokenDataset(wait_for_blocks(tmp_path / "c", handle, 3), SEQ)
    assert not growing.complete
    loader = tc.DataLoader(growing, batch_size=BATCH,
                           sampler=tc.DistributedSampler(growing, seed=3, window=32))
    next(iter(loader))
    state = roundtrip(loader.state_dict())
    gated.release.set()
    handle.wait(120)
    final = tc.TokenDataset(tmp_path / "c", SEQ)
    assert final.cache.num_blocks > state["content"]["blocks"]

    resumed = tc.DataLoader(final, batch_size=BATCH,
                            sampler=tc.DistributedSampler(final, seed=3, window=32))
    resumed.load_state_dict(state)
    assert resumed.consumed == BATCH
    other = tc.TokenDataset(caches[1], SEQ)  # the same documents but one word: differs early
    elsewhere = tc.DataLoader(other, batch_size=BATCH,
                              sampler=tc.DistributedSampler(other, seed=3, window=32))
    with pytest.raises(ValueError, match="another cache's content"):
        elsewhere.load_state_dict(state)


def _mixture(sources: dict, **kw) -> tc.MixtureDataset:
    return tc.MixtureDataset(sources, {name: 1 for name in sources}, seed=1, block_size=8, **kw)


def test_a_mixture_source_swapped_for_other_content_is_refused(caches):
    a, b = caches
    mix = _mixture({"web": tc.TokenDataset(a, SEQ), "code": tc.TokenDataset(a, SEQ)})
    first = _loader(mix)
    it = iter(first)
    next(it), next(it)
    state = roundtrip(first.state_dict())
    assert set(state["content"]["sources"]) == {"web", "code"}

    again = _loader(_mixture({"web": tc.TokenDataset(a, SEQ), "code": tc.TokenDataset(a, SEQ)}))
    again.load_state_dict(state)
    assert again.consumed == 2 * BATCH

    swapped = _loader(_mixture({"web": tc.TokenDataset(a, SEQ), "code": tc.TokenDataset(b, SEQ)}))
    with pytest.raises(ValueError, match=r"source 'code'") as error:
        swapped.load_state_dict(state)
    assert "another cache's content" in str(error.value) and b in str(error.value)
    assert swapped.consumed == 0


def test_a_mixture_source_used_only_after_the_saved_position_may_change(caches):
    a, b = caches

    def staged(later) -> tc.MixtureDataset:
        sources = {"web": tc.TokenDataset(a, SEQ), "later": tc.TokenDataset(later, SEQ)}
        return tc.MixtureDataset(sources, schedule=[(0, {"web": 1, "later": 0}),
                                                    (64, {"web": 1, "later": 1})],
                                 seed=1, block_size=8)

    first = _loader(staged(a))
    it = iter(first)
    next(it), next(it)
    state = roundtrip(first.state_dict())
    second = _loader(staged(b))  # its future source now reads other data: a future edit
    second.load_state_dict(state)
    assert second.consumed == 2 * BATCH
    assert torch.equal(next(iter(second))["input_ids"], next(iter(_resumed(staged(a), state)))["input_ids"])


def _resumed(mix, state) -> tc.DataLoader:
    loader = _loader(mix)
    loader.load_state_dict(state)
    return loader
