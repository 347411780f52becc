"""Pack plans: which pieces of which documents make up each packed row, stored once, reused.

A plan is a pure function of (cache fingerprint, seq_len, long_docs, max_segments, seed) and the
packing algorithm, computed block by block (documents never move between blocks), so the plan of
a growing cache only ever extends. It is kept as a sidecar (byte layout in docs/format.md,
"Pack plans")::

    PLAN_ROOT/<plan id>/plan.json      # the identity, for people and `torchcache info`
    PLAN_ROOT/<plan id>/000000.pack    # chunk 0: the rows of blocks [0, chunk_blocks)
    PLAN_ROOT/<plan id>/000001.pack    # ...

``PLAN_ROOT`` is ``CACHE/packs`` for a local cache (or a directory the user gives, for a cache
they cannot write). A chunk file is written once its blocks are all committed (and it is full,
or the cache complete), whole or not at all; a process holding a plan keeps the chunk headers in
memory (O(blocks)) and maps the chunk files, so row lookup reads only the rows asked for.
Blocks of a growing cache past the last full chunk are planned in memory until their chunk fills.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .._util import hooks
from .._util.procs import Child, start_child
from ..format import blocks as fmt
from ..errors import CacheFormatError
from ..order.packing import PACKING_ALGORITHM, BlockPack, pack_block
from .cache import TokenCache
from ..format.storage import LocalStorage

__all__ = ["PLAN_FORMAT", "PackPlan", "PlanIdentity", "RowSegments", "default_plan_root",
           "list_plans", "plan_identity"]

PLAN_FORMAT = "torchcache-pack"
PLAN_VERSION = 1
CHUNK_MAGIC = b"TCPACK01"
_OWN_FILE = re.compile(r"plan\.json|\d{6}\.pack")  # the files a plan directory holds
HEADER = np.dtype([("magic", "S8"), ("first_block", "<u8"), ("blocks", "<u8"), ("rows", "<u8"),
                   ("segments", "<u8"), ("identity", "V16"), ("reserved", "<u8")])
# per block: rows, segments, padding tokens, and the long documents' counts; with
# long_docs="truncate" dropped_documents / dropped_tokens count the documents cut to seq_len and
# the tokens cut off them (nothing is dropped then)
BLOCK_RECORD = np.dtype([("rows", "<i8"), ("segments", "<i8"), ("padding", "<i8"),
                         ("dropped_documents", "<i8"), ("dropped_tokens", "<i8"),
                         ("split_documents", "<i8"), ("offsets_sha256", "V32")])
CHUNK_BLOCKS = 256  # blocks per chunk file of a new plan
TOKENS_PER_CHILD = 2 ** 26  # below this much work per process, starting one costs more than it saves
SEGMENT_BYTES = 8 + 4 + 1  # start (int64), length (int32), continues (uint8)
_COUNTS = ("padding", "dropped_documents", "dropped_tokens", "split_documents")


@dataclass(frozen=True)
class PlanIdentity:
    """Everything a plan is a function of."""

    cache_fingerprint: str
    seq_len: int
    long_docs: str
    max_segments: int | None
    seed: int
    algorithm: str = PACKING_ALGORITHM
    chunk_blocks: int = CHUNK_BLOCKS

    def as_json(self) -> dict[str, Any]:
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **asdict(self)}

    @property
    def digest(self) -> bytes:
        text = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).digest()[:16]

    @property
    def plan_id(self) -> str:
        return self.digest.hex()

    @property
    def segment_cap(self) -> int:
        return self.seq_len if self.max_segments is None else self.max_segments


def plan_identity(cache_fingerprint: str, seq_len: int, long_docs: str, max_segments: int | None,
                  seed: int) -> PlanIdentity:
    """The identity of a plan with the current algorithm and chunk size (tests may set a small
    chunk size through `hooks.pack_chunk_blocks` to exercise many chunks)."""
    chunk_blocks = hooks.pack_chunk_blocks or CHUNK_BLOCKS
    if max_segments is not None and max_segments >= seq_len:
        max_segments = None  # no cap: one plan, whichever way it is said
    return PlanIdentity(cache_fingerprint, seq_len, long_docs, max_segments, seed,
                        chunk_blocks=chunk_blocks)


def default_plan_root(cache: TokenCache) -> str:
    """``CACHE/packs`` for a local cache; beside the local copies for a remote one."""
    if cache.url == cache.root:
        return os.path.join(cache.root, "packs")
    return cache.root + ".packs"  # outside the copy folder, which stays under its cache_limit


def list_plans(plan_root: str) -> list[dict[str, Any]]:
    """The plans stored under ``plan_root``: each plan.json plus ``path`` and its chunk files."""
    found = []
    if not os.path.isdir(plan_root):
        return found
    for name in sorted(os.listdir(plan_root)):
        path = os.path.join(plan_root, name)
        try:
            with open(os.path.join(path, "plan.json"), "rb") as f:
                identity = json.loads(f.read(1 << 16))
        except (OSError, ValueError):
            continue
        if not isinstance(identity, dict) or identity.get("format") != PLAN_FORMAT:
            continue
        chunks = sorted(n for n in os.listdir(path) if n.endswith(".pack"))
        found.append({**identity, "path": path, "chunks": chunks})
    return found


@dataclass
class RowSegments:
    """The segments of some rows, flat: segment k belongs to output row ``row[k]``."""

    row: np.ndarray  # int64: which of the asked rows
    start: np.ndarray  # int64: global token position
    length: np.ndarray  # int64
    continues: np.ndarray  # bool: the document goes on after this piece (a full split piece)
    count: np.ndarray  # int64 per asked row: its number of segments


class _Chunk:
    """The plan of consecutive blocks: a block table and the rows' segments (mapped or in memory)."""

    def __init__(self, first_block: int, table: np.ndarray, row_ends: np.ndarray,
                 seg_start: np.ndarray, seg_len: np.ndarray, seg_flags: np.ndarray):
        self.first_block, self.table = first_block, table
        self.row_ends, self.seg_start, self.seg_len, self.seg_flags = row_ends, seg_start, seg_len, seg_flags
        self.row_base = np.concatenate([[0], np.cumsum(table["rows"])]).astype(np.int64)
        self._full_rows: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def full_rows(self, seq_len: int, block_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row of the chunk, made once: whether it holds one piece of exactly ``seq_len``
        tokens, where that piece starts in the global stream (``block_starts``: the cache's
        token start of each of this chunk's blocks) and whether its document goes on after it."""
        if self._full_rows is None:
            ends = self.row_ends.astype(np.int64)
            first = np.zeros(len(ends), dtype=np.int64)  # each row's first segment (a row has one)
            first[1:] = ends[:-1]
            full = (ends - first == 1) & (self.seg_len[first] == seq_len)
            start = self.seg_start[first].astype(np.int64)
            start += np.repeat(block_starts, self.table["rows"].astype(np.int64))
            continues = self.seg_flags[first].view(bool)
            self._full_rows = (full, start, continues)
        return self._full_rows

    @classmethod
    def from_packs(cls, first_block: int, packs: list[BlockPack], digests: np.ndarray) -> "_Chunk":
        table = np.zeros(len(packs), dtype=BLOCK_RECORD)
        table["rows"] = [p.rows for p in packs]
        table["segments"] = [len(p.seg_len) for p in packs]
        for field in _COUNTS:
            table[field] = [getattr(p, field) for p in packs]
        table["offsets_sha256"] = digests
        seg_base = np.concatenate([[0], np.cumsum(table["segments"])[:-1]]).astype(np.int64)
        row_ends = np.concatenate([p.row_ends + base for p, base in zip(packs, seg_base)]
                                  or [np.empty(0, np.int64)])
        cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype, copy=False)
               if parts else np.empty(0, dtype))
        return cls(first_block, table, row_ends.astype(np.int64),
                   cat([p.seg_start for p in packs], np.int64), cat([p.seg_len for p in packs], np.int32),
                   cat([p.seg_continues for p in packs], np.uint8))

    @property
    def blocks(self) -> int:
        return len(self.table)

    def file_bytes(self, identity: bytes) -> list[bytes]:
        header = np.zeros(1, dtype=HEADER)
        header["magic"], header["first_block"], header["blocks"] = CHUNK_MAGIC, self.first_block, self.blocks
        header["rows"], header["segments"] = len(self.row_ends), len(self.seg_len)
        header["identity"] = np.frombuffer(identity, dtype="V16")[0]
        return [header.tobytes(), self.table.tobytes(), self.row_ends.astype("<i8").tobytes(),
                self.seg_start.astype("<i8").tobytes(), self.seg_len.astype("<i4").tobytes(),
                self.seg_flags.astype("u1").tobytes()]

    @staticmethod
    def read_table(path: str, identity: bytes, first_block: int, blocks: int) -> np.ndarray:
        """A chunk file's block table (one read), its header, size and table checked."""
        fix = f"delete {path} and it is computed again"
        head_bytes = HEADER.itemsize + blocks * BLOCK_RECORD.itemsize
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                data = os.pread(fd, head_bytes, 0)
            finally:
                os.close(fd)
        except OSError as e:
            raise OSError(e.errno, f"{path}: {e.strerror}") from e
        if len(data) < HEADER.itemsize or data[:8] != CHUNK_MAGIC:
            raise CacheFormatError(f"{path}: not a torchcache pack plan chunk (bad header); {fix}")
        h = np.frombuffer(data, dtype=HEADER, count=1)[0]
        if h["identity"].tobytes() != identity or int(h["first_block"]) != first_block or int(h["blocks"]) != blocks:
            raise CacheFormatError(f"{path}: made for another plan or other blocks (first block "
                                   f"{int(h['first_block'])}, {int(h['blocks'])} blocks; expected "
                                   f"{first_block}, {blocks}); {fix}")
        rows, segments = int(h["rows"]), int(h["segments"])
        if size != head_bytes + rows * 8 + segments * SEGMENT_BYTES:
            raise CacheFormatError(f"{path}: {size} bytes, expected "
                                   f"{head_bytes + rows * 8 + segments * SEGMENT_BYTES} (truncated?); {fix}")
        table = np.frombuffer(data, dtype=BLOCK_RECORD, count=blocks, offset=HEADER.itemsize).copy()
        if int(table["rows"].sum()) != rows or int(table["segments"].sum()) != segments or (
                table["rows"] < 0).any() or (table["segments"] < table["rows"]).any():
            raise CacheFormatError(f"{path}: its block table disagrees with its header; {fix}")
        return table

    @classmethod
    def load(cls, path: str, identity: bytes, first_block: int, blocks: int) -> "_Chunk":
        """Map a chunk file, checking its header, block count and size (not yet its rows)."""
        table = cls.read_table(path, identity, first_block, blocks)
        rows, segments = int(table["rows"].sum()), int(table["segments"].sum())
        offset = HEADER.itemsize + blocks * BLOCK_RECORD.itemsize
        # one mapping; the arrays are plain ndarray views of it (indexing a memmap subclass
        # costs microseconds per call, a batch makes a dozen such calls)
        whole = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))

        def part(dtype: str, count: int, at: int) -> np.ndarray:
            return whole[at:at + count * np.dtype(dtype).itemsize].view(dtype)

        row_ends = part("<i8", rows, offset)
        seg_start = part("<i8", segments, offset + rows * 8)
        seg_len = part("<i4", segments, offset + rows * 8 + segments * 8)
        seg_flags = part("u1", segments, offset + rows * 8 + segments * 12)
        return cls(first_block, table, row_ends, seg_start, seg_len, seg_flags)

    def block_segments(self, local: int) -> tuple[int, int, int, int]:
        """(first row, end row, first segment, end segment) of block ``local`` in this chunk."""
        r0, r1 = int(self.row_base[local]), int(self.row_base[local + 1])
        s0 = int(self.row_ends[r0 - 1]) if r0 > 0 else 0
        s1 = int(self.row_ends[r1 - 1]) if r1 > 0 else 0
        return r0, r1, s0, s1


