"""Provenance of samples: ``sample_documents`` of TokenDataset windows, PackedDataset rows and
MixtureDataset samples names document token ranges that reproduce each sample's input_ids.

Caches are real (GPT-2 over book paragraphs, and over whole books) with small blocks, so that
windows cross document and block edges; sample indices are drawn by hypothesis.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import paragraphs, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcache as tc

SEQ = 100  # TokenDataset windows
ROW = 128  # PackedDataset rows
BATCH_DRAWS = settings(max_examples=25, deadline=None)
INDICES = st.lists(st.integers(0, 2**40), min_size=12, max_size=20)  # taken modulo len(ds)


@pytest.fixture(scope="module")
def paras(tmp_path_factory, books, gpt2_tokenizer_path):
    """Short documents (book paragraphs), many per block."""
    d = tmp_path_factory.mktemp("paras")
    src = write_jsonl(d / "d.jsonl", paragraphs(books, 700))
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=2048, progress=False)
    cache = tc.TokenCache(d / "cache")
    assert cache.num_blocks >= 8
    return cache


@pytest.fixture(scope="module")
def whole_books(tmp_path_factory, books, gpt2_tokenizer_path):
    """Long documents (whole books): most windows lie inside one document, mid-way."""
    d = tmp_path_factory.mktemp("books")
    src = write_jsonl(d / "d.jsonl", [b["text"] for b in books])
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=4096, progress=False)
    return tc.TokenCache(d / "cache")


class Documents:
    """``cache.document(d)``, read once per document (the reference the tests compare with)."""

    def __init__(self, cache: tc.TokenCache):
        self.cache, self.read = cache, {}

    def __call__(self, d: int) -> np.ndarray:
        if d not in self.read:
            self.read[d] = self.cache.document(d)
        return self.read[d]


def joined(entries, documents: Documents) -> list[int]:
    """The tokens the entries name, back to back; each listed document's info must be readable."""
    out = []
    for e in entries:
        assert set(e) == {"source", "document", "start", "end"}, e
        d, a, b = e["document"], e["start"], e["end"]
        doc = documents(d)
        assert 0 <= a < b <= len(doc), e  # a non-empty range inside the document
        assert documents.cache.document_info(d)["document"] == d
        out += doc[a:b].tolist()
    return out


def covered(item, packed: bool) -> list[int]:
    """The tokens a sample's entries must name, back to back: every token of its input_ids or
    labels. A window: input_ids, then its last label (the next token of the stream). A packed row:
    each segment's input_ids, plus its last label where that is a token (the document goes on)."""
    ids, labels = item["input_ids"].tolist(), item["labels"].tolist()
    if not packed:
        return ids + labels[-1:]
    cu, out = item["cu_seqlens"].tolist(), []
    for a, b in zip(cu, cu[1:int(item["num_segments"]) + 1]):
        out += ids[a:b] + ([labels[b - 1]] if labels[b - 1] != -100 else [])
    return out


def no_token_reads(monkeypatch, cache: tc.TokenCache) -> None:
    """Make every token read of ``cache`` fail: sample_documents must not need one."""
    def refuse(*args, **kwargs):
        raise AssertionError("sample_documents read token data")
    for name in ("read_ranges", "read_many", "read", "_gather"):
        monkeypatch.setattr(cache, name, refuse)


# ---------------------------------------------------------------- the cache's helper

@given(st.data())
@BATCH_DRAWS
def test_document_pieces_cover_any_token_range(paras, data):
    n = paras.num_tokens
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, min(n, start + 3000)))
    pieces = paras.document_pieces(start, stop)
    assert joined([{"source": None, "document": d, "start": a, "end": b} for d, a, b in pieces],
                  Documents(paras)) == paras.read(start, stop).tolist()
    docs = [d for d, _, _ in pieces]
    assert docs == sorted(set(docs))


def test_document_pieces_checks_its_range(paras):
    n = paras.num_tokens
    assert paras.document_pieces(5, 5) == [] and paras.document_pieces(n, n) == []
    assert paras.document_pieces(0, n)[-1][0] == paras.num_documents - 1
    for start, stop in [(-1, 3), (4, 3), (0, n + 1)]:
        with pytest.raises(IndexError, match=rf"outside \[0, {n}\)"):
            paras.document_pieces(start, stop)


# ---------------------------------------------------------------- TokenDataset windows

