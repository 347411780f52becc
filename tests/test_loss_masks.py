"""Loss masks reach training: labels are -100 where the target token is not trained, and
``loss_mask == (labels != -100)``, through token windows, whole documents, packed rows (split,
drop, truncate), mixtures with text caches, DataLoader workers and resume. The oracle is the
cache's own per-document mask (``cache.document_loss_mask``), read document by document."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import torchcache as tc
from conftest import paragraphs
from test_chat import CHATML, generate_conversations, variant

SEQ = 200  # the conversations below are 97-478 tokens: most longer (split, truncate), some shorter


@pytest.fixture(scope="module")
def chat_tokenizer(chatml_tokenizer_path) -> str:
    return chatml_tokenizer_path


def build_chats(out, tokenizer: str, conversations, template: str) -> tc.TokenCache:
    records = ({"messages": messages} for messages in conversations)
    tc.build_cache(records, str(out), tokenizer, input_format="messages", chat_template=template,
                   block_tokens=4000, num_workers=1, progress=False)
    return tc.TokenCache(str(out))


@pytest.fixture(scope="module")
def chat(books, chat_tokenizer, tmp_path_factory) -> tc.TokenCache:
    """About 60 real conversations (several blocks), assistant turns trained."""
    conversations = generate_conversations(books, 60, seed=3)
    return build_chats(tmp_path_factory.mktemp("chat") / "cache", chat_tokenizer, conversations,
                       variant(CHATML, tags=False))


@pytest.fixture(scope="module")
def text(books, chat_tokenizer, tmp_path_factory) -> tc.TokenCache:
    """Plain text with the same tokenizer: a cache without a loss mask."""
    out = tmp_path_factory.mktemp("text") / "cache"
    tc.build_cache(iter(paragraphs(books, 300)), str(out), chat_tokenizer, block_tokens=4000,
                   num_workers=1, progress=False)
    return tc.TokenCache(str(out))


@pytest.fixture(scope="module")
def oracle(chat):
    """(tokens, trained) of the whole stream, from the cache's per-document API."""
    tokens = np.concatenate([chat.document(i) for i in range(chat.num_documents)]).astype(np.int64)
    trained = np.concatenate([chat.document_loss_mask(i) for i in range(chat.num_documents)])
    assert len(tokens) == chat.num_tokens and 0.1 < trained.mean() < 0.9  # a mask worth testing
    return tokens, trained


def expect_consistent(batch) -> None:
    assert batch["loss_mask"].dtype == torch.bool
    assert torch.equal(batch["loss_mask"], batch["labels"] != -100)


def window_labels(oracle, sample: int, shift: int) -> np.ndarray:
    tokens, trained = oracle
    at = slice(sample * SEQ + shift, sample * SEQ + shift + SEQ)
    return np.where(trained[at], tokens[at], -100)


# ------------------------------------------------------------------ token windows

@pytest.mark.parametrize("labels, shift", [("shifted", 1), ("same", 0)])
def test_token_windows_label_only_trained_targets(chat, oracle, labels, shift):
    ds = tc.TokenDataset(chat, SEQ, labels=labels)
    assert ds.has_loss_mask
    samples = np.random.default_rng(0).choice(len(ds), 40, replace=False)
    batch = ds.get_batch(samples)
    expect_consistent(batch)
    for row, s in enumerate(samples.tolist()):
        assert batch["labels"][row].tolist() == window_labels(oracle, s, shift).tolist()
        assert batch["input_ids"][row].tolist() == oracle[0][s * SEQ:s * SEQ + SEQ].tolist()
    items = ds.__getitems__(samples[:3])
    assert set(items[0]) == {"input_ids", "labels", "loss_mask"}
    for row, item in enumerate(items):
        assert all(torch.equal(item[k], batch[k][row]) for k in batch)
    assert all(torch.equal(ds[int(samples[5])][k], batch[k][5]) for k in batch)
    expanded = ds.expand_batch(ds.compact_batch(samples))
    assert expanded.keys() == batch.keys() and all(torch.equal(expanded[k], batch[k]) for k in batch)
    windows, masks = ds.read_windows(samples), ds.read_loss_masks(samples)
    again = ds.batch_from_windows(windows, masks)
    assert all(torch.equal(again[k], batch[k]) for k in batch)
    with pytest.raises(ValueError, match="masks"):
        ds.batch_from_windows(windows)