class PackPlan:
    """The pack plan of a cache for one identity: rows located in O(log blocks).

    Holds O(blocks) memory (chunk block tables, row counts); the segments stay in the mapped
    chunk files. Pickles without the mappings (a DataLoader worker maps the files again).
    """

    def __init__(self, cache: TokenCache, identity: PlanIdentity, plan_root: str | None = None, *,
                 workers: int = 1, progress: Callable[[int], Any] | None = None):
        self.cache, self.identity = cache, identity
        self.root = os.path.abspath(plan_root) if plan_root is not None else default_plan_root(cache)
        self.dir = os.path.join(self.root, identity.plan_id)
        self._workers = workers
        self._planners: _Planners | None = None  # child processes, only during extend()
        self._lock = threading.RLock()
        self._chunks: list[_Chunk | None] = []  # None: on disk, not mapped in this process yet
        self._tables: list[np.ndarray] = []  # every chunk's block table, also for unmapped ones
        self._tail: list[BlockPack] = []  # packs of blocks past the last stored chunk
        self._tail_chunk: _Chunk | None = None  # the same, as a chunk in memory
        self.row_starts = np.zeros(1, dtype=np.int64)  # cumulative rows per covered block
        self._checked = np.zeros(0, dtype=bool)  # blocks whose rows were checked in this process
        self.extend(progress)

    # ------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_chunks"] = [None] * len(self._chunks)  # stored chunks: mapped again in the worker
        state["_checked"] = np.zeros(len(self._checked), dtype=bool)
        state["_tail_chunk"] = None  # made again from _tail
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._index()

    # ------------------------------------------------------------ coverage
    @property
    def blocks(self) -> int:
        """Blocks of the cache this plan covers."""
        return len(self.row_starts) - 1

    @property
    def rows(self) -> int:
        return int(self.row_starts[-1])

    def totals(self) -> dict[str, Any]:
        """Rows, blocks, the counts of :class:`torchcache.order.packing.BlockPack` over the covered
        blocks (``truncated_documents`` and ``truncated_tokens`` for ``long_docs="truncate"``,
        whose plan stores them as its dropped counts), and ``padding_fraction``: padding /
        (rows * seq_len), exact (0.0 with no rows)."""
        tables = self._tables + ([self._tail_chunk.table] if self._tail_chunk is not None else [])
        out: dict[str, Any] = {"rows": self.rows, "blocks": self.blocks}
        for field in _COUNTS:
            out[field] = int(sum(int(t[field].sum()) for t in tables))
        out["padding_fraction"] = (out["padding"] / (self.rows * self.identity.seq_len)
                                   if self.rows else 0.0)
        # long_docs="truncate" keeps its counts in the dropped columns (see BLOCK_RECORD)
        cut = self.identity.long_docs == "truncate"
        out["truncated_documents"] = out["dropped_documents"] if cut else 0
        out["truncated_tokens"] = out["dropped_tokens"] if cut else 0
        if cut:
            out["dropped_documents"] = out["dropped_tokens"] = 0
        return out

    def extend(self, progress: Callable[[int], Any] | None = None) -> bool:
        """Cover the blocks the cache has committed since; True if rows were added."""
        with self._lock:
            before = self.rows
            B, K = self.cache.num_blocks, self.identity.chunk_blocks
            try:
                while len(self._chunks) * K < B:
                    c = len(self._chunks)
                    first, last = c * K, min(c * K + K, B)
                    if last - first < K and not self.cache.complete:
                        self._plan_tail(first, last, progress)
                        break
                    chunk, table = self._stored_chunk(c, first, last, progress)
                    self._chunks.append(chunk)
                    self._tables.append(table)
                    self._tail = []
            finally:
                if self._planners is not None:
                    self._planners.close()
                    self._planners = None
            self._index()
            return self.rows > before

    def _index(self) -> None:
        self._tail_chunk = (_Chunk.from_packs(len(self._chunks) * self.identity.chunk_blocks, self._tail,
                                              np.zeros(len(self._tail), "V32")) if self._tail else None)
        counts = [t["rows"] for t in self._tables] + [np.array([p.rows for p in self._tail], np.int64)]
        self.row_starts = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
        checked = np.zeros(self.blocks, dtype=bool)
        checked[:min(len(self._checked), self.blocks)] = self._checked[:self.blocks]
        self._checked = checked
        self._all_checked = bool(checked.all())  # then a batch skips the test
        self._one_chunk = len(self._chunks) + (self._tail_chunk is not None) <= 1  # rows all in chunk 0

    def _plan_tail(self, first: int, last: int, progress) -> None:
        have = first + len(self._tail)
        self._tail.extend(self._compute(range(have, last), progress))

    def _stored_chunk(self, c: int, first: int, last: int, progress) -> tuple[None, np.ndarray]:
        """Chunk c's block table, read from its file, or computed and written first; the rest
        of the chunk is mapped on first use."""
        path = os.path.join(self.dir, f"{c:06d}.pack")
        if os.path.exists(path):
            table = _Chunk.read_table(path, self.identity.digest, first, last - first)
            self._check_digests(table, first, path)
            if progress is not None:
                progress(last - first)
            return None, table
        have = self._tail  # the tail always starts at the first unstored chunk
        packs = have + self._compute(range(first + len(have), last), progress)
        chunk = _Chunk.from_packs(first, packs, self._digests(first, last))
        self._write(path, chunk)
        return None, chunk.table  # mapped from the file on first use: O(blocks) memory here

    def _digests(self, first: int, last: int) -> np.ndarray:
        records = self.cache.block_table.records
        return records["offsets_checksum"][first:last].copy().view("V32").reshape(-1)

    def _check_digests(self, table: np.ndarray, first: int, path: str) -> None:
        expected = self._digests(first, first + len(table))
        if table["offsets_sha256"].tobytes() != expected.tobytes():
            raise CacheFormatError(f"{path}: made for other blocks than the cache at "
                                   f"{self.cache.url} holds (rebuilt?); delete {self.dir} and the "
                                   "plan is computed again")

    def _write(self, path: str, chunk: _Chunk) -> None:
        storage = LocalStorage(self.dir)
        try:
            fmt.remove_dead_temp_files(storage, "", _OWN_FILE)  # of a killed `torchcache pack`
            if not os.path.exists(os.path.join(self.dir, "plan.json")):
                storage.write_json("plan.json", self.identity.as_json())
            storage.write(os.path.basename(path), chunk.file_bytes(self.identity.digest))
        except PermissionError as e:
            raise PermissionError(e.errno, f"cannot store the pack plan in {self.dir} ({e.strerror}): "
                                  "give a writable directory as plan_dir= (or `torchcache pack "
                                  "CACHE --plan-dir DIR`)", e.filename) from e

    def _compute(self, blocks: Iterable[int], progress) -> list[BlockPack]:
        blocks = list(blocks)
        ident = self.identity
        starts = self.cache.block_token_starts()
        tokens = sum(int(starts[b + 1] - starts[b]) for b in blocks)
        per_child = hooks.pack_tokens_per_child or TOKENS_PER_CHILD
        if (self._workers > 1 and len(blocks) >= 2 * self._workers
                and tokens >= per_child * self._workers and self.cache.url == self.cache.root):
            if self._planners is None:
                self._planners = _Planners(self.cache.root, ident, self._workers)
            return self._planners.compute(blocks, progress)
        packs = []
        for b in blocks:
            packs.append(pack_block(self.cache.block_offsets(b), ident.seq_len, long_docs=ident.long_docs,
                                    max_segments=ident.max_segments, seed=ident.seed, block=b))
            if progress is not None:
                progress(1)
        return packs

    # ------------------------------------------------------------ rows
    def _chunk(self, c: int) -> _Chunk:
        if c >= len(self._chunks):
            return self._tail_chunk  # the in-memory tail
        chunk = self._chunks[c]
        if chunk is None:
            K = self.identity.chunk_blocks
            first = c * K
            path = os.path.join(self.dir, f"{c:06d}.pack")
            chunk = _Chunk.load(path, self.identity.digest, first, len(self._tables[c]))
            self._check_digests(chunk.table, first, path)
            self._chunks[c] = chunk
        return chunk

    def block_of_rows(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.row_starts, rows, side="right") - 1

    def segments(self, rows: np.ndarray) -> RowSegments:
        """The segments of rows ``rows`` (checked positions), in row order then stream order.

        A batch's rows nearly always lie in one chunk (one for a cache of up to ``chunk_blocks``
        blocks): a few whole-batch numpy operations then. Rows in several chunks are read row
        by row, each a slice of its chunk's segments.
        """
        rows = np.asarray(rows, dtype=np.int64)
        with self._lock:
            blocks = self._blocks_of(rows)
            c = self._chunk_of_all(blocks) if len(rows) else None
            if c is not None:  # the usual batch: one chunk
                return self._one_chunk_segments(rows, blocks, c)
            return self._segments_by_row(rows, blocks, blocks // self.identity.chunk_blocks)

    def full_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """``(starts, continues)`` of rows ``rows`` (checked positions) if each holds one piece
        of exactly seq_len tokens (most rows of long documents): where the piece starts in the
        global stream, and whether its document goes on after it. None if any row holds
        something else, or the rows lie in several chunks (then see :meth:`segments`)."""
        rows = np.asarray(rows, dtype=np.int64)
        if not len(rows):
            return None
        with self._lock:
            if self._one_chunk and self._all_checked:  # no block to find or check
                c: int | None = 0
            else:
                c = self._chunk_of_all(self._blocks_of(rows))
                if c is None:
                    return None
            chunk = self._chunk(c)
            first_block = c * self.identity.chunk_blocks
            full, start, continues = chunk.full_rows(
                self.identity.seq_len,
                self.cache.block_token_starts()[first_block:first_block + chunk.blocks])
            local = rows - self.row_starts[first_block] if c else rows
            if not np.logical_and.reduce(full[local]):
                return None
            return start[local], continues[local]

    def _blocks_of(self, rows: np.ndarray) -> np.ndarray:
        """The block of each of ``rows`` (checked positions), those not checked in this process
        yet checked first (lock held)."""
        blocks = self.row_starts.searchsorted(rows, side="right")
        blocks -= 1
        if not self._all_checked and not np.logical_and.reduce(self._checked[blocks]):
            self._check_blocks(blocks)
        return blocks

    def _chunk_of_all(self, blocks: np.ndarray) -> int | None:
        """The chunk that all of (non-empty) ``blocks`` lie in, or None if they span several."""
        if self._one_chunk:
            return 0
        chunks = blocks // self.identity.chunk_blocks
        c = int(chunks[0])
        return c if np.logical_and.reduce(chunks == c) else None

    def _check_blocks(self, blocks: np.ndarray) -> None:
        """Check, in block order, the blocks of ``blocks`` not checked in this process yet."""
        K = self.identity.chunk_blocks
        for b in np.unique(blocks[~self._checked[blocks]]).tolist():
            chunk = self._chunk(b // K)
            self._check_block(chunk, b - chunk.first_block, b)
        self._all_checked = bool(self._checked.all())

    def _one_chunk_segments(self, rows: np.ndarray, blocks: np.ndarray, c: int) -> RowSegments:
        chunk = self._chunk(c)
        local = rows - self.row_starts[c * self.identity.chunk_blocks] if c else rows
        ends = chunk.row_ends
        hi = ends[local]
        lo = ends[local - 1]
        lo *= local != 0  # local 0 read row -1 (the chunk's last): its first segment is 0
        count = hi - lo
        row = np.arange(len(rows))
        block_starts = self.cache.block_token_starts()[blocks]
        if int(np.add.reduce(count)) == len(rows):  # one segment each (a row has at least one)
            seg = lo
        else:
            first = np.cumsum(count)
            first -= count
            row = row.repeat(count)
            seg = np.arange(len(row))
            seg += (lo - first)[row]
            block_starts = block_starts[row]
        start = chunk.seg_start[seg]
        start += block_starts
        return RowSegments(row=row, start=start, length=chunk.seg_len[seg].astype(np.int64),
                           continues=chunk.seg_flags[seg].view(bool), count=count)  # checked 0 or 1

    def _segments_by_row(self, rows: np.ndarray, blocks: np.ndarray, chunks: np.ndarray) -> RowSegments:
        K = self.identity.chunk_blocks
        token_starts = self.cache.block_token_starts()
        starts, lengths, flags, counts = [], [], [], []
        for r, b, c in zip(rows.tolist(), blocks.tolist(), chunks.tolist()):
            chunk = self._chunk(c)
            local = r - int(self.row_starts[c * K])
            lo = int(chunk.row_ends[local - 1]) if local else 0
            hi = int(chunk.row_ends[local])
            starts.append(chunk.seg_start[lo:hi] + token_starts[b])
            lengths.append(chunk.seg_len[lo:hi])
            flags.append(chunk.seg_flags[lo:hi])
            counts.append(hi - lo)
        count = np.array(counts, dtype=np.int64)
        if not counts:
            empty = np.empty(0, dtype=np.int64)
            return RowSegments(row=empty, start=empty, length=empty.copy(),
                               continues=np.empty(0, dtype=bool), count=count)
        return RowSegments(row=np.arange(len(counts)).repeat(count),
                           start=np.concatenate(starts).astype(np.int64, copy=False),
                           length=np.concatenate(lengths).astype(np.int64),
                           continues=np.concatenate(flags).astype(bool), count=count)

    def _check_block(self, chunk: _Chunk, local: int, b: int) -> None:
        """Check block b's rows once per process, against the block's document offsets: every
        piece inside one document, starting a multiple of seq_len into it, ending at its end
        unless marked as continued (then exactly seq_len long); no row over seq_len or
        max_segments; pieces disjoint and covering every kept document exactly; the counts true.
        """
        r0, r1, s0, s1 = chunk.block_segments(local)
        ends = np.asarray(chunk.row_ends[r0:r1]) - s0
        starts = np.asarray(chunk.seg_start[s0:s1])
        lengths = np.asarray(chunk.seg_len[s0:s1]).astype(np.int64)
        flags = np.asarray(chunk.seg_flags[s0:s1])
        record = chunk.table[local]
        C, cap = self.identity.seq_len, self.identity.segment_cap
        offsets = self.cache.block_offsets(b)
        doc_lengths = np.diff(offsets)
        long = doc_lengths > C
        if self.identity.long_docs == "drop":
            kept = int(doc_lengths[~long].sum())
            counts = (int(long.sum()), int(doc_lengths[long].sum()), 0)
        elif self.identity.long_docs == "truncate":  # the dropped columns count what was cut
            kept = int(np.minimum(doc_lengths, C).sum())
            counts = (int(long.sum()), int((doc_lengths[long] - C).sum()), 0)
        else:
            kept = int(offsets[-1])
            counts = (0, 0, int(long.sum()))
        per_row = np.diff(np.concatenate([[0], ends]))
        problem = None
        if len(ends) and (ends[-1] != s1 - s0 or (per_row < 1).any() or (per_row > cap).any()):
            problem = "rows with no piece, too many pieces, or a bad row table"
        elif len(ends) == 0 and s1 != s0:
            problem = "pieces outside any row"
        elif ((lengths < 1) | (lengths > C)).any() or (starts < 0).any() or (starts + lengths > offsets[-1]).any():
            problem = "a piece outside the block or longer than seq_len"
        elif counts != (int(record["dropped_documents"]), int(record["dropped_tokens"]),
                        int(record["split_documents"])):
            problem = "dropped or split counts that do not match the block"
        else:
            doc = np.searchsorted(offsets, starts, side="right") - 1
            doc_end = offsets[doc + 1]
            order = np.argsort(starts, kind="stable")
            s, n = starts[order], lengths[order]
            used = np.add.reduceat(lengths, np.concatenate([[0], ends[:-1]])) if len(ends) else lengths
            if ((starts - offsets[doc]) % C != 0).any() or (starts + lengths > doc_end).any():
                problem = "a piece that does not lie on its document's seq_len grid"
            elif (flags != (starts + lengths < doc_end)).any():
                problem = "a continuation flag that does not match the document"
            elif self.identity.long_docs == "drop" and long[doc].any():
                problem = "a piece of a document that should have been dropped"
            elif self.identity.long_docs == "truncate" and (starts != offsets[doc]).any():
                problem = "a piece that is not the start of its document (truncate keeps only that)"
            elif (s[1:] < s[:-1] + n[:-1]).any() or int(lengths.sum()) != kept:
                problem = "pieces that overlap or do not cover the documents"
            elif (used > C).any() or int(record["padding"]) != len(ends) * C - int(lengths.sum()):
                problem = "a row longer than seq_len, or padding that does not add up"
        if problem is not None:
            raise CacheFormatError(f"{os.path.join(self.dir, '%06d.pack' % (b // self.identity.chunk_blocks))}: "
                                   f"block {b}: {problem}; delete {self.dir} and the plan is "
                                   "computed again")
        self._checked[b] = True


# ---------------------------------------------------------------- planning in child processes

class _Planners:
    """Child processes that plan blocks of a local cache; started once per extend()."""

    def __init__(self, root: str, identity: PlanIdentity, workers: int):
        self.children: list[Child] = []
        try:
            for _ in range(workers):
                self.children.append(start_child("torchcache.read.pack_plan:_child_main", root,
                                                 identity.as_json()))
        except BaseException:
            self.close()
            raise

    def compute(self, blocks: list[int], progress) -> list[BlockPack]:
        share = -(-len(blocks) // len(self.children))
        parts = [blocks[i:i + share] for i in range(0, len(blocks), share)]
        for child, part in zip(self.children, parts):
            child.conn.send(part)
        results: dict[int, BlockPack] = {}
        for child, part in zip(self.children, parts):
            for _ in part:
                try:
                    message = child.conn.recv()
                except EOFError:
                    raise RuntimeError(f"a pack planning process exited with code "
                                       f"{child.join(5)} before planning its blocks") from None
                if isinstance(message, tuple) and message[0] == "error":
                    raise RuntimeError(f"planning failed in a child process: {message[1]}")
                b, pack = message
                results[b] = pack
                if progress is not None:
                    progress(1)
        return [results[b] for b in blocks]

    def close(self) -> None:
        for child in self.children:
            try:
                child.conn.send(None)
            except OSError:
                pass
            if child.join(5) is None:
                child.kill()
                child.join()
            child.close()
        self.children = []


def _child_main(conn, root: str, identity: dict[str, Any]) -> None:
    """Plan the block lists the parent sends until it sends None."""
    try:
        cache = TokenCache(root)
        while True:
            blocks = conn.recv()
            if blocks is None:
                return
            for b in blocks:
                pack = pack_block(cache.block_offsets(b), identity["seq_len"],
                                  long_docs=identity["long_docs"],
                                  max_segments=identity["max_segments"], seed=identity["seed"], block=b)
                conn.send((b, pack))
    except EOFError:  # the parent went away
        return
    except BaseException as e:  # reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise
