"""PackedDataset in training: every token once, masks that never cross a document, batches that
equal the default collate, and exact (elastic) resume through tc.DataLoader, mixtures included."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest
import torch
from _helpers_resume import lockstep_steps
from conftest import paragraphs, write_jsonl
from torch.utils.data import default_collate

import torchcache as tc
from torchcache._util import hooks

KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "num_segments")
IGNORE = -100
BATCH = 4


# ---------------------------------------------------------------- fixtures and helpers

@pytest.fixture(scope="module")
def corpus(tmp_path_factory, books, gpt2_tokenizer_path):
    """600 real paragraphs in a cache of several small blocks; a few documents are far longer
    than the sequence lengths used here (up to about 4,500 tokens)."""
    d = tmp_path_factory.mktemp("packed")
    texts = paragraphs(books, 600)
    tc.build_cache(write_jsonl(d / "docs.jsonl", texts), d / "cache", gpt2_tokenizer_path,
                   block_tokens=4000, progress=False)
    cache = tc.TokenCache(d / "cache")
    assert cache.num_blocks >= 5
    return d, texts


@pytest.fixture(scope="module")
def cache(corpus):
    return tc.TokenCache(corpus[0] / "cache")


@pytest.fixture(scope="module")
def lengths(cache) -> np.ndarray:
    return np.array([len(cache.document(d)) for d in range(cache.num_documents)])


@pytest.fixture(scope="module")
def ds(cache):
    return tc.PackedDataset(cache, 128)


def exact_fit_seq_len(lengths: np.ndarray) -> int:
    """A seq_len that one real document fills exactly twice (its last piece ends the document)."""
    even = sorted(int(n) for n in lengths if n % 2 == 0 and 128 <= n // 2 <= 512)
    assert even, "no document of an even length in [256, 1024]"
    return even[-1] // 2


def check_rows(ds: tc.PackedDataset) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """Check every row against row_documents and the cache; -> (pieces per document, padding)."""
    cache, C, cap = ds.cache, ds.seq_len, ds.max_segments
    n = len(ds)
    batch = ds.get_batch(list(range(n)))
    assert set(batch) == set(KEYS)
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].dtype == torch.int64 and batch[key].shape == (n, C), key
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"].shape == (n, cap + 1)
    assert batch["num_segments"].shape == (n,)
    pieces: dict[int, list[tuple[int, int]]] = {}
    padding = 0
    for i in range(n):
        ids, labels, pos, cu, k = (batch[key][i] for key in KEYS)
        segments = ds.row_documents(i)
        assert 1 <= len(segments) <= cap and int(k) == len(segments), i
        ends = np.cumsum([0] + [e - s for _, s, e in segments])
        used = int(ends[-1])
        assert used <= C
        assert cu[:len(segments) + 1].tolist() == ends.tolist(), i
        assert (cu[len(segments) + 1:] == C).all(), i
        for (d, s, e), a, b in zip(segments, ends[:-1].tolist(), ends[1:].tolist()):
            doc = cache.document(d).astype(np.int64)
            assert 0 <= s < e <= len(doc), (i, d, s, e)
            assert ids[a:b].tolist() == doc[s:e].tolist(), (i, d)
            assert pos[a:b].tolist() == list(range(e - s)), (i, d)
            if e < len(doc):  # a cut piece fills its row alone; its last label is the next token
                assert (e - s, len(segments)) == (C, 1), (i, d, s, e)
                last = int(doc[e])
            else:
                last = IGNORE
            assert labels[a:b].tolist() == doc[s + 1:e].tolist() + [last], (i, d)
            pieces.setdefault(d, []).append((s, e))
        # padding: pad_id, no label, positions restart as one more segment
        assert (ids[used:] == ds.pad_id).all(), i
        assert (labels[used:] == IGNORE).all(), i
        assert pos[used:].tolist() == list(range(C - used)), i
        padding += C - used
    assert ds.padding_fraction == padding / (n * C)
    assert ds.stats()["padding"] == padding
    return pieces, padding


def check_tiling(pieces: dict[int, list[tuple[int, int]]], lengths: np.ndarray, docs) -> None:
    """The pieces of each of ``docs`` tile [0, len) exactly once; no other document appears."""
    assert set(pieces) == set(docs)
    for d in docs:
        at = 0
        for s, e in sorted(pieces[d]):
            assert s == at, f"document {d}: piece at {s}, expected {at} (gap or overlap)"
            at = e
        assert at == lengths[d], f"document {d}: pieces end at {at} of {lengths[d]}"


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for j, (a, b) in enumerate(zip(got, want)):
        assert set(a) == set(b) == set(KEYS), j
        for key in KEYS:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (j, key)


def run_batches(loader: tc.DataLoader, num_batches: int) -> list[dict]:
    """Iterate loader epochs until ``num_batches`` batches were received (an epoch loop)."""
    out: list[dict] = []
    while len(out) < num_batches:
        before = len(out)
        for batch in loader:
            out.append(batch)
            if len(out) == num_batches:
                break
        assert len(out) > before, "an iter() yielded nothing"
    return out


def interrupted(make, k: int, total: int) -> list[dict]:
    """k batches, state through JSON, a fresh loader resumes and runs to ``total``."""
    first = make()
    head = run_batches(first, k)
    state = json.loads(json.dumps(first.state_dict()))
    second = make()
    second.load_state_dict(state)
    return head + run_batches(second, total - k)


def row_keys(batch: dict) -> list[bytes]:
    """One bytes key per row: its whole content."""
    return [b"".join(batch[key][i].numpy().tobytes() for key in KEYS)
            for i in range(len(batch["input_ids"]))]


# ---------------------------------------------------------------- 1. rows


@pytest.mark.parametrize("seq_len", [128, 256, "exact-fit"])
def test_every_token_of_every_document_is_in_exactly_one_row(cache, lengths, seq_len):
    if seq_len == "exact-fit":
        seq_len = exact_fit_seq_len(lengths)
    ds = tc.PackedDataset(cache, seq_len)
    assert ds.pad_id == cache.eos_id
    pieces, padding = check_rows(ds)
    check_tiling(pieces, lengths, range(cache.num_documents))
    long = lengths > seq_len
    assert long.sum() >= 3 and ds.split_documents == int(long.sum())
    assert ds.dropped_documents == 0
    assert padding > 0 and len(ds) * seq_len == lengths.sum() + padding
    if seq_len not in (128, 256):  # a document cut into exactly two full pieces
        d = int(np.flatnonzero(lengths == 2 * seq_len)[0])
        assert sorted(pieces[d]) == [(0, seq_len), (seq_len, 2 * seq_len)]
        row = next(i for i in range(len(ds)) if ds.row_documents(i) == [(d, seq_len, 2 * seq_len)])
        assert ds[row]["labels"][-1] == IGNORE and ds[row]["num_segments"] == 1


def test_an_explicit_pad_id_fills_the_padding(cache, lengths):
    ds = tc.PackedDataset(cache, 128, pad_id=0)
    assert ds.pad_id == 0
    pieces, padding = check_rows(ds)  # padding positions hold 0, labels -100
    assert padding > 0
    check_tiling(pieces, lengths, range(cache.num_documents))
    default = tc.PackedDataset(cache, 128)  # the same plan: only the padding ids differ
    assert len(default) == len(ds) and default.padding_fraction == ds.padding_fraction


@pytest.mark.parametrize("max_segments", [1, 3])
def test_max_segments_caps_the_documents_per_row(cache, lengths, max_segments):
    ds = tc.PackedDataset(cache, 128, max_segments=max_segments)
    assert ds[0]["cu_seqlens"].shape == (max_segments + 1,)
    pieces, _ = check_rows(ds)  # 1 <= num_segments <= max_segments in every row
    check_tiling(pieces, lengths, range(cache.num_documents))
    counts = ds.get_batch(list(range(len(ds))))["num_segments"]
    assert counts.max() == max_segments
    if max_segments == 1:
        assert len(ds) == sum(math.ceil(n / 128) for n in lengths.tolist())


def test_drop_leaves_long_documents_out(cache, lengths):
    C = 128
    ds = tc.PackedDataset(cache, C, long_docs="drop")
    pieces, padding = check_rows(ds)
    kept = np.flatnonzero(lengths <= C)
    check_tiling(pieces, lengths, kept.tolist())  # the long ones are absent, the rest whole
    assert all(pieces[d] == [(0, int(lengths[d]))] for d in kept)
    assert ds.dropped_documents == int((lengths > C).sum()) >= 3
    assert ds.stats()["dropped_tokens"] == int(lengths[lengths > C].sum())
    assert ds.split_documents == 0
    assert len(ds) * C == lengths[kept].sum() + padding


def test_a_plan_stored_in_many_chunks_gives_the_same_rows(ds, tmp_path, monkeypatch):
    monkeypatch.setattr(hooks, "pack_chunk_blocks", 2)  # a chunk file per 2 blocks
    chunked = tc.PackedDataset(ds.cache, 128, plan_dir=tmp_path)
    files = [name for _, _, names in os.walk(tmp_path) for name in names if name.endswith(".pack")]
    assert len(files) == math.ceil(ds.cache.num_blocks / 2)
    reopened = tc.PackedDataset(ds.cache, 128, plan_dir=tmp_path)  # mapped from the files
    every = list(range(len(ds)))
    assert len(chunked) == len(reopened) == len(ds)
    want = ds.get_batch(every)
    assert_same_batches([chunked.get_batch(every), reopened.get_batch(every)], [want, want])
    assert [reopened.row_documents(i) for i in every] == [ds.row_documents(i) for i in every]
    assert reopened.padding_fraction == ds.padding_fraction


# ---------------------------------------------------------------- 2. batched reads


def test_get_batch_equals_the_default_collate_of_the_items(ds):
    n = len(ds)
    rng = np.random.default_rng(0)
    for idx in ([0], [n - 1, 0, n - 1], rng.integers(0, n, 9).tolist(), list(range(n))):
        batch = ds.get_batch(idx)
        assert_same_batches([batch], [default_collate(ds.__getitems__(idx))])
        assert_same_batches([batch], [default_collate([ds[i] for i in idx])])
        assert_same_batches([ds.expand_batch(ds.compact_batch(idx))], [batch])
    assert_same_batches([default_collate([ds[-1]])], [default_collate([ds[n - 1]])])
    with pytest.raises(IndexError):
        ds[n]


# ---------------------------------------------------------------- 3. DataLoader


def packed_loader(ds, **kw) -> tc.DataLoader:
    return tc.DataLoader(ds, batch_size=BATCH, shuffle=True, **kw)


def test_loader_modes_give_the_same_batches(ds):
    order = list(tc.DistributedSampler(ds, shuffle=True, seed=0))
    assert sorted(order) == list(range(len(ds)))
    want = [ds.get_batch(order[j:j + BATCH]) for j in range(0, len(order), BATCH)]
    for kw in ({"num_workers": 0}, {"num_workers": 2}, {"num_workers": 0, "prefetch_batches": 2}):
        loader = packed_loader(ds, **kw)
        assert_same_batches(list(loader), want)
        assert loader.consumed == len(ds)


@pytest.mark.parametrize("offset", [-40, 0, 8], ids=["tail-crosses-epoch", "at-epoch-end",
                                                   "head-crosses-epoch"])
def test_resume_with_workers_is_exact(ds, offset):
    per_epoch = math.ceil(len(ds) / BATCH)
    assert per_epoch > 40
    k, total = per_epoch + offset, per_epoch + 20  # stop before, at and after the epoch's end

    def make():
        return packed_loader(ds, num_workers=2)

    full = run_batches(make(), total)
    assert_same_batches(interrupted(make, k, total), full)


def test_a_state_of_another_packing_is_refused(cache, ds):
    other = tc.PackedDataset(cache, 128, seed=1)  # the same rows, packed in another order
    assert len(other) == len(ds) and other.fingerprint != ds.fingerprint
    loader = packed_loader(ds)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="fingerprint"):
        packed_loader(other).load_state_dict(state)
    with pytest.raises(ValueError):  # another seq_len: other rows
        packed_loader(tc.PackedDataset(cache, 256)).load_state_dict(state)


@pytest.mark.slow
def test_spawned_workers_give_the_same_batches(ds):
    """Workers that get the dataset pickled (spawn, the default on macOS) read the same rows."""
    want = list(packed_loader(ds))
    loader = packed_loader(ds, num_workers=2, multiprocessing_context="spawn")
    assert_same_batches(list(loader), want)


# ---------------------------------------------------------------- 4. world-size change


def lockstep_rows(loaders, num_steps: int | None = None) -> list[list[bytes]]:
    """Each global step's rows (as keys) from one loader per simulated rank, in lock-step."""
    return lockstep_steps(loaders, num_steps, keys=row_keys)


