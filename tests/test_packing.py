"""Packing: best fit decreasing per block (against a per-piece reference), the stored plan
sidecar (reuse, identity, damage, parallel planning) and plans of a growing cache.

Caches here are real (GPT-2 over book paragraphs) with small blocks, and plans use 4 blocks
per chunk file (the test hook ``hooks.pack_chunk_blocks``) so a cache spans several chunks.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
from conftest import build_killed_at_commit, paragraphs, write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

import torchcache as tc
import torchcache.cli as cli
import torchcache.read.pack_plan as pack_plan
from torchcache._util import hooks
from torchcache.order.permutation import derive_key, mix64
from torchcache.order.packing import pack_block

CHUNK_BLOCKS = 4
BLOCK_TOKENS = 2048
SEQ = 128


@pytest.fixture(autouse=True)
def small_plan_chunks(monkeypatch):
    monkeypatch.setattr(hooks, "pack_chunk_blocks", CHUNK_BLOCKS)


# ---------------------------------------------------------------- the packer, against a reference

def pieces_of(offsets, C, long_docs):
    """(start, length, continues) of every piece, in stream order; and the drop/split counts."""
    pieces, dropped_documents, dropped_tokens, split_documents = [], 0, 0, 0
    for a, b in zip(offsets[:-1], offsets[1:]):
        if b - a > C:
            if long_docs == "drop":
                dropped_documents += 1
                dropped_tokens += b - a
                continue
            split_documents += 1
            while b - a > C:
                pieces.append((a, C, True))
                a += C
        if b > a:
            pieces.append((a, b - a, False))
    return pieces, dropped_documents, dropped_tokens, split_documents


def reference_pack(offsets, C, long_docs, max_segments, seed, block):
    """Best fit decreasing, one piece at a time: the open row with the least room that fits
    (equal rooms: the row that got its room first), else a new row. Rows in creation order,
    each a list of (start, length, continues) in stream order."""
    cap = C if max_segments is None else max_segments
    pieces, *counts = pieces_of([int(x) for x in offsets], C, long_docs)
    bits = max(1, C.bit_length())
    key = derive_key(seed, "pack-ties", block)
    pieces.sort(key=lambda p: (-p[1], mix64(p[0] ^ key) >> bits))  # as pack_block orders them
    rows, room, count, stamp, is_open = [], [], [], [], []
    clock = 0
    for piece in pieces:
        fits = [r for r in range(len(rows)) if is_open[r] and room[r] >= piece[1]]
        if fits:
            r = min(fits, key=lambda r: (room[r], stamp[r]))
        else:
            r = len(rows)
            rows.append([])
            room.append(C)
            count.append(0)
            stamp.append(0)
            is_open.append(True)
        rows[r].append(piece)
        room[r] -= piece[1]
        count[r] += 1
        clock += 1
        stamp[r] = clock
        is_open[r] = room[r] > 0 and count[r] < cap
    return [sorted(row) for row in rows], counts


def rows_of(pack):
    out, lo = [], 0
    for hi in pack.row_ends.tolist():
        out.append(list(zip(pack.seg_start[lo:hi].tolist(), pack.seg_len[lo:hi].tolist(),
                            pack.seg_continues[lo:hi].tolist())))
        lo = hi
    return out


def check_invariants(pack, offsets, C, long_docs, max_segments):
    offsets = np.asarray(offsets, dtype=np.int64)
    cap = C if max_segments is None else max_segments
    lengths = np.diff(offsets)
    rows = rows_of(pack)
    assert pack.rows == len(rows)
    assert pack.seg_start.dtype == np.int64 and pack.seg_len.dtype == np.int32
    assert pack.seg_continues.dtype == bool and pack.row_ends.dtype == np.int64
    for row in rows:
        assert 1 <= len(row) <= cap
        assert sum(n for _, n, _ in row) <= C
        assert [s for s, _, _ in row] == sorted(s for s, _, _ in row)  # stream order
    used = int(pack.seg_len.sum())
    assert pack.padding == pack.rows * C - used
    # the pieces are exactly the documents' tokens (long ones cut at multiples of C, or left out)
    segments = sorted(p for row in rows for p in row)
    expected, dropped_documents, dropped_tokens, split_documents = pieces_of(offsets.tolist(), C, long_docs)
    assert segments == expected
    long = lengths > C
    if long_docs == "drop":
        assert (pack.dropped_documents, pack.dropped_tokens, pack.split_documents) == (
            int(long.sum()), int(lengths[long].sum()), 0)
        assert used == int(lengths[~long].sum())
    else:
        assert (pack.dropped_documents, pack.dropped_tokens, pack.split_documents) == (0, 0, int(long.sum()))
        assert used == int(offsets[-1] - offsets[0])  # every token in exactly one segment
    assert (dropped_documents, dropped_tokens, split_documents) == (
        pack.dropped_documents, pack.dropped_tokens, pack.split_documents)
    # continues: a full piece whose document goes on
    ends = offsets[np.searchsorted(offsets, pack.seg_start, side="right")]
    goes_on = (pack.seg_len == C) & (pack.seg_start + C < ends)
    assert np.array_equal(pack.seg_continues, goes_on)


@st.composite
def packing_inputs(draw):
    C = draw(st.integers(1, 48))
    special = st.sampled_from([0, 1, C - 1, C, C + 1, 2 * C, 3 * C + 1])
    lengths = draw(st.lists(st.one_of(st.integers(0, C), st.integers(0, 4 * C), special), max_size=80))
    start = draw(st.sampled_from([0, 0, 17]))  # offsets are local to a block: they start at 0
    offsets = np.concatenate([[start], start + np.cumsum(np.array(lengths, dtype=np.int64))]).astype(np.int64)
    max_segments = draw(st.one_of(st.none(), st.integers(1, C)))
    long_docs = draw(st.sampled_from(["split", "drop"]))
    seed = draw(st.one_of(st.integers(0, 3), st.integers(0, 2 ** 63 - 1)))
    block = draw(st.integers(0, 10_000))
    return offsets, C, long_docs, max_segments, seed, block


@settings(max_examples=250, deadline=None)
@given(packing_inputs())
def test_pack_block_is_best_fit_decreasing_and_keeps_every_promise(inputs):
    offsets, C, long_docs, max_segments, seed, block = inputs
    pack = pack_block(offsets, C, long_docs=long_docs, max_segments=max_segments, seed=seed, block=block)
    check_invariants(pack, offsets, C, long_docs, max_segments)
    expected, counts = reference_pack(offsets, C, long_docs, max_segments, seed, block)
    assert rows_of(pack) == expected
    assert counts == [pack.dropped_documents, pack.dropped_tokens, pack.split_documents]
    again = pack_block(offsets.copy(), C, long_docs=long_docs, max_segments=max_segments, seed=seed,
                       block=block)
    for field in ("row_ends", "seg_start", "seg_len", "seg_continues"):  # deterministic
        assert np.array_equal(getattr(pack, field), getattr(again, field))
    assert (again.padding, again.rows, again.split_documents) == (pack.padding, pack.rows, pack.split_documents)


@pytest.mark.parametrize("max_segments", [None, 3])
@pytest.mark.parametrize("long_docs", ["split", "drop"])
def test_pack_block_matches_the_reference_on_many_real_sized_documents(long_docs, max_segments):
    rng = np.random.default_rng(7)
    C = 512
    lengths = np.concatenate([rng.geometric(1 / 120, 1500), rng.integers(0, 3 * C, 100), [0, C, C, 2 * C]])
    offsets = np.concatenate([[0], np.cumsum(rng.permutation(lengths))])
    for seed in (0, 1):
        pack = pack_block(offsets, C, long_docs=long_docs, max_segments=max_segments, seed=seed, block=3)
        check_invariants(pack, offsets, C, long_docs, max_segments)
        expected, _ = reference_pack(offsets, C, long_docs, max_segments, seed, 3)
        assert rows_of(pack) == expected
        if max_segments is None:
            assert pack.padding < 0.05 * pack.rows * C  # best fit leaves little room


def test_the_seed_and_block_only_reorder_equal_pieces():
    offsets = np.arange(0, 3 * 40 + 1, 3)  # forty 3-token documents, rows of 10 tokens
    packs = [pack_block(offsets, 10, seed=seed, block=block) for seed in range(4) for block in range(2)]
    compositions = {tuple(map(tuple, rows_of(p))) for p in packs}
    assert len(compositions) > 1  # which documents share a row changes ...
    for p in packs:  # ... never how many rows, how full, or what is packed
        check_invariants(p, offsets, 10, "split", None)
        assert (p.rows, p.padding) == (packs[0].rows, packs[0].padding) == (14, 20)


def test_pack_block_edge_cases():
    empty = pack_block(np.array([0]), 8)
    assert empty.rows == 0 and empty.padding == 0 and len(empty.seg_len) == 0
    zeros = pack_block(np.array([0, 0, 0, 0]), 8)
    assert zeros.rows == 0 and len(zeros.seg_start) == 0
    exact = pack_block(np.array([0, 8, 16]), 8)
    assert rows_of(exact) == [[(0, 8, False)], [(8, 8, False)]] and exact.padding == 0
    one = pack_block(np.array([0, 5, 6, 7]), 8, max_segments=1)
    assert one.rows == 3 and one.padding == 24 - 7
    dropped = pack_block(np.array([0, 20, 23]), 8, long_docs="drop")
    assert rows_of(dropped) == [[(20, 3, False)]]
    assert (dropped.dropped_documents, dropped.dropped_tokens) == (1, 20)
    cut = pack_block(np.array([0, 20, 23]), 8, long_docs="truncate")
    assert rows_of(cut) == [[(0, 8, True)], [(20, 3, False)]]  # its last label: the next token
    assert (cut.dropped_documents, cut.dropped_tokens) == (1, 12)  # (in this mode: truncated)
    with pytest.raises(ValueError, match="long_docs"):
        pack_block(np.array([0, 3]), 8, long_docs="wrap")


# ---------------------------------------------------------------- the plan sidecar on a real cache

@pytest.fixture(scope="module")
def docs(books):
    return paragraphs(books, 600)


@pytest.fixture(scope="module")
def built(tmp_path_factory, docs, gpt2_tokenizer_path):
    d = tmp_path_factory.mktemp("packing")
    src = write_jsonl(d / "d.jsonl", docs)
    tc.build_cache(src, d / "cache", gpt2_tokenizer_path, block_tokens=BLOCK_TOKENS, progress=False)
    cache = tc.TokenCache(d / "cache")
    assert cache.num_blocks >= 3 * CHUNK_BLOCKS and cache.num_blocks % CHUNK_BLOCKS  # a partial last chunk
    return d / "cache"


@pytest.fixture()
def cache_copy(built, tmp_path):
    """A private copy of the built cache (no plan yet), for tests that write or damage plans."""
    out = tmp_path / "cache"
    shutil.copytree(built, out)
    return out


def all_rows(ds):
    return ds.get_batch(range(len(ds)))


def assert_same_rows(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def chunk_files(ds):
    return sorted(n for n in os.listdir(ds.plan.dir) if n.endswith(".pack"))


@pytest.mark.parametrize("seq_len,long_docs,max_segments", [
    (SEQ, "split", 8), (SEQ, "drop", 8),
    (5, "drop", 2),  # most documents dropped: blocks without rows
])
def test_rows_hold_the_documents_tokens_with_masks(built, seq_len, long_docs, max_segments, tmp_path):
    cache = tc.TokenCache(built)
    stream = cache.read(0, cache.num_tokens).astype(np.int64)
    doc_ends = np.array([cache.document_span(i)[1] for i in range(cache.num_documents)])
    lengths = np.diff(np.concatenate([[0], doc_ends]))
    C, cap = seq_len, max_segments
    ds = tc.PackedDataset(cache, C, long_docs=long_docs, max_segments=cap, pad_id=7, plan_dir=tmp_path)
    stats = ds.stats()
    assert stats["rows"] == len(ds) > 0 and stats["blocks"] == cache.num_blocks
    assert (ds.split_documents, ds.dropped_documents) == (
        (int((lengths > C).sum()), 0) if long_docs == "split" else (0, int((lengths > C).sum())))
    assert ds.split_documents + ds.dropped_documents > 0
    if C == 5:
        assert (np.diff(ds.plan.row_starts) == 0).any()
    batch = all_rows(ds)
    assert_same_rows(pickle.loads(pickle.dumps(ds)).get_batch(range(len(ds))), batch)  # as in workers
    # small batches (a loader's: rows of one plan chunk, most of them one full piece each, read
    # by a faster path than a batch of all rows) hold the same rows
    order = np.random.default_rng(0).permutation(len(ds))
    for rows in [[i] for i in range(len(ds))] + np.array_split(order, max(1, len(ds) // 3)):
        assert_same_rows(ds.get_batch(rows), {k: v[list(rows)] for k, v in batch.items()})
    covered = np.zeros(cache.num_tokens, dtype=np.int64)
    for i in range(len(ds)):
        k = int(batch["num_segments"][i])
        cu = batch["cu_seqlens"][i].tolist()
        assert 1 <= k <= cap and cu[0] == 0 and cu[k + 1:] == [C] * (cap - k)
        expect_ids = np.full(C, 7)
        expect_labels = np.full(C, -100)
        for (doc, a, b), lo, hi in zip(ds.row_documents(i), cu[:k], cu[1:k + 1]):
            g = cache.document_span(doc)[0] + a
            assert hi - lo == b - a
            covered[g:g + b - a] += 1
            expect_ids[lo:hi] = stream[g:g + b - a]
            expect_labels[lo:hi - 1] = stream[g + 1:g + b - a]
            if g + b - a < doc_ends[doc]:  # a split piece: its last label is the next token
                assert b - a == C and a % C == 0
                expect_labels[hi - 1] = stream[g + b - a]
            assert batch["position_ids"][i, lo:hi].tolist() == list(range(hi - lo))
        assert batch["input_ids"][i].tolist() == expect_ids.tolist()
        assert batch["labels"][i].tolist() == expect_labels.tolist()
    if long_docs == "split":
        assert (covered == 1).all()  # every token in exactly one row
    else:
        assert (covered == np.repeat(lengths <= C, lengths)).all()
        assert stats["dropped_tokens"] == int(lengths[lengths > C].sum())
    assert stats["padding"] == len(ds) * C - covered.sum()
    assert ds.padding_fraction == pytest.approx(1 - covered.sum() / (len(ds) * C))


def test_a_second_open_maps_the_stored_plan_without_packing(cache_copy, monkeypatch):
    first = tc.PackedDataset(cache_copy, SEQ)
    rows = all_rows(first)
    blocks = tc.TokenCache(cache_copy).num_blocks
    assert first.plan.dir == os.path.join(str(cache_copy), "packs", first.plan.identity.plan_id)
    assert chunk_files(first) == [f"{c:06d}.pack" for c in range(-(-blocks // CHUNK_BLOCKS))]
    assert os.path.exists(os.path.join(first.plan.dir, "plan.json"))
    stored = {n: open(os.path.join(first.plan.dir, n), "rb").read() for n in chunk_files(first)}

    def no_packing(*args, **kwargs):
        raise AssertionError("the plan was computed again")

    monkeypatch.setattr(pack_plan, "pack_block", no_packing)
    again = tc.PackedDataset(str(cache_copy), SEQ)
    assert len(again) == len(first) and again.fingerprint == first.fingerprint
    assert again.stats() == first.stats()
    assert_same_rows(all_rows(again), rows)
    assert {n: open(os.path.join(first.plan.dir, n), "rb").read() for n in chunk_files(first)} == stored


def test_each_option_has_its_own_plan_and_fingerprint(cache_copy):
    base = tc.PackedDataset(cache_copy, SEQ)
    variants = [tc.PackedDataset(cache_copy, SEQ - 32), tc.PackedDataset(cache_copy, SEQ, long_docs="drop"),
                tc.PackedDataset(cache_copy, SEQ, max_segments=4), tc.PackedDataset(cache_copy, SEQ, seed=1)]
    everything = [base] + variants
    assert len({ds.plan.dir for ds in everything}) == len({ds.fingerprint for ds in everything}) == 5
    assert sorted(os.listdir(cache_copy / "packs")) == sorted(ds.plan.identity.plan_id for ds in everything)
    assert all(ds.fingerprint.startswith(base.cache.fingerprint + "/") for ds in everything)
    capped = all_rows(variants[2])
    assert int(capped["num_segments"].max()) <= 4 and capped["cu_seqlens"].shape[1] == 5
    # the padding id is not part of the plan
    assert tc.PackedDataset(cache_copy, SEQ, pad_id=0).plan.dir == base.plan.dir
    assert pack_plan.list_plans(str(cache_copy / "packs"))[0]["chunks"]


def test_plan_dir_keeps_the_plan_outside_the_cache(cache_copy, tmp_path):
    plans = tmp_path / "plans"
    ds = tc.PackedDataset(cache_copy, SEQ, plan_dir=plans)
    assert not (cache_copy / "packs").exists()
    assert ds.plan.dir == os.path.join(str(plans), ds.plan.identity.plan_id)
    assert chunk_files(ds) and len(ds) == len(tc.PackedDataset(cache_copy, SEQ))
    assert_same_rows(all_rows(ds), all_rows(tc.PackedDataset(cache_copy, SEQ)))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_cache_asks_for_plan_dir(cache_copy, tmp_path):
    os.chmod(cache_copy, 0o555)
    try:
        with pytest.raises(PermissionError, match="plan_dir"):
            tc.PackedDataset(cache_copy, SEQ)
        ds = tc.PackedDataset(cache_copy, SEQ, plan_dir=tmp_path / "plans")
        assert len(ds) > 0 and chunk_files(ds)
    finally:
        os.chmod(cache_copy, 0o755)
    assert not (cache_copy / "packs").exists()


def test_an_unwritable_plan_root_asks_for_plan_dir(cache_copy, tmp_path, monkeypatch):
    """The same as a read-only cache, as root too: every write of the plan is refused."""
    def refused(self, name, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", os.path.join(self.root, name))

    with monkeypatch.context() as m:
        m.setattr(pack_plan.LocalStorage, "write", refused)
        m.setattr(pack_plan.LocalStorage, "write_json", refused)
        with pytest.raises(PermissionError, match="plan_dir") as info:
            tc.PackedDataset(cache_copy, SEQ)
    assert str(cache_copy / "packs") in str(info.value)
    assert len(tc.PackedDataset(cache_copy, SEQ, plan_dir=tmp_path / "plans")) > 0


def _xor(path, at, mask, size=1):
    with open(path, "r+b") as f:
        f.seek(at)
        data = bytearray(f.read(size))
        f.seek(at)
        f.write(bytes(b ^ mask for b in data))


DAMAGE = {  # name: (at open?, what the message says)
    "truncated": (True, "truncated"),
    "header magic": (True, "bad header"),
    "table row count": (True, "block table"),
    "table padding": (False, "padding"),
    "offsets digest": (True, "other blocks"),
    "copied over another chunk": (True, "another plan or other blocks"),
    "segment length": (False, "piece"),
    "segment start": (False, "piece"),
    "continuation flag": (False, "continuation"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_chunk_is_an_error_naming_it_then_computed_again(cache_copy, damage):
    ds = tc.PackedDataset(cache_copy, SEQ)
    rows = all_rows(ds)
    c, local = 1, 2  # damage block 6 (the third block of chunk 1)
    b = c * CHUNK_BLOCKS + local
    path = os.path.join(ds.plan.dir, f"{c:06d}.pack")
    header = np.fromfile(path, dtype=pack_plan.HEADER, count=1)[0]
    n_blocks, n_rows, n_segs = int(header["blocks"]), int(header["rows"]), int(header["segments"])
    table_at = pack_plan.HEADER.itemsize
    record_at = table_at + local * pack_plan.BLOCK_RECORD.itemsize
    rows_at = table_at + n_blocks * pack_plan.BLOCK_RECORD.itemsize
    table = np.fromfile(path, dtype=pack_plan.BLOCK_RECORD, count=n_blocks, offset=table_at)
    row_ends = np.fromfile(path, dtype="<i8", count=n_rows, offset=rows_at)
    first_row = int(table["rows"][:local].sum())
    seg = int(row_ends[first_row - 1]) + 1  # the second segment of block b
    field = lambda name: pack_plan.BLOCK_RECORD.fields[name][1]  # noqa: E731
    if damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 5)
    elif damage == "header magic":
        _xor(path, 0, 0xFF)
    elif damage == "table row count":
        _xor(path, record_at + field("rows"), 0x01)
    elif damage == "table padding":
        _xor(path, record_at + field("padding"), 0x01)
    elif damage == "offsets digest":
        _xor(path, record_at + field("offsets_sha256") + 5, 0x10)
    elif damage == "copied over another chunk":
        shutil.copyfile(os.path.join(ds.plan.dir, "000000.pack"), path)
    elif damage == "segment length":
        _xor(path, rows_at + n_rows * 8 + n_segs * 8 + seg * 4, 0xFF, 4)
    elif damage == "segment start":
        _xor(path, rows_at + n_rows * 8 + seg * 8 + 7, 0x80)
    elif damage == "continuation flag":
        _xor(path, rows_at + n_rows * 8 + n_segs * 12 + seg, 0xFE)
    at_open, what = DAMAGE[damage]
    if at_open:
        with pytest.raises(tc.CacheFormatError, match=what) as info:
            tc.PackedDataset(cache_copy, SEQ)
    else:
        reopened = tc.PackedDataset(cache_copy, SEQ)
        assert len(reopened) == len(ds)
        lo, hi = int(reopened.plan.row_starts[b]), int(reopened.plan.row_starts[b + 1])
        good = [0, lo - 1, hi, len(ds) - 1]  # rows of other blocks, even of the same chunk
        assert_same_rows(reopened.get_batch(good), {k: v[good] for k, v in rows.items()})
        with pytest.raises(tc.CacheFormatError, match=what) as info:
            reopened.get_batch([lo])
        with pytest.raises(tc.CacheFormatError):  # not only the first time
            reopened[hi - 1]
    message = str(info.value)
    assert path in message and "delete" in message
    shutil.rmtree(ds.plan.dir)
    assert_same_rows(all_rows(tc.PackedDataset(cache_copy, SEQ)), rows)


def test_a_plan_of_another_cache_is_refused(cache_copy, tmp_path, docs, gpt2_tokenizer_path):
    """Another cache with the same fingerprint but other blocks (a copy rebuilt from changed
    inputs, keeping its plans) must not reuse the plan."""
    ds = tc.PackedDataset(cache_copy, SEQ)
    src = write_jsonl(tmp_path / "other.jsonl", list(reversed(docs)))
    tc.build_cache(src, tmp_path / "other", gpt2_tokenizer_path, block_tokens=BLOCK_TOKENS, progress=False)
    other = tc.TokenCache(tmp_path / "other")
    with pytest.raises(tc.CacheFormatError, match="other blocks") as info:
        pack_plan.PackPlan(other, ds.plan.identity, str(cache_copy / "packs"))  # forced identity
    assert os.path.join(ds.plan.dir, "000000.pack") in str(info.value) and "delete" in str(info.value)


@pytest.mark.slow
def test_planning_in_child_processes_writes_the_same_plan(cache_copy, tmp_path, monkeypatch):
    """workers=2 plans a chunk's blocks in two fresh processes (started once per extend), so
    here one full chunk holds all blocks but the last two, which (under 2 * workers blocks)
    are planned in this process. Children start only for enough tokens: lowered here."""
    blocks = tc.TokenCache(cache_copy).num_blocks
    monkeypatch.setattr(hooks, "pack_chunk_blocks", blocks - 2)
    monkeypatch.setattr(hooks, "pack_tokens_per_child", 1)
    one = tc.PackedDataset(cache_copy, SEQ, plan_dir=tmp_path / "one")
    in_parent = []
    real = pack_plan.pack_block

    def counted(offsets, *args, block, **kwargs):
        in_parent.append(block)
        return real(offsets, *args, block=block, **kwargs)

    monkeypatch.setattr(pack_plan, "pack_block", counted)
    two = tc.PackedDataset(cache_copy, SEQ, plan_dir=tmp_path / "two", workers=2)
    assert in_parent == [blocks - 2, blocks - 1]  # chunk 0 was planned by the children
    assert chunk_files(one) == chunk_files(two) == ["000000.pack", "000001.pack"]
    for name in chunk_files(one) + ["plan.json"]:
        with open(os.path.join(one.plan.dir, name), "rb") as a, open(os.path.join(two.plan.dir, name), "rb") as b:
            assert a.read() == b.read(), name
    assert_same_rows(all_rows(one), all_rows(two))


def test_verify_passes_on_a_cache_holding_plans(cache_copy, capsys):
    tc.PackedDataset(cache_copy, SEQ)
    tc.PackedDataset(cache_copy, SEQ, long_docs="drop")
    assert len(os.listdir(cache_copy / "packs")) == 2
    assert tc.verify_cache(cache_copy) == []
    assert cli.main(["verify", str(cache_copy)]) == 0
    assert "all checksums match" in capsys.readouterr().out


# ---------------------------------------------------------------- a growing cache

@pytest.mark.parametrize("kills", [(7,), pytest.param((7, 4), marks=pytest.mark.slow)])
def test_the_plan_of_a_growing_cache_only_extends(tmp_path, docs, gpt2_tokenizer_path, kills):
    """Open the plan of a partial cache (killed at known commits), follow it with refresh()
    while the build goes on: rows already seen never change, and in the end the plan is the
    one the complete cache gets at once."""
    src = write_jsonl(tmp_path / "d.jsonl", docs)
    out = tmp_path / "growing"
    ds, seen = None, []
    for commits in kills:  # an inline build commits once per block (after a first commit)
        assert build_killed_at_commit([src], out, gpt2_tokenizer_path, commits,
                                      block_tokens=BLOCK_TOKENS) == -9
        if ds is None:
            ds = tc.PackedDataset(out, SEQ)
            assert ds.cache.num_blocks == 6
        else:
            assert ds.refresh() > len(seen[-1])
        blocks = ds.cache.num_blocks
        assert not ds.cache.complete and blocks % CHUNK_BLOCKS
        # only full chunks are stored; the blocks past them are planned in memory
        assert chunk_files(ds) == [f"{c:06d}.pack" for c in range(blocks // CHUNK_BLOCKS)]
        assert ds.stats()["blocks"] == blocks
        seen.append(all_rows(ds))
    tc.build_cache(src, out, gpt2_tokenizer_path, block_tokens=BLOCK_TOKENS, progress=False)
    assert ds.refresh() > len(seen[-1]) and ds.cache.complete
    blocks = ds.cache.num_blocks
    assert chunk_files(ds) == [f"{c:06d}.pack" for c in range(-(-blocks // CHUNK_BLOCKS))]
    final = all_rows(ds)
    for before in seen:  # earlier rows never change: the plan only grew
        n = len(before["input_ids"])
        assert_same_rows({k: v[:n] for k, v in final.items()}, before)
    # the grown plan is the plan of the complete cache, computed at once
    fresh = tc.PackedDataset(out, SEQ, plan_dir=tmp_path / "fresh")
    assert_same_rows(all_rows(fresh), final)
    assert fresh.stats() == ds.stats()
    for name in chunk_files(ds):
        with open(os.path.join(ds.plan.dir, name), "rb") as a, open(os.path.join(fresh.plan.dir, name), "rb") as b:
            assert a.read() == b.read(), name