def test_document_boundaries_keep_the_mask(chat, oracle):
    ds = tc.TokenDataset(chat, SEQ, document_boundaries=True)
    samples = [0, 7, len(ds) - 1]
    batch = ds.get_batch(samples)
    expect_consistent(batch)
    assert "position_ids" in batch and "cu_seqlens" in batch
    for row, s in enumerate(samples):
        assert batch["labels"][row].tolist() == window_labels(oracle, s, 1).tolist()


def test_text_cache_items_are_unchanged(text):
    ds = tc.TokenDataset(text, SEQ)
    assert not ds.has_loss_mask and set(ds[0]) == {"input_ids", "labels"}
    assert ds[0]["labels"].tolist() == text.read_many([1], SEQ)[0].tolist()
    assert isinstance(tc.DocumentDataset(text)[0], torch.Tensor)
    assert set(tc.PackedDataset(text, SEQ)[0]) == {"input_ids", "labels", "position_ids",
                                                     "cu_seqlens", "num_segments"}
    forced = ds.with_loss_mask().get_batch([0, 1])  # all trained: the labels as before
    assert forced["loss_mask"].all() and torch.equal(forced["labels"], ds.get_batch([0, 1])["labels"])


# ------------------------------------------------------------------ documents

def test_documents_carry_next_token_labels(chat):
    docs = tc.DocumentDataset(chat)
    picked = [0, 5, chat.num_documents - 1]
    for item, d in zip(docs.__getitems__(picked), picked):
        tokens, trained = chat.document(d).astype(np.int64), chat.document_loss_mask(d)
        expected = np.where(trained[1:], tokens[1:], -100).tolist() + [-100]
        assert item["input_ids"].tolist() == tokens.tolist()
        assert item["labels"].tolist() == expected
        expect_consistent(item)
        assert torch.equal(docs[d]["labels"], item["labels"])


def test_collating_documents_keeps_the_mask(chat):
    items = tc.DocumentDataset(chat).__getitems__([1, 2, 3])
    padded = tc.pad_collate(items, labels="shifted", max_length=150)
    expect_consistent(padded)
    for row, item in enumerate(items):
        n = min(len(item["labels"]), 150)
        assert padded["labels"][row, :n].tolist() == item["labels"][:n].tolist()
        assert (padded["labels"][row, n:] == -100).all()
    flat = tc.packed_collate(items, labels="same")  # labels on the token itself: trained or -100
    expect_consistent(flat)
    for d, start, end in zip([1, 2, 3], flat["cu_seqlens"][:-1].tolist(), flat["cu_seqlens"][1:].tolist()):
        tokens, trained = chat.document(d).astype(np.int64), chat.document_loss_mask(d)
        expected = [-100] + np.where(trained[1:], tokens[1:], -100).tolist()
        assert flat["labels"][start:end].tolist() == expected


# ------------------------------------------------------------------ packed rows

def packed_oracle(ds: tc.PackedDataset, row: int) -> list[int]:
    """Row ``row``'s labels from its documents: a piece's label at document position j is token
    j + 1 if the document has one and it is trained, padding -100."""
    cache, labels = ds.cache, []
    for doc, start, end in ds.row_documents(row):
        tokens, trained = cache.document(doc).astype(np.int64), cache.document_loss_mask(doc)
        for j in range(start, end):
            labels.append(int(tokens[j + 1]) if j + 1 < len(tokens) and trained[j + 1] else -100)
    return labels + [-100] * (ds.seq_len - len(labels))


@pytest.mark.parametrize("long_docs", ["split", "drop", "truncate"])
def test_packed_rows_label_only_trained_targets(chat, long_docs, tmp_path):
    ds = tc.PackedDataset(chat, SEQ, long_docs=long_docs, plan_dir=tmp_path)
    rows = np.arange(len(ds))
    batch = ds.get_batch(rows)
    expect_consistent(batch)
    assert [batch["labels"][r].tolist() for r in rows.tolist()] == [packed_oracle(ds, r) for r in rows.tolist()]
    expanded = ds.expand_batch(ds.compact_batch(rows[::3]))
    assert all(torch.equal(expanded[k], batch[k][::3]) for k in batch)
    assert all(torch.equal(ds[4][k], batch[k][4]) for k in batch)


def test_truncate_keeps_each_long_document_once_and_counts_the_cut(chat, tmp_path):
    ds = tc.PackedDataset(chat, SEQ, long_docs="truncate", plan_dir=tmp_path)
    lengths = chat.document_lengths()
    long = lengths > SEQ
    assert long.any() and (~long).any()
    assert ds.truncated_documents == int(long.sum())
    assert ds.truncated_tokens == int((lengths[long] - SEQ).sum())
    assert ds.dropped_documents == 0 and ds.split_documents == 0
    assert ds.stats()["truncated_tokens"] == ds.truncated_tokens
    pieces = [p for r in range(len(ds)) for p in ds.row_documents(r)]
    assert sorted(p[0] for p in pieces) == list(range(chat.num_documents))  # each once
    assert all(p[1:] == (0, min(int(lengths[p[0]]), SEQ)) for p in pieces)
    split = tc.PackedDataset(chat, SEQ, long_docs="split", plan_dir=tmp_path)
    assert split.fingerprint != ds.fingerprint and split.truncated_documents == 0
    assert len(split) > len(ds)