@pytest.mark.parametrize("new_world, new_batch", [(3, 4), (1, 8)])
def test_world_size_change_reads_every_row_once(ds, new_world, new_batch):
    """As tests/test_loader_resume.py's elastic resume: rank 0's state of W=2 loaders, loaded
    by every rank of W=3 (or W=1) loaders; the rest of the epoch loses and repeats no row."""
    n = len(ds)
    keys = row_keys(ds.get_batch(list(range(n))))
    old_world, old_batch, k = 2, 4, 10

    def loaders(world, b, **kw):
        return [tc.DataLoader(ds, batch_size=b, sampler=tc.DistributedSampler(
            ds, num_replicas=world, rank=r, shuffle=True, seed=0), **kw) for r in range(world)]

    old = loaders(old_world, old_batch, prefetch_batches=2)  # runs ahead of what was received
    head = lockstep_rows(old, k)
    states = [json.loads(json.dumps(loader.state_dict())) for loader in old]
    assert all(s == states[0] for s in states) and states[0]["consumed"] == k * old_world * old_batch
    new = loaders(new_world, new_batch)
    for loader in new:
        loader.load_state_dict(states[0])
    tail = lockstep_rows(new)  # the rest of the epoch
    end = new[0].consumed
    # the loader epoch ends at W * ceil(n / W), plus < W positions when resumed unaligned: the
    # new ranks may read a few positions of epoch 1
    assert n <= end < n + 2 * new_world

    # as global positions: each step holds the rows of the next positions of the stream
    stream = tc.DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=0)
    at = 0
    for t, step in enumerate(head + tail):
        want = stream.indices_for_positions(np.arange(at, at + len(step), dtype=np.int64))
        assert Counter(step) == Counter(keys[i] for i in want.tolist()), f"step {t} from {at}"
        at += len(step)
    assert at == end
    # as row contents: every row of the epoch exactly once, plus the next epoch's first rows
    spill = stream.indices_for_positions(np.arange(n, end, dtype=np.int64)).tolist()
    read = Counter(key for step in head + tail for key in step)
    assert read == Counter(keys) + Counter(keys[i] for i in spill)


