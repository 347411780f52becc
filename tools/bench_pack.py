"""Packing quality and speed: torchcache's best-fit decreasing against simple baselines.

    python tools/bench_pack.py [--seq-len 2048] [--block-tokens 16777216] [--limit-books N]
                               [--synthetic 10000000] [--skip-corpus] [--skip-synthetic]

1. Corpus: every paragraph (text split on blank lines, empty ones dropped) of every book of
   ../shared/data/corpus/gutenberg_en is a document of its GPT-2 token count + 1 (an EOS). The
   lengths are cached under the temp directory, keyed by the inputs and options. With
   ``long_docs="split"`` semantics (a document longer than seq_len is cut into seq_len pieces and
   the rest is packed like a document) it prints rows and padding (padding tokens over
   rows * seq_len) for:

   - best-fit decreasing (``torchcache.order.packing.pack_block``) on the blocks a cache would have
     (the builder's exact rule: a block is closed as soon as it holds >= block_tokens tokens, or
     before a document that would take it past block_tokens), once over the corpus as one
     stream and once per input file (as a cache built from the 10 shard files is cut), and on
     all documents as one block; the result is checked (each token in exactly one segment, no
     row over seq_len);
   - first-fit decreasing, first-fit in stream order (online) and next-fit (one open row,
     closed when the next piece does not fit), over all documents as one block;
   - concat-and-chunk: the stream cut every seq_len tokens (no padding but in the last row).

   For each it also gives the share of documents whose tokens land in more than one row
   ("docs cut"), the row boundaries inside documents per document ("cuts/doc") and the share of
   tokens in documents that are cut.
2. Speed: ``pack_block`` on ``--synthetic`` lognormal document lengths (mean about 330 tokens,
   1 .. 20000, seeded) as one block, as blocks of about block_tokens tokens, and as 1000 blocks
   of equal document counts.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchcache.order.packing import BlockPack, pack_block  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data")
PARAGRAPH = re.compile(r"\n\s*\n")
LENGTHS_VERSION = "paragraphs-v1"  # bump when the way lengths are made changes


# -- document lengths ----------------------------------------------------------------------------

def corpus_lengths(corpus: str, tokenizer: str, limit_books: int | None,
                   batch: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Token count + 1 of every paragraph, in corpus order, and the documents per input file.

    Cached in the temp directory, keyed by the files (name, size, mtime) and options.
    """
    files = sorted(glob.glob(os.path.join(corpus, "*.jsonl")))
    if not files:
        raise SystemExit(f"no *.jsonl under {corpus}")
    ident = {"version": LENGTHS_VERSION, "limit": limit_books,
             "files": [(os.path.realpath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files],
             "tokenizer": (os.path.realpath(tokenizer), os.path.getsize(tokenizer))}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"bench_pack_lengths_{key}.npz")
    if os.path.exists(path):
        with np.load(path) as z:
            print(f"document lengths from {path}")
            return z["lengths"], z["per_file"]

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(tokenizer)
    start = time.perf_counter()
    parts: list[np.ndarray] = []
    per_file: list[int] = []
    books = 0
    for name in files:
        paragraphs: list[str] = []
        with open(name, encoding="utf-8") as f:
            for line in f:
                if limit_books is not None and books >= limit_books:
                    break
                books += 1
                paragraphs.extend(p for p in PARAGRAPH.split(json.loads(line)["text"]) if p.strip())
        lengths = np.empty(len(paragraphs), dtype=np.int64)
        for i in range(0, len(paragraphs), batch):
            encoded = tok.encode_batch(paragraphs[i:i + batch], add_special_tokens=False)
            lengths[i:i + len(encoded)] = [len(e.ids) for e in encoded]
        if len(paragraphs):
            parts.append(lengths + 1)  # the EOS
            per_file.append(len(paragraphs))
        if limit_books is not None and books >= limit_books:
            break
    lengths, counts = np.concatenate(parts), np.array(per_file, dtype=np.int64)
    print(f"tokenized {books} books, {len(lengths):,} paragraphs in {time.perf_counter() - start:.1f} s "
          f"(cached in {path})")
    tmp = path + f".{os.getpid()}.tmp.npz"
    np.savez(tmp, lengths=lengths, per_file=counts)
    os.replace(tmp, path)
    return lengths, counts