# ------------------------------------------------------------------ mixtures

def test_mixture_of_chat_and_text_has_one_set_of_keys(chat, text, oracle):
    chat_ds, text_ds = tc.TokenDataset(chat, SEQ), tc.TokenDataset(text, SEQ)
    mix = tc.MixtureDataset({"chat": chat_ds, "text": text_ds}, {"chat": 0.8, "text": 0.2},
                            block_size=10, seed=1)
    assert not text_ds.has_loss_mask  # the user's dataset is left as it was
    batch = mix.get_batch(np.arange(40))
    expect_consistent(batch)
    source, local = mix.locate(np.arange(40))
    assert (source == 1).sum() == 8
    for row, (k, s) in enumerate(zip(source.tolist(), local.tolist())):
        if mix.names[k] == "chat":
            assert batch["labels"][row].tolist() == window_labels(oracle, s, 1).tolist()
        else:
            assert batch["loss_mask"][row].all()
            assert batch["labels"][row].tolist() == text.read_many([s * SEQ + 1], SEQ)[0].tolist()
    items = mix.__getitems__(list(range(10)))
    assert all(set(item) == {"input_ids", "labels", "loss_mask"} for item in items)


def test_mixture_of_packed_chat_and_text(chat, text, tmp_path):
    mix = tc.MixtureDataset({"chat": tc.PackedDataset(chat, SEQ, plan_dir=tmp_path),
                             "text": tc.PackedDataset(text, SEQ, plan_dir=tmp_path)},
                            {"chat": 0.8, "text": 0.2}, block_size=10)
    batch = mix.get_batch(np.arange(20))
    expect_consistent(batch)
    source, local = mix.locate(np.arange(20))
    for row, (k, r) in enumerate(zip(source.tolist(), local.tolist())):
        ds = mix.datasets[mix.names[k]]
        assert batch["labels"][row].tolist() == packed_oracle(ds, r)


def test_mixed_chat_templates_are_refused_unless_allowed(chat, books, chat_tokenizer, tmp_path):
    other = build_chats(tmp_path / "other", chat_tokenizer, generate_conversations(books, 5, seed=9),
                        variant(CHATML, tags=True))
    assert other.chat_template != chat.chat_template
    sources = {"sft": tc.TokenDataset(chat, SEQ), "sft2": tc.TokenDataset(other, SEQ)}
    with pytest.raises(ValueError, match="'sft' and 'sft2'.*chat templates.*allow_mixed_templates"):
        tc.MixtureDataset(sources)
    mix = tc.MixtureDataset(sources, allow_mixed_templates=True)
    expect_consistent(mix.get_batch(np.arange(8)))


# ------------------------------------------------------------------ loaders: workers and resume

def make_dataset(kind: str, chat, text, plan_dir):
    if kind == "tokens":
        return tc.TokenDataset(chat, SEQ)
    if kind == "packed":
        return tc.PackedDataset(chat, SEQ, long_docs="truncate", plan_dir=plan_dir)
    return tc.MixtureDataset({"chat": tc.TokenDataset(chat, SEQ), "text": tc.TokenDataset(text, SEQ)},
                             {"chat": 0.8, "text": 0.2}, block_size=10, num_samples=80)


@pytest.mark.parametrize("kind", ["tokens", "packed", "mixture"])
def test_workers_and_resume_give_the_same_masked_batches(kind, chat, text, tmp_path):
    def loader(workers: int) -> tc.DataLoader:
        ds = make_dataset(kind, chat, text, tmp_path)
        return tc.DataLoader(ds, batch_size=4, shuffle=True, num_workers=workers)

    in_process = list(loader(0))
    assert len(in_process) >= 6
    with_workers = list(loader(2))
    assert len(with_workers) == len(in_process)
    for a, b in zip(in_process, with_workers):
        expect_consistent(b)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first, k = loader(2), 3
    it = iter(first)
    head = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader(2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(in_process)
    for a, b in zip(in_process, head + rest):
        assert all(torch.equal(a[key], b[key]) for key in ("input_ids", "labels", "loss_mask"))