# ---------------------------------------------------------------- 5. mixtures of packed sources


@pytest.fixture(scope="module")
def mixture(corpus, gpt2_tokenizer_path):
    d, texts = corpus
    halves = {}
    for name, part in (("first", texts[:300]), ("second", texts[300:])):
        tc.build_cache(write_jsonl(d / f"{name}.jsonl", part), d / name, gpt2_tokenizer_path,
                       block_tokens=3000, progress=False)
        halves[name] = tc.PackedDataset(d / name, 128)
    return tc.MixtureDataset(halves, {"first": 1, "second": 1}, seed=0, block_size=16)


def test_mixture_items_are_the_sources_rows(mixture):
    assert len(mixture) == sum(len(s) for s in mixture.datasets.values())
    idx = list(range(0, 3 * len(mixture), 7))  # beyond one pass over the sources too
    src, local = mixture.locate(np.array(idx))
    items = mixture.__getitems__(idx)
    assert set(src.tolist()) == {0, 1}
    for i, s, j, item in zip(idx, src.tolist(), local.tolist(), items):
        source = mixture.datasets[mixture.names[s]]
        assert_same_batches([default_collate([item])], [default_collate([source[j]])])
        assert_same_batches([default_collate([mixture[i]])], [default_collate([item])])


def test_a_mixture_batch_of_packed_rows_equals_its_collated_items(mixture):
    """Sources of one compact format (same seq_len, pad_id, dtype) are read compact and the
    batch is expanded once; sources that differ (another pad_id) are batched each on its own
    and merged: both equal the default collate of the mixture's items."""
    idx = np.arange(5, 5 + 3 * BATCH)
    sources = mixture.datasets
    assert len({s.compact_format for s in sources.values()}) == 1
    assert_same_batches([mixture.get_batch(idx)], [default_collate(mixture.__getitems__(idx.tolist()))])
    other = {"first": sources["first"],
             "second": tc.PackedDataset(sources["second"].cache, 128, pad_id=7)}
    mixed = tc.MixtureDataset(other, {"first": 1, "second": 1}, seed=0, block_size=16)
    assert other["first"].compact_format != other["second"].compact_format
    assert_same_batches([mixed.get_batch(idx)], [default_collate(mixed.__getitems__(idx.tolist()))])


