"""Best-fit-decreasing packing of one block's documents into rows of ``seq_len`` tokens.

Pure numpy and no I/O: the input is a block's document offsets, the output its rows. A plan is
a pure function of (offsets, seq_len, long_docs, max_segments, seed); :data:`PACKING_ALGORITHM`
names the algorithm, so a stored plan made by another version is never reused.

Best fit decreasing places each piece, longest first, into the open row with the least room
that still fits it (opening a new row when none does). It is run per group of equal-length
pieces: a row with room ``r`` takes ``r // s`` pieces of length ``s`` in a row (after each one
it is still the best fit), so a group costs a few numpy calls per distinct room instead of
Python work per document. Rows with equal room are taken in the order they reached that room.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .permutation import derive_key, mix64

__all__ = ["BlockPack", "PACKING_ALGORITHM", "LONG_DOCS", "pack_block"]

#: Stored with every plan; bump whenever any plan could change.
PACKING_ALGORITHM = "best-fit-decreasing-v1"
LONG_DOCS = ("split", "drop", "truncate")


@dataclass(frozen=True)
class BlockPack:
    """The rows of one block.

    Row ``r`` is segments ``row_ends[r - 1]:row_ends[r]`` (``row_ends[-1]`` read as 0), each a
    token range ``[seg_start, seg_start + seg_len)`` of the block, in stream order.
    """

    row_ends: np.ndarray  # int64[rows], cumulative segment counts
    seg_start: np.ndarray  # int64[segments], token offset in the block
    seg_len: np.ndarray  # int32[segments], 1 .. seq_len
    seg_continues: np.ndarray  # bool[segments]: the document goes on after this piece
    padding: int  # padding tokens over the rows
    # long_docs="drop": documents longer than seq_len, left out, and their tokens;
    # long_docs="truncate": documents longer than seq_len, cut to it, and the tokens cut off
    dropped_documents: int
    dropped_tokens: int
    split_documents: int  # long_docs="split": documents cut into pieces

    @property
    def rows(self) -> int:
        return len(self.row_ends)


def pack_block(offsets: np.ndarray, seq_len: int, *, long_docs: str = "split",
               max_segments: int | None = None, seed: int = 0, block: int = 0) -> BlockPack:
    """Pack the documents of one block (its cumulative ``offsets``, n_docs + 1) into rows.

    ``seed`` and ``block`` decide which of several equal-length pieces goes first (ties only).
    ``long_docs="truncate"`` keeps a long document's first ``seq_len`` tokens as one piece
    (marked as continued: its last label is the document's next token) and counts the cut in
    ``dropped_documents`` / ``dropped_tokens``.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    starts, lengths = offsets[:-1], np.diff(offsets)
    C = int(seq_len)
    limit = C if max_segments is None else int(max_segments)
    long = lengths > C
    dropped_documents = dropped_tokens = split_documents = 0
    if long_docs == "drop":
        dropped_documents, dropped_tokens = int(long.sum()), int(lengths[long].sum())
        keep = (lengths > 0) & ~long
        item_start, item_len = starts[keep], lengths[keep]
        item_continues = np.zeros(len(item_start), dtype=bool)
    elif long_docs == "split":
        split_documents = int(long.sum())
        item_start, item_len, item_continues = _split_pieces(starts[lengths > 0], lengths[lengths > 0], C)
    elif long_docs == "truncate":
        dropped_documents, dropped_tokens = int(long.sum()), int((lengths[long] - C).sum())
        keep = lengths > 0
        item_start, item_len, item_continues = starts[keep], np.minimum(lengths[keep], C), long[keep]
    else:
        raise ValueError(f"long_docs must be one of {LONG_DOCS}, got {long_docs!r}")

    # longest first; equal lengths in a seeded pseudo-random order (one uint64 sort key)
    length_bits = max(1, C.bit_length())
    ties = mix64(item_start.astype(np.uint64) ^ np.uint64(derive_key(seed, "pack-ties", block)))
    key = ((np.uint64(C) - item_len.astype(np.uint64)) << np.uint64(64 - length_bits)) | (
        ties >> np.uint64(length_bits))
    order = np.argsort(key, kind="stable")
    item_start, item_len, item_continues = item_start[order], item_len[order], item_continues[order]
    row_of = _best_fit_decreasing(item_len, C, limit)

    rows = int(row_of.max()) + 1 if row_of.size else 0
    span = int(item_start.max()) + 1 if item_start.size else 1
    if rows * span < 2 ** 62:  # each row's segments in stream order: one sort key
        in_rows = np.argsort(row_of * span + item_start)
    else:
        in_rows = np.lexsort((item_start, row_of))
    row_ends = np.cumsum(np.bincount(row_of, minlength=rows)).astype(np.int64)
    used = int(item_len.sum())
    return BlockPack(row_ends=row_ends, seg_start=item_start[in_rows].astype(np.int64),
                     seg_len=item_len[in_rows].astype(np.int32),
                     seg_continues=item_continues[in_rows],
                     padding=rows * C - used, dropped_documents=dropped_documents,
                     dropped_tokens=dropped_tokens, split_documents=split_documents)


def _split_pieces(starts: np.ndarray, lengths: np.ndarray,
                  C: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every document as pieces: ``length // C`` full pieces of C tokens, then the rest (if any);
    with, per piece, whether the document goes on after it."""
    long = lengths > C
    if not long.any():
        return starts, lengths, np.zeros(len(starts), dtype=bool)
    long_starts, long_lengths = starts[long], lengths[long]
    full = long_lengths // C
    rest = long_lengths - full * C
    owner = np.repeat(np.arange(len(full)), full)
    first_piece = np.cumsum(full) - full
    piece = np.arange(len(owner)) - first_piece[owner]
    piece_starts = long_starts[owner] + piece * C
    goes_on = (piece < full[owner] - 1) | (rest[owner] > 0)
    has_rest = rest > 0
    n_short, n_rest = int((~long).sum()), int(has_rest.sum())
    all_starts = np.concatenate([starts[~long], piece_starts, long_starts[has_rest] + full[has_rest] * C])
    all_lengths = np.concatenate([lengths[~long], np.full(len(owner), C, dtype=np.int64),
                                  rest[has_rest]])
    continues = np.concatenate([np.zeros(n_short, dtype=bool), goes_on, np.zeros(n_rest, dtype=bool)])
    return all_starts, all_lengths, continues


class _Rooms:
    """Open rows grouped by free room; rows with equal room in the order they got it."""

    def __init__(self, C: int):
        self.buckets: dict[int, list[np.ndarray]] = {}
        self.nonempty = np.zeros(C + 1, dtype=bool)

    def fitting(self, s: int) -> np.ndarray:
        """Rooms >= s that some open row has, ascending."""
        return np.flatnonzero(self.nonempty[s:]) + s

    def take(self, room: int) -> np.ndarray:
        chunks = self.buckets.pop(room)
        self.nonempty[room] = False
        return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)

    def put_back(self, room: int, ids: np.ndarray) -> None:
        """Rows taken from ``room`` but not used: back to the front of the line."""
        if ids.size:
            self.buckets.setdefault(room, []).insert(0, ids)
            self.nonempty[room] = True

    def add(self, ids: np.ndarray, rooms: np.ndarray) -> None:
        """Rows ``ids`` (in order) now have ``rooms`` free; rows with no room are closed."""
        if ids.size == 0:
            return
        first = rooms[0]
        if ids.size == 1:
            if first > 0:
                self.buckets.setdefault(int(first), []).append(ids)
                self.nonempty[first] = True
            return
        if (rooms == first).all():
            if first > 0:
                self.buckets.setdefault(int(first), []).append(ids)
                self.nonempty[first] = True
            return
        order = np.argsort(rooms, kind="stable")
        rooms, ids = rooms[order], ids[order]
        cuts = np.flatnonzero(np.diff(rooms)) + 1
        for part_ids, part_rooms in zip(np.split(ids, cuts), np.split(rooms, cuts)):
            room = int(part_rooms[0])
            if room > 0:
                self.buckets.setdefault(room, []).append(part_ids)
                self.nonempty[room] = True


def _best_fit_decreasing(lengths: np.ndarray, C: int, limit: int) -> np.ndarray:
    """Row of each piece; ``lengths`` sorted decreasing, each in [1, C]; <= ``limit`` per row."""
    n = len(lengths)
    row_of = np.empty(n, dtype=np.int64)
    room = np.empty(n, dtype=np.int64)  # per row
    count = np.zeros(n, dtype=np.int64)  # pieces per row
    rooms = _Rooms(C)
    rows = 0
    if n == 0:
        return row_of
    group_starts = np.concatenate([[0], np.flatnonzero(np.diff(lengths)) + 1, [n]]).tolist()
    for pos, end in zip(group_starts[:-1], group_starts[1:]):
        s = int(lengths[pos])
        for r in rooms.fitting(s).tolist():
            if pos == end:
                break
            ids = rooms.take(r)
            need = end - pos
            if limit >= C:  # no cap on pieces per row: every row takes r // s
                per = r // s
                if per * len(ids) > need:  # the group ends inside these rows
                    used = -(-need // per)
                    rooms.put_back(r, ids[used:])
                    ids = ids[:used]
                each = np.full(len(ids), per, dtype=np.int64)
                each[-1] -= per * len(ids) - min(need, per * len(ids))
            else:
                each = np.minimum(r // s, limit - count[ids])  # pieces each row takes in turn
                got = np.cumsum(each)
                if got[-1] > need:
                    last = int(np.searchsorted(got, need))
                    rooms.put_back(r, ids[last + 1:])
                    ids, each = ids[:last + 1], each[:last + 1].copy()
                    each[-1] -= got[last] - need
            taken = int(each.sum())
            row_of[pos:pos + taken] = ids[0] if len(ids) == 1 else np.repeat(ids, each)
            room[ids] -= each * s
            count[ids] += each
            pos += taken
            still_open = count[ids] < limit
            rooms.add(ids[still_open], room[ids][still_open])
        if pos < end:  # open new rows, each filled with as many pieces as fit
            per = min(C // s, limit)
            need = end - pos
            new = -(-need // per)
            ids = np.arange(rows, rows + new)
            each = np.full(new, per, dtype=np.int64)
            each[-1] = need - per * (new - 1)
            row_of[pos:end] = np.repeat(ids, each)
            room[ids] = C - each * s
            count[ids] = each
            rows += new
            rooms.add(ids[each < limit], room[ids][each < limit])
    return row_of