@pytest.mark.parametrize("cache", ["paras", "whole_books"])
def test_window_documents_reproduce_the_input_ids(cache, request):
    cache = request.getfixturevalue(cache)
    ds, documents = tc.TokenDataset(cache, SEQ), Documents(cache)
    drawn = []

    def check_window(i: int) -> int:
        entries = ds.sample_documents(i)
        assert all(e["source"] is None for e in entries)
        assert joined(entries, documents) == covered(ds[i], packed=False)
        first = entries[0]
        assert cache.document_span(first["document"])[0] + first["start"] == i % len(ds) * SEQ
        return len(entries)

    @given(INDICES)
    @BATCH_DRAWS
    def check(draws):
        drawn.extend(check_window(x % len(ds)) for x in draws)

    check()
    assert len(drawn) >= 300
    # and, whatever was drawn: the last window, windows over document edges, one inside a document
    check_window(-1)
    edges = [cache.document_span(d)[0] for d in range(1, min(cache.num_documents, 40))]
    assert max(check_window(e // SEQ) for e in edges if e % SEQ) > 1
    longest = max(range(cache.num_documents), key=lambda d: len(documents(d)))
    assert check_window(cache.document_span(longest)[0] // SEQ + 2) == 1


def test_window_documents_cross_blocks_and_read_no_tokens(paras, monkeypatch):
    ds = tc.TokenDataset(paras, SEQ)
    starts = paras.block_token_starts()
    crossing = [int(s) // SEQ for s in starts[1:-1] if int(s) % SEQ]  # windows over a block edge
    assert len(crossing) >= 5
    expected = {i: covered(ds[i], packed=False) for i in crossing}
    documents = {e["document"]: paras.document(e["document"])
                 for i in crossing for e in ds.sample_documents(i)}
    no_token_reads(monkeypatch, paras)
    for i in crossing:
        entries = ds.sample_documents(i)
        blocks = {int(np.searchsorted(paras.block_token_starts(), paras.document_span(e["document"])[0],
                                      side="right")) - 1 for e in entries}
        assert len(blocks) == 2, i
        tokens = [documents[e["document"]][e["start"]:e["end"]].tolist() for e in entries]
        assert sum(tokens, []) == expected[i]


def test_a_window_names_the_document_of_its_last_target(paras):
    """A window whose last label is the first token of a document names that document (token 0
    only), though no input_ids token comes from it; with labels="same" the window is seq_len."""
    ds, same = tc.TokenDataset(paras, SEQ), tc.TokenDataset(paras, SEQ, labels="same")
    starts = [paras.document_span(d)[0] for d in range(1, paras.num_documents)]
    edges = [s // SEQ - 1 for s in starts if s % SEQ == 0 and 0 < s // SEQ <= len(ds)]
    assert edges, "no document starts right after a window"
    for i in edges:
        last = ds.sample_documents(i)[-1]
        d = paras.document_at((i + 1) * SEQ)
        assert last == {"source": None, "document": d, "start": 0, "end": 1}
        assert int(ds[i]["labels"][-1]) == int(paras.document(d)[0])
        assert all(e["document"] != d for e in same.sample_documents(i))
        assert joined(same.sample_documents(i), Documents(paras)) == same[i]["input_ids"].tolist()


def test_a_packed_piece_that_goes_on_names_its_next_token(paras, tmp_path):
    ds = tc.PackedDataset(paras, ROW, long_docs="truncate", plan_dir=tmp_path)
    assert ds.truncated_documents > 0
    documents, seen = Documents(paras), 0
    for i in range(len(ds)):
        item, entries = ds[i], ds.sample_documents(i)
        for e, (_, a, b) in zip(entries, ds.row_documents(i)):
            assert e["start"] == a and e["end"] in (b, b + 1)
            if e["end"] == b + 1:  # a truncated document: its last label is its next token
                seen += 1
                assert len(documents(e["document"])) > b
        assert joined(entries, documents) == covered(item, packed=True)
    assert seen == ds.truncated_documents


def test_window_indices_are_checked_like_items(paras):
    ds = tc.TokenDataset(paras, SEQ)
    assert ds.sample_documents(-2) == ds.sample_documents(len(ds) - 2)
    for bad in (len(ds), -len(ds) - 1):
        with pytest.raises(IndexError, match=f"out of range for TokenDataset of length {len(ds)}"):
            ds.sample_documents(bad)
    with pytest.raises(TypeError, match="index"):
        ds.sample_documents(1.5)


def test_document_items_are_whole_documents(paras):
    ds, documents = tc.DocumentDataset(paras), Documents(paras)
    for i in np.random.default_rng(0).integers(0, len(ds), 300).tolist() + [-1]:
        entries = ds.sample_documents(i)
        assert len(entries) == 1 and entries[0]["start"] == 0 and entries[0]["source"] is None
        assert joined(entries, documents) == ds[i].tolist()
    with pytest.raises(IndexError, match=f"out of range for DocumentDataset of length {len(ds)}"):
        ds.sample_documents(len(ds))


# ---------------------------------------------------------------- PackedDataset rows

@pytest.mark.parametrize("long_docs", ["split", "drop", "truncate"])
def test_row_documents_reproduce_the_rows_without_padding(paras, long_docs, tmp_path):
    ds = tc.PackedDataset(paras, ROW, long_docs=long_docs, max_segments=16, plan_dir=tmp_path)
    assert ds.split_documents + ds.dropped_documents + ds.truncated_documents > 0
    documents, drawn = Documents(paras), []

    def check_row(i: int) -> tuple[int, int]:
        """(documents in row i, the latest start of one of them)."""
        entries, item = ds.sample_documents(i), ds[i]
        assert joined(entries, documents) == covered(item, packed=True)
        assert len(entries) == int(item["num_segments"])
        return len(entries), max(e["start"] for e in entries)

    @given(INDICES)
    @BATCH_DRAWS
    def check(draws):
        drawn.extend(check_row(x % len(ds)) for x in draws)

    check()
    assert len(drawn) >= 300
    every = [check_row(i) for i in range(len(ds))]  # whatever was drawn: rows of every kind
    assert max(k for k, _ in every) > 1
    if long_docs == "split":
        assert max(a for _, a in every) > 0  # later pieces of split documents
    else:
        assert max(a for _, a in every) == 0  # documents start at their first token
    with pytest.raises(IndexError, match=f"out of range for PackedDataset of length {len(ds)}"):
        ds.sample_documents(len(ds))


def test_row_documents_read_no_tokens(paras, monkeypatch, tmp_path):
    ds = tc.PackedDataset(paras, ROW, plan_dir=tmp_path)
    rows = range(0, len(ds), 7)
    expected = [[(e["document"], e["start"], e["end"]) for e in ds.sample_documents(i)] for i in rows]
    pieces = [ds.row_documents(i) for i in rows]
    no_token_reads(monkeypatch, paras)
    assert [ds.row_documents(i) for i in rows] == pieces
    assert [[(e["document"], e["start"], e["end"]) for e in ds.sample_documents(i)]
            for i in rows] == expected


# ---------------------------------------------------------------- MixtureDataset samples

@pytest.fixture(scope="module")
def mixture(paras, whole_books, tmp_path_factory):
    """Two TokenDatasets over different caches and a PackedDataset, in 2 stages."""
    plans = tmp_path_factory.mktemp("plans")
    sources = {"web": tc.TokenDataset(paras, ROW), "books": tc.TokenDataset(whole_books, ROW),
               "packed": tc.PackedDataset(paras, ROW, plan_dir=plans)}
    stages = [(0, {"web": 1, "books": 1, "packed": 0}), (64, {"web": 1, "books": 2, "packed": 3})]
    return tc.MixtureDataset(sources, schedule=stages, block_size=16, seed=3, allow_mixed_items=True)


def check_mixture_sample(mix, i, documents) -> str:
    """Sample i's entries against its item; the name of its source."""
    k, local = mix.locate([i])
    name = mix.names[int(k[0])]
    entries, item = mix.sample_documents(i), mix[i]
    assert {e["source"] for e in entries} == {name}
    ds = mix.datasets[name]
    assert joined(entries, documents[name]) == covered(item, isinstance(ds, tc.PackedDataset))
    assert entries == [{**e, "source": name} for e in ds.sample_documents(int(local[0]))]
    return name


def test_mixture_documents_reproduce_every_source(mixture):
    documents = {name: Documents(ds.cache) for name, ds in mixture.datasets.items()}
    names = []

    @given(st.lists(st.integers(0, 600), min_size=12, max_size=20))
    @BATCH_DRAWS
    def check(draws):
        names.extend(check_mixture_sample(mixture, i, documents) for i in draws)

    check()
    assert len(names) >= 300
    assert {check_mixture_sample(mixture, i, documents) for i in range(64)} == {"web", "books"}  # stage 1
    assert {check_mixture_sample(mixture, i, documents) for i in range(64, 96)} == set(mixture.names)
    check_mixture_sample(mixture, 10**12, documents)  # any index >= 0 is a sample


def test_mixture_indices_are_checked(mixture):
    with pytest.raises(IndexError, match="negative"):
        mixture.sample_documents(-1)
    with pytest.raises(TypeError, match="index"):
        mixture.sample_documents("3")


def test_nested_mixture_and_plain_sources(mixture):
    plain = [torch.tensor([j]) for j in range(50)]
    outer = tc.MixtureDataset({"inner": mixture, "plain": plain}, {"inner": 1, "plain": 1},
                              block_size=4, seed=0, allow_mixed_items=True)
    documents = {name: Documents(ds.cache) for name, ds in mixture.datasets.items()}
    kinds = set()
    for i in range(200):
        entries = outer.sample_documents(i)
        k, local = outer.locate([i])
        if outer.names[int(k[0])] == "plain":
            assert entries == [{"source": "plain", "index": int(local[0])}]
            assert torch.equal(outer[i], plain[entries[0]["index"]])
            kinds.add("plain")
            continue
        inner = mixture.sample_documents(int(local[0]))
        assert entries == [{**e, "source": f"inner/{e['source']}"} for e in inner]
        name = inner[0]["source"]
        assert joined(inner, documents[name]) == covered(outer[i], name == "packed")
        kinds.add(name)
    assert kinds == {"plain", "web", "books", "packed"}