def test_mixture_of_packed_sources_resumes_exactly_with_workers(mixture):
    per_epoch = math.ceil(len(mixture) / BATCH)
    total, k = per_epoch + 10, per_epoch - 5  # the resumed run crosses the epoch's end

    def make():
        return tc.DataLoader(mixture, batch_size=BATCH, num_workers=2)

    full = run_batches(make(), total)
    # the mixture is read in order: position p is mixture index p, the next epoch continues
    want = [default_collate(mixture.__getitems__(list(range(j * BATCH, (j + 1) * BATCH))))
            for j in range(per_epoch - 1)]
    assert_same_batches(full[:per_epoch - 1], want)
    assert_same_batches(interrupted(make, k, total), full)


# ---------------------------------------------------------------- 6. plain script


def test_a_plain_script_without_main_guard_trains_with_two_workers(tmp_path, books,
                                                                   gpt2_tokenizer_path):
    src = write_jsonl(tmp_path / "docs.jsonl", paragraphs(books, 200))
    cache = tmp_path / "cache"
    script = tmp_path / "plain_train.py"
    script.write_text(textwrap.dedent(f"""
        import torchcache as tc
        print("script body runs", flush=True)
        tc.build_cache({src!r}, {str(cache)!r}, {gpt2_tokenizer_path!r}, block_tokens=2000,
                       progress=False)
        ds = tc.PackedDataset({str(cache)!r}, seq_len=128)
        loader = tc.DataLoader(ds, batch_size=2, num_workers=2, shuffle=True)
        batches = rows = 0
        for batch in loader:
            batches += 1
            rows += batch["input_ids"].shape[0]
        print("rows", len(ds), rows, "batches", batches, flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("script body runs") == 1, "the user's script ran again in a worker"
    n = len(tc.PackedDataset(cache, 128))
    assert n > 10
    assert f"rows {n} {n} batches {math.ceil(n / 2)}\n" in proc.stdout, proc.stdout