def synthetic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """``n`` lognormal document lengths, mean about 330 tokens, clipped to 1 .. 20000."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(5.3, 1.0, n)), 1, 20000).astype(np.int64)


def offsets_of(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def block_bounds(offsets: np.ndarray, block_tokens: int) -> list[tuple[int, int]]:
    """Document ranges ``[i, k)`` of the blocks the builder would make of these documents.

    A block is closed as soon as it holds >= block_tokens tokens, or before a document that
    would take it past block_tokens (a block always holds at least one document).
    """
    n, bounds, i = len(offsets) - 1, [], 0
    while i < n:
        x = offsets[i] + block_tokens
        reach = int(np.searchsorted(offsets, x, "left"))  # first boundary at >= block_tokens
        over = int(np.searchsorted(offsets, x, "right")) - 1  # first document that goes past
        k = min(max(min(reach, over), i + 1), n)
        bounds.append((i, k))
        i = k
    return bounds


def file_block_bounds(offsets: np.ndarray, per_file: np.ndarray, block_tokens: int) -> list[tuple[int, int]]:
    """As :func:`block_bounds`, each input file on its own (blocks never span two files)."""
    bounds, first = [], 0
    for count in per_file.tolist():
        bounds += [(first + i, first + k) for i, k in block_bounds(offsets[first:first + count + 1],
                                                                  block_tokens)]
        first += count
    return bounds


def stream_pieces(lengths: np.ndarray, C: int) -> np.ndarray:
    """Every document as pieces in stream order: ``C``-token pieces, then the rest (if any)."""
    lengths = lengths[lengths > 0]
    count = -(-lengths // C)
    pieces = np.full(int(count.sum()), C, dtype=np.int64)
    pieces[np.cumsum(count) - 1] = lengths - C * (count - 1)
    return pieces


# -- packers -------------------------------------------------------------------------------------

def best_fit_blocks(offsets: np.ndarray, bounds: list[tuple[int, int]], C: int) -> tuple[int, list[BlockPack]]:
    """``pack_block`` on each block (offsets in stream coordinates); total rows and the packs."""
    packs = [pack_block(offsets[i:k + 1], C, long_docs="split", block=b) for b, (i, k) in enumerate(bounds)]
    return sum(p.rows for p in packs), packs


def check_packs(packs: list[BlockPack], total: int, C: int) -> None:
    """Every token in exactly one segment, no row over ``C``, padding as reported."""
    starts = np.concatenate([p.seg_start for p in packs])
    lens = np.concatenate([p.seg_len for p in packs]).astype(np.int64)
    order = np.argsort(starts, kind="stable")
    starts, lens = starts[order], lens[order]
    assert lens.sum() == total, (lens.sum(), total)
    assert (lens >= 1).all() and (lens <= C).all()
    assert starts[0] == 0 and (starts[1:] == starts[:-1] + lens[:-1]).all(), "gap or overlap"
    for p in packs:
        first = np.concatenate([[0], p.row_ends[:-1]])
        assert (p.row_ends > first).all(), "empty row"
        loads = np.add.reduceat(p.seg_len.astype(np.int64), first)
        assert (loads <= C).all(), "row over seq_len"
        assert p.padding == p.rows * C - loads.sum()


def next_fit(pieces: np.ndarray, C: int) -> int:
    """Rows of next-fit in the given order: one open row, closed when a piece does not fit."""
    rows, room = 0, 0
    for s in pieces.tolist():
        if s > room:
            rows += 1
            room = C
        room -= s
    return rows


def first_fit(pieces: np.ndarray, C: int) -> int:
    """Rows of first-fit in the given order: each piece into the leftmost row with room for it.

    A max segment tree over the rows' free room (unopened rows have room C) finds that row in
    O(log rows). At most one row is at most half full, so rows <= 2 * tokens / C + 1.
    """
    total = int(pieces.sum())
    cap = 2 * (-(-total // C)) + 2
    size = 1 << max(1, (cap - 1).bit_length())
    tree = [C] * (2 * size)
    used = 0
    for s in pieces.tolist():
        i = 1
        while i < size:
            i <<= 1
            if tree[i] < s:
                i += 1
        tree[i] -= s
        if i - size >= used:
            used = i - size + 1
        i >>= 1
        while i:
            a, b = tree[2 * i], tree[2 * i + 1]
            m = a if a > b else b
            if tree[i] == m:
                break
            tree[i] = m
            i >>= 1
    assert used * C - sum(tree[size:size + used]) == total
    return used


def cut_stats(lengths: np.ndarray, C: int, chunked: bool) -> tuple[float, float, float]:
    """(docs in more than one row, row boundaries inside documents per document, tokens in cut
    documents / tokens), for concat-and-chunk or for a packer with long_docs="split"."""
    offsets = offsets_of(lengths)
    if chunked:  # boundaries at multiples of C strictly inside [start, end)
        cuts = (offsets[1:] - 1) // C - offsets[:-1] // C
    else:
        cuts = -(-lengths // C) - 1
    cut = cuts > 0
    return float(cut.mean()), float(cuts.mean()), float(lengths[cut].sum() / lengths.sum())


# -- reports -------------------------------------------------------------------------------------

def corpus_report(args: argparse.Namespace) -> None:
    C = args.seq_len
    lengths, per_file = corpus_lengths(args.corpus, args.tokenizer, args.limit_books)
    offsets = offsets_of(lengths)
    total = int(offsets[-1])
    pieces = stream_pieces(lengths, C)
    print(f"{len(lengths):,} documents in {len(per_file)} files, {total:,} tokens (EOS included), "
          f"{len(pieces):,} pieces at seq_len {C}; document length mean {lengths.mean():.1f}, "
          f"median {np.median(lengths):.0f}, max {lengths.max():,}; "
          f"{(lengths > C).sum():,} documents longer than seq_len")

    results: list[tuple[str, str, int, float, tuple[float, float, float]]] = []
    split = cut_stats(lengths, C, chunked=False)

    def add(method: str, scope: str, rows: int, seconds: float, stats=split) -> None:
        results.append((method, scope, rows, seconds, stats))

    stream_blocks = block_bounds(offsets, args.block_tokens)
    file_blocks = file_block_bounds(offsets, per_file, args.block_tokens)
    for scope, bounds in ((f"{len(stream_blocks)} blocks (stream)", stream_blocks),
                          (f"{len(file_blocks)} blocks (per file)", file_blocks),
                          ("one block", [(0, len(lengths))])):
        start = time.perf_counter()
        rows, packs = best_fit_blocks(offsets, bounds, C)
        add("best-fit decreasing (pack_block)", scope, rows, time.perf_counter() - start)
        check_packs(packs, total, C)
        del packs
    for method, fn, order in (("first-fit decreasing", first_fit, np.sort(pieces)[::-1]),
                              ("first-fit (stream order)", first_fit, pieces),
                              ("next-fit (stream order)", next_fit, pieces)):
        start = time.perf_counter()
        add(method, "one block", fn(order, C), time.perf_counter() - start)
    add("concat-and-chunk", "stream", -(-total // C), 0.0, cut_stats(lengths, C, chunked=True))

    print(f"\nseq_len {C}, block_tokens {args.block_tokens:,}; padding = padding tokens / (rows * seq_len); "
          f"lower bound {-(-total // C):,} rows")
    print(f"{'method':<34} {'blocks':<22} {'rows':>9} {'padding':>9} {'docs cut':>9} {'cuts/doc':>9} "
          f"{'cut tok':>8} {'time':>8}")
    for method, scope, rows, seconds, (docs_cut, cuts_per_doc, cut_tokens) in results:
        padding = (rows * C - total) / (rows * C)
        print(f"{method:<34} {scope:<22} {rows:>9,} {padding * 100:>8.3f}% {docs_cut * 100:>8.3f}% "
              f"{cuts_per_doc:>9.5f} {cut_tokens * 100:>7.2f}% {seconds:>7.2f}s")
    print("docs cut: documents whose tokens land in more than one row; cuts/doc: row boundaries inside "
          "documents per document; cut tok: tokens in cut documents. Every token is in exactly one "
          "segment and no row is over seq_len in the best-fit results (checked).")


def synthetic_report(args: argparse.Namespace) -> None:
    C, n = args.seq_len, args.synthetic
    lengths = synthetic_lengths(n)
    offsets = offsets_of(lengths)
    total = int(offsets[-1])
    per = -(-n // 1000)
    layouts = (("one block", [(0, n)]),
               ("blocks of ~block_tokens", block_bounds(offsets, args.block_tokens)),
               ("1000 blocks", [(i, min(i + per, n)) for i in range(0, n, per)]))
    print(f"\npack_block on {n:,} synthetic documents (lognormal, mean {lengths.mean():.0f}, "
          f"max {lengths.max():,}), {total:,} tokens, seq_len {C}")
    print(f"{'layout':<24} {'blocks':>7} {'docs/block':>11} {'rows':>11} {'padding':>9} {'seconds':>8} "
          f"{'M docs/s':>9}")
    for name, bounds in layouts:
        start = time.perf_counter()
        rows = sum(pack_block(offsets[i:k + 1], C, block=b).rows for b, (i, k) in enumerate(bounds))
        seconds = time.perf_counter() - start
        padding = (rows * C - total) / (rows * C)
        print(f"{name:<24} {len(bounds):>7,} {n / len(bounds):>11,.0f} {rows:>11,} {padding * 100:>8.3f}% "
              f"{seconds:>8.2f} {n / seconds / 1e6:>9.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=os.path.join(SHARED, "corpus", "gutenberg_en"))
    p.add_argument("--tokenizer", default=os.path.join(SHARED, "tokenizers", "gpt2", "tokenizer.json"))
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--block-tokens", type=int, default=2 ** 24)
    p.add_argument("--limit-books", type=int, help="use only the first N books (default: all)")
    p.add_argument("--synthetic", type=int, default=10 ** 7, help="synthetic documents to time")
    p.add_argument("--skip-corpus", action="store_true")
    p.add_argument("--skip-synthetic", action="store_true")
    args = p.parse_args()
    start = time.perf_counter()
    if not args.skip_corpus:
        corpus_report(args)
    if not args.skip_synthetic:
        synthetic_report(args)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
