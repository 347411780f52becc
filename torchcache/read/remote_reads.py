"""Reading a remote cache through a local copy of bounded size.

:class:`torchcache.TokenCache` uses this when it is given a ``cache_limit``. A read is served from
the local copy of its block when there is one (pread, as for a local cache); otherwise by a
ranged request for just its bytes, or by copying the whole block first when the block is worth
keeping. What is worth keeping comes from the *read plan*: the order in which this process will
read (a :class:`ReadOrder`; :class:`torchcache.DataLoader`, when it starts iterating, asks its
:class:`torchcache.TokenDataset` to plan its sampler's order, see
:meth:`torchcache.TokenDataset.plan_reads`), looked at ``lookahead`` reads ahead.

A call reads a batch of token ranges (:meth:`BoundedReader.read_ranges`, what every
:class:`torchcache.TokenCache` read comes down to) block by block: one decision per block (its
local copy, a copy made now, or ranged requests), and one ranged request per run of coalesced
ranges inside a block (below), the requests of a call made in parallel.

Coalescing (fewer, larger requests): ranges of one block that touch or overlap are one request;
so are ranges a small gap apart, by this rule: a gap is spanned when it is at most the size of
the range it adds and at most ``_MAX_GAP`` (64 KiB), and only while the gap bytes a process has
spanned stay within a quarter (``1/_WASTE_SHARE``) of the ranged bytes it asked for. The gap
bytes are downloaded for nothing: ``stats()["wasted_bytes"]`` (part of ``ranged_bytes``). It
applies to the ranges of one call and to the reads fetched ahead (below).

Policy (Belady with bypass, over the lookahead window):

- **Fill.** While the copies are below the limit, a block that is read is copied whole (a copy
  is downloaded once and then serves every later epoch).
- **Evict the block needed last.** When room is needed, the victims are the copies whose next
  planned read is furthest away (not in the window at all first, then by next use; ties: the
  oldest copy first; without a plan: least recently opened first). A copy open in any process
  of the machine is skipped (see :mod:`torchcache.read.local_copies`); a reader keeps at most a few
  copies open, and closes those its plan does not read again within the window.
- **Bypass unless it pays.** With the directory full, block ``b`` is copied only if the bytes
  its planned reads in the window will take exceed its size plus the planned reads lost with
  the victims, and only victims needed later than ``b`` are evicted; otherwise its reads are
  ranged reads. A sequential or windowed order copies each block once; a full shuffle (each
  block read ~uniformly over the epoch) keeps a stable set of copies and reads the rest by range,
  which is the fewest bytes for that order: about the cache's size per epoch.
- Without a plan: fill, then copy a block (evicting the least recently opened copies) only
  after this process has read half its size by range within the last ``lookahead`` reads.

Where a process is in its plan: each read is looked up in the plan's window (the first match
after the process's last read: its reads only move forward), so a DataLoader worker, whose copy
of the sampler stays where it was when the worker started, finds its place by itself; a
sampler moved in the main process (a new ``iter()``, a resume) re-anchors the plan there.

Read-ahead: after each read the reader looks at its own next planned reads (in a DataLoader
worker, the batches torch will send to that worker: every ``num_workers``-th batch, up to the
end of the loader epoch, where non-persistent workers exit; the order says how many workers take
turns, :attr:`ReadOrder.workers`) and starts, on a pool of ``fetch_threads`` threads, the block
copies the policy admits and ranged reads for the rest, so remote requests overlap training.
How far ahead is measured, not a constant (:func:`fetch_depth`): the reads this process makes
while one request is answered (seconds per request, which include the transfer, over seconds
per read), twice over, plus a batch; deeper while reads fetched ahead still come in late. Each
ranged read started ahead takes with it, in one request, the reads of its block among the next
``readahead`` (at most ``_AHEAD_BYTES`` of them, held in memory until read) that coalescing
allows. The processes of a machine share the copies and their budget (the directory's limit and
lock): a block is downloaded whole by one process while the others wait for its copy, and a
copy is evicted only for a block needed sooner (Belady), never while a process has it open.

Trust: whole-block copies are verified by checksum, named by it, and checked again when reused
(:mod:`torchcache.read.local_copies`). A ranged read cannot be checked by itself (the index has one
checksum per file), so it is pinned instead: the first time the machine sees a version (ETag) of
a block's object, that version is downloaded whole once and checked against the committed
checksum (:func:`~torchcache.read.local_copies.pin_verified`); every ranged read of the block then
asks for exactly that version (S3: If-Match), so a block changed on the store after commit is
a CacheFormatError naming its URL, never other bytes.
:meth:`BoundedReader.stats` reports bytes downloaded, whole-block copies, ranged reads, hits
(reads served by local copies), misses, and evictions, summed over the DataLoader workers of
the session.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import CacheFormatError
from ..format import blocks as fmt
from ..format.storage import ObjectChangedError, PinnedObject
from .cache_files import CacheFiles, check_block_file
from .local_copies import (BUSY, EXISTS, REFUSED, LocalCopies, Resident, SessionStats, copy_name,
                           fetch_verified, pin_verified, read_pinned, unpin)

__all__ = ["ArrayReads", "BoundedReader", "ReadOrder", "SamplerReads", "block_pieces", "fetch_depth"]

_MAX_OPEN_COPIES = 4  # block copies a reader keeps open (and so protected from eviction)
_MAX_PINS = 1024  # remote block objects a reader keeps pinned (one metadata request each)
_SNAPSHOT_EVERY = 32  # reads the cursor moves (at least) before the next-use table is recomputed
_NEVER = np.iinfo(np.int64).max
_MAX_GAP = 64 << 10  # the most unasked bytes one coalesced request may span between two reads
_WASTE_SHARE = 4  # a process's coalesced gap bytes stay <= 1/4 of the ranged bytes it asks for
_AHEAD_BYTES = 64 << 20  # the most bytes of planned reads a process holds fetched ahead


# ---------------------------------------------------------------- read orders

class ReadOrder:
    """The token ranges one process will read, in order: read ``k`` is tokens
    ``[s, s + length)`` with ``s = starts(k, k + 1)[0]``.

    Give one to :meth:`torchcache.TokenCache.plan_reads` to tell a remote cache with a
    ``cache_limit`` what comes next (it fetches ahead and keeps the blocks needed soonest).
    :meth:`torchcache.TokenDataset.plan_reads` gives a sampler's order (a
    :class:`SamplerReads`); write one for a custom sampler. An order is pickled into DataLoader
    workers with the cache, so keep it small; each worker finds where it is in the order from
    the reads it makes. ``workers``: the DataLoader worker processes that take turns reading
    it, a batch each (0: one process reads every batch), so that each fetches only its own
    batches ahead.

    >>> class EveryTenth(ReadOrder):  # windows 0, 10, 20, ... of 2048 + 1 tokens
    ...     length = 2049
    ...     def starts(self, k0, k1):
    ...         return np.arange(k0, k1, dtype=np.int64) * 10 * 2048
    >>> EveryTenth().starts(0, 3)
    array([    0, 20480, 40960])
    >>> cache.plan_reads(EveryTenth())  # doctest: +SKIP
    """

    length: int = 0
    workers: int = 0

    def starts(self, k0: int, k1: int) -> np.ndarray:
        """Token starts (int64) of reads ``k0 .. k1 - 1``; fewer where the order ends."""
        raise NotImplementedError

    def anchor(self) -> tuple[int, Any]:
        """(number of the next read, version). The cache looks reads up from there, and again
        from the new anchor whenever the version changes (the reader was moved: resume)."""
        return 0, None

    def pass_end(self, k: int) -> int | None:
        """The read number where the pass holding read ``k`` ends (a loader epoch: DataLoader
        workers, which exit there, fetch nothing past it), or None."""
        return None


class ArrayReads(ReadOrder):
    """A finite plan: reads of ``length`` tokens at the given token ``starts``, in order.

    >>> ArrayReads([0, 4096, 8192], 2049).starts(1, 5)
    array([4096, 8192])
    """

    def __init__(self, starts: Any, length: int):
        self._starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        self.length = int(length)

    def starts(self, k0: int, k1: int) -> np.ndarray:
        return self._starts[k0:k1]


class SamplerReads(ReadOrder):
    """The windows a :class:`torchcache.DistributedSampler`'s rank reads from a
    :class:`torchcache.TokenDataset` of ``seq_len``: read ``k`` is global stream position
    ``first + k * world_size``, the sampler's own index for it, times ``seq_len``; ``workers``
    DataLoader worker processes take turns reading it (see :class:`ReadOrder`).

    It asks the sampler only for pure functions of positions (``indices_for_positions``), so
    the copy in a DataLoader worker computes the same order without talking to the main process.
    Two orders of the same sampler object, window length and workers are equal.

    >>> import torchcache as tc
    >>> sampler = tc.DistributedSampler(range(100), 2, 1, seed=0)  # rank 1 of 2
    >>> order = SamplerReads(sampler, seq_len=2048)
    >>> bool((order.starts(0, 4) == sampler.indices_for_positions(np.arange(1, 9, 2)) * 2048).all())
    True
    >>> order == SamplerReads(sampler, 2048), order == SamplerReads(sampler, 2048, workers=2)
    (True, False)
    """

    def __init__(self, sampler: Any, seq_len: int, workers: int = 0):
        self.sampler, self.seq_len, self.length = sampler, int(seq_len), int(seq_len) + 1
        self.workers = int(workers)
        self._first = sampler.rank

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, SamplerReads) and other.sampler is self.sampler
                and (other.seq_len, other.workers) == (self.seq_len, self.workers))

    def __hash__(self) -> int:
        return hash((id(self.sampler), self.seq_len, self.workers))

    def anchor(self) -> tuple[int, Any]:
        sampler = self.sampler
        position = sampler.position + sampler.rank
        self._first = position % sampler.world_size
        return position // sampler.world_size, (sampler.position_version, self._first)

    def pass_end(self, k: int) -> int | None:
        sampler = self.sampler
        size = sampler.epoch_size
        if sampler.infinite or size is None:
            return None
        W = sampler.world_size
        end = ((self._first + W * k) // size + 1) * size  # the end of that loader epoch
        return -(-(end - self._first) // W)

    def starts(self, k0: int, k1: int) -> np.ndarray:
        sampler = self.sampler
        positions = self._first + sampler.world_size * np.arange(k0, k1, dtype=np.int64)
        stop = sampler.stop_position
        if stop is not None:
            positions = positions[positions < stop]
        try:
            return sampler.indices_for_positions(positions) * self.seq_len
        except ValueError:  # beyond the committed windows of a growing cache: the plan ends here
            return np.empty(0, dtype=np.int64)


class _Plan:
    """A window of a ReadOrder around this process's position in it: the reads' token starts,
    a lookup from a read back to its number, and each block's next use and count of uses."""

    def __init__(self, order: ReadOrder, lookahead: int):
        self.order, self.length, self.lookahead = order, int(order.length), lookahead
        # after (re)anchoring, reads this far before the anchor are still recognised (a main
        # process's sampler runs a few batches ahead of the reads)
        self.back = max(64, min(1024, lookahead // 8))
        self.version: Any = None
        self.cursor = -1  # the furthest read made so far
        self.lower = 0  # the first read number a lookup accepts
        self.lo = self.hi = 0
        self.starts = np.empty(0, dtype=np.int64)
        self._sorted = self._sorted_k = self.starts
        self._ended = False
        self._snap: tuple | None = None

    def anchor(self, token_starts: np.ndarray) -> None:
        k, self.version = self.order.anchor()
        self.cursor = int(k) - 1
        self.lower = max(0, int(k) - self.back)
        self._ended = False
        self._fill(token_starts)

    def _fill(self, token_starts: np.ndarray) -> None:
        lo = max(0, min(self.lower, self.cursor + 1 - self.back))
        want = self.cursor + 1 + self.lookahead + self.lookahead // 2 - lo
        starts = np.asarray(self.order.starts(lo, lo + want), dtype=np.int64).reshape(-1)
        valid = (starts >= 0) & (starts + self.length <= int(token_starts[-1]))
        if not valid.all():  # the order leaves the committed stream: the plan ends there
            starts = starts[:int(np.argmin(valid))]
        self._ended = len(starts) < want
        self.lo, self.hi, self.starts = lo, lo + len(starts), starts
        order = np.argsort(starts, kind="stable")
        self._sorted, self._sorted_k = starts[order], lo + order
        self._snap = None

    def start(self, k: int) -> int:
        return int(self.starts[k - self.lo])

    def locate(self, starts: np.ndarray) -> np.ndarray:
        """The read number of each of ``starts``: the first one after the last read this process
        made (a process's reads only move forward; a window longer than an epoch holds each
        sample several times), or -1 where it is not in the window."""
        found = np.full(len(starts), -1, dtype=np.int64)
        n = len(self._sorted)
        if n == 0:
            return found
        lower = self.lower
        pos = np.searchsorted(self._sorted, starts, side="left")
        todo = np.ones(len(starts), dtype=bool)
        for _ in range(8):  # one sample may appear in two epochs of a long window
            inside = todo & (pos < n)
            at = np.minimum(pos, n - 1)
            match = inside & (self._sorted[at] == starts)
            k = self._sorted_k[at]
            good = match & (k >= lower)
            found[good] = k[good]
            todo = match & ~good
            if not todo.any():
                break
            pos = pos + 1
        return found

    def advance(self, k: int, token_starts: np.ndarray) -> None:
        if k > self.cursor:
            self.cursor = k
        self.lower = self.cursor + 1
        if not self._ended and self.hi - self.cursor <= self.lookahead:
            self._fill(token_starts)

    def snapshot(self, token_starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(blocks, first use, uses) over the next ``lookahead`` reads, blocks sorted; an
        immutable value other threads may read."""
        snap = self._snap
        every = max(_SNAPSHOT_EVERY, self.lookahead // 64)
        if snap is not None and self.cursor - snap[3] < every and snap[4] == len(token_starts):
            return snap[:3]
        a = max(0, self.cursor + 1 - self.lo)
        starts = self.starts[a:a + self.lookahead]
        ks = np.arange(self.lo + a, self.lo + a + len(starts), dtype=np.int64)
        b0 = np.searchsorted(token_starts, starts, side="right") - 1
        b1 = np.searchsorted(token_starts, starts + (self.length - 1), side="right") - 1
        two = b1 != b0
        blocks = np.concatenate([b0, b1[two]])
        reads = np.concatenate([ks, ks[two]])
        order = np.lexsort((reads, blocks))
        blocks, first_at, counts = np.unique(blocks[order], return_index=True, return_counts=True)
        first = reads[order][first_at]
        self._snap = (blocks, first, counts, self.cursor, len(token_starts))
        return blocks, first, counts


def _lookup(snapshot: tuple[np.ndarray, np.ndarray, np.ndarray], blocks: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(next use, uses) of each of ``blocks`` in a snapshot (never / 0 where absent)."""
    known, first, counts = snapshot
    blocks = np.asarray(blocks, dtype=np.int64)
    if not len(known):
        return np.full(len(blocks), _NEVER, dtype=np.int64), np.zeros(len(blocks), dtype=np.int64)
    pos = np.minimum(np.searchsorted(known, blocks), len(known) - 1)
    hit = known[pos] == blocks
    return np.where(hit, first[pos], _NEVER), np.where(hit, counts[pos], 0)


def block_pieces(token_starts: np.ndarray, starts: np.ndarray, lengths: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where token ranges lie in the blocks: (range, block, first, end) of each non-empty piece,
    range by range in order, ``[first, end)`` counted inside the block (int64 arrays).

    >>> block_pieces(np.array([0, 10, 20, 30]), np.array([5, 12, 0]), np.array([10, 3, 0]))
    (array([0, 0, 1]), array([0, 1, 1]), array([5, 0, 2]), array([10,  5,  5]))
    """
    keep = np.flatnonzero(lengths > 0)
    s, n = starts[keep], lengths[keep]
    first_block = np.searchsorted(token_starts, s, side="right") - 1
    last_block = np.searchsorted(token_starts, s + n - 1, side="right") - 1
    count = last_block - first_block + 1
    ranges = np.repeat(keep, count)
    block = np.repeat(first_block, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
    base = token_starts[block]
    lo = np.maximum(starts[ranges], base)
    hi = np.minimum(starts[ranges] + lengths[ranges], token_starts[block + 1])
    full = hi > lo  # (a range crossing an empty block has an empty piece there)
    return ranges[full], block[full], (lo - base)[full], (hi - base)[full]


# ---------------------------------------------------------------- the reader

_READERS: "weakref.WeakSet[BoundedReader]" = weakref.WeakSet()


class BoundedReader:
    """Reads of one remote cache (in one process) under a ``limit`` on its local copies.

    Made by :class:`torchcache.TokenCache` for a remote cache with ``cache_limit``; the cache
    calls :meth:`read_ranges` with its current block table.
    """

    def __init__(self, files: CacheFiles, limit: int, itemsize: int, *, fetch_threads: int,
                 readahead: int, lookahead: int, stats: SessionStats):
        self.url, self.remote, self.root = files.url, files.remote, files.root
        self.limit, self.itemsize, self.fetch_threads = limit, itemsize, fetch_threads
        self.readahead, self.lookahead = readahead, lookahead
        self.stats_counter = stats
        self.order: ReadOrder | None = None
        self.copies = LocalCopies(self.root, limit)
        self._init_process_state()
        _READERS.add(self)

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "remote": self.remote, "root": self.root, "limit": self.limit,
                "itemsize": self.itemsize, "fetch_threads": self.fetch_threads, "readahead": self.readahead,
                "lookahead": self.lookahead, "stats_counter": self.stats_counter,
                "order": self.order}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.copies = LocalCopies(self.root, self.limit)
        self._init_process_state()
        _READERS.add(self)

    def _init_process_state(self) -> None:
        """What never crosses a process boundary: threads, descriptors, buffers, the plan."""
        self._mu = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._fds: OrderedDict[int, tuple[int, int, str]] = OrderedDict()  # block -> (fd, data start, path)
        # token start -> (read, future, length, byte offset of the read in the future's bytes)
        self._rows: dict[int, tuple[int, Future, int, int]] = {}
        self._blocks: dict[int, Future] = {}  # block copies in flight
        self._plan: _Plan | None = None
        self._batch: tuple[int, int] | None = None  # (first read, reads) of the last call
        self._pumped = -1
        self._reads = 0
        self._refused: dict[int, int] = {}  # block -> read count until which it is not retried
        self._recent: dict[int, list[int]] = {}  # block -> [ranged bytes, read count], for LRU mode
        self._free: int | None = None  # room left at the last reservation (a hint)
        self._keys: tuple[int, np.ndarray, np.ndarray] | None = None
        self._pins: OrderedDict[tuple[str, str], PinnedObject] = OrderedDict()
        self._pinning: dict[tuple[str, str], threading.Lock] = {}  # one pin per block at a time
        self._copy_paths: dict[tuple[str, str], str] = {}  # (file, checksum) -> its copy's path
        # read-ahead depth (see fetch_depth): recent seconds per remote request and per read made
        self._service_s = self._per_read_s = 0.0
        self._last_call: float | None = None
        self._boost = 1.0  # grows when a read fetched ahead was not there in time
        self._useful = self._wasted = 0  # ranged bytes asked for, and gap bytes coalesced

    def _after_fork(self) -> None:
        for fd, _, _ in self._fds.values():  # the child's duplicates; the parent keeps its locks
            os.close(fd)
        self._init_process_state()

    def close(self) -> None:
        """Stop fetching ahead (waiting for the requests under way, so no download is left
        half done) and close the open copies, releasing their locks."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._rows.clear()
        self._blocks.clear()
        fds, self._fds = self._fds, OrderedDict()
        for fd, _, _ in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        for fd, _, _ in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.fetch_threads, thread_name_prefix="torchcache-fetch")
        return self._pool

    # ------------------------------------------------------------ plan
    def set_order(self, order: ReadOrder | None) -> None:
        """Plan by ``order`` from now on (None: no plan); the order already planned changes
        nothing (a loader plans at every ``iter()``)."""
        if order is not None and order == self.order:
            return
        self.order = order
        self._plan, self._batch, self._pumped = None, None, -1
        self._rows.clear()

    def _track(self, token_starts: np.ndarray, starts: np.ndarray, lengths: np.ndarray
               ) -> tuple | None:
        """Find this call's planned reads (ranges of the plan's length) in the plan, move the
        cursor; the next-use snapshot."""
        if self.order is None:
            return None
        plan = self._plan
        if plan is None:
            plan = self._plan = _Plan(self.order, self.lookahead)
            plan.anchor(token_starts)
            self._rows.clear()
            self._pumped = -1
        planned = starts[lengths == plan.length]
        if not planned.size:
            return plan.snapshot(token_starts)
        if self.order.anchor()[1] != plan.version:
            plan.anchor(token_starts)  # the reader was moved (a new iter(), resume): look from there
            self._pumped = -1  # (rows fetched ahead stay: they hold the right bytes whatever comes)
        ks = plan.locate(planned)
        found = ks[ks >= 0]
        if found.size:
            plan.advance(int(found.max()), token_starts)
            self._batch = (int(found.min()), len(planned))
        else:
            self._batch = None
        return plan.snapshot(token_starts)

    # ------------------------------------------------------------ reading
    def read_ranges(self, table: Any, dtype: np.dtype, starts: np.ndarray, lengths: np.ndarray,
                    out: np.ndarray, at: np.ndarray) -> None:
        """Ranges ``k`` (tokens ``[starts[k], starts[k] + lengths[k])``, checked by the caller)
        into ``out`` (flat, the cache's dtype) at token offsets ``at[k]``: ranges fetched ahead
        are waited for, the rest is read block by block, each block once (its local copy, a
        copy made now if the policy admits it, or ranged requests, in parallel)."""
        token_starts, item = table.token_starts, dtype.itemsize
        flat = memoryview(out.reshape(-1).view(np.uint8))
        self._reads += len(starts)
        snapshot = self._track(token_starts, starts, lengths)
        self._note_pace(len(starts))
        waiting = []
        if self._rows:  # ranges fetched ahead: whole reads of the plan
            lengths = lengths.copy()
            late = False
            for k, (start, n, a) in enumerate(zip(starts.tolist(), lengths.tolist(), at.tolist())):
                ahead = self._rows.pop(start, None)
                if ahead is not None and ahead[2] == n:
                    waiting.append((flat[a * item:(a + n) * item], ahead[1], ahead[3]))
                    late |= not ahead[1].done()
                    lengths[k] = 0  # read: no pieces left
            if waiting:  # fetch further ahead while reads fetched ahead come in late
                self._boost = min(8.0, self._boost * 1.5) if late else max(1.0, self._boost * 0.97)
        ranges, blocks, lo, hi = block_pieces(token_starts, starts, lengths)
        dest = (at[ranges] + token_starts[blocks] + lo - starts[ranges]) * item
        missed = np.zeros(len(starts), dtype=bool)  # ranges that needed remote bytes
        jobs = []
        order = np.lexsort((lo, blocks))
        edges = np.flatnonzero(np.diff(blocks[order])) + 1
        copying = []  # (block, its pieces, the copy of it under way): read once it is there
        for group in np.split(order, edges) if len(order) else []:
            b = int(blocks[group[0]])
            entry = self._copy(table, dtype, b)
            if entry is None:
                missed[ranges[group]] = True
                copy = self._start_copy(table, b, snapshot)
                if copy is not None:  # the copies of a call's blocks download side by side
                    copying.append((b, group, copy))
                    continue
            if entry is not None:
                self._pread_pieces(entry, lo[group], hi[group], dest[group], flat, item)
                continue
            jobs.extend(self._ranged_jobs(table, item, b, lo[group], hi[group], dest[group], flat))
        futures = []
        if len(jobs) == 1 and self._batch is None and not copying:  # one request: made here
            (key, a, z), targets = jobs[0]
            _scatter(self._fetch_parts([(key, a, z)]), targets)
        elif jobs:
            pool = self._executor()
            futures = [(pool.submit(self._fetch_parts, [where]), targets) for where, targets in jobs]
        if snapshot is not None and self._fds:
            self._release_unneeded(snapshot)
        self._pump(table, dtype, snapshot)  # (while this call's own requests are answered)
        late = []  # the pieces of blocks whose copy was refused: by range after all
        for b, group, copy in copying:
            entry = self._copy(table, dtype, b) if copy.result() else None
            if entry is not None:
                self._pread_pieces(entry, lo[group], hi[group], dest[group], flat, item)
            else:
                late.extend(self._ranged_jobs(table, item, b, lo[group], hi[group], dest[group], flat))
        if late:
            pool = self._executor()
            futures.extend((pool.submit(self._fetch_parts, [where]), targets) for where, targets in late)
        for future, targets in futures:
            _scatter(future.result(), targets)
        for target, future, offset in waiting:
            target[:] = memoryview(future.result())[offset:offset + len(target)]
        read = lengths > 0
        self.stats_counter.add_many({"hits": int((read & ~missed).sum()),
                                     "misses": int(missed.sum()) + len(waiting),
                                     "prefetched": len(waiting)})
        self.stats_counter.flush()

    def _ranged_jobs(self, table: Any, item: int, b: int, lo: np.ndarray, hi: np.ndarray,
                     dest: np.ndarray, flat: memoryview) -> list[tuple[tuple, list]]:
        """The ranged requests for pieces ``[lo, hi)`` of block b (sorted by ``lo``): one per
        run of pieces that touch, overlap, or are a small gap apart (:meth:`_coalesce`), each
        with where its bytes go (``(destination, offset in the request's bytes)``)."""
        jobs: list[tuple[tuple, list]] = []
        run_lo = run_hi = -1
        targets: list[tuple[memoryview, int]] = []
        for first, end, to in zip(lo.tolist(), hi.tolist(), dest.tolist()):
            piece = (end - first) * item
            if first > run_hi and not (targets and self._coalesce((first - run_hi) * item, piece)):
                if targets:  # a gap too large to span: the run so far is one request
                    jobs.append((self._byte_range(table, item, b, run_lo, run_hi), targets))
                run_lo, run_hi, targets = first, end, []
                self._useful += piece
            elif first <= run_hi:
                self._useful += piece
            run_hi = max(run_hi, end)
            targets.append((flat[to:to + (end - first) * item], (first - run_lo) * item))
            self._note_ranged(b, (end - first) * item)
        jobs.append((self._byte_range(table, item, b, run_lo, run_hi), targets))
        return jobs

    def _copy(self, table: Any, dtype: np.dtype, b: int) -> tuple[int, int, str] | None:
        """(fd, data start, path) of the local copy of block b, opened and locked shared, or None."""
        entry = self._fds.get(b)
        if entry is not None:
            self._fds.move_to_end(b)
            return entry
        checksum = table.checksum(b)
        found = self.copies.open_copy(copy_name(table.path(b), checksum), checksum,
                                      touch=self.order is None)
        if found is None:
            return None
        path, fd = found
        try:
            tokens = int(table.token_starts[b + 1] - table.token_starts[b])
            start = check_block_file(fd, path, dtype, tokens, table.size(b))
        except BaseException:
            os.close(fd)
            raise
        self._fds[b] = entry = (fd, start, path)
        while len(self._fds) > _MAX_OPEN_COPIES:
            _, (old, _, _) = self._fds.popitem(last=False)
            os.close(old)  # releases its shared lock: it may be evicted now
        return entry

    def open_sidecar(self, table: Any, rel: str, checksum: str) -> tuple[str, int] | bytes:
        """A block's sidecar read whole and kept mapped (an arrays sidecar, often larger than
        its block): its local copy, opened and locked shared (path, descriptor), made now if
        there is none; copies of sidecars count under the limit and are evicted as block
        copies are (least recently used first). Where no room can be made, its verified bytes,
        to read from memory."""
        copy = copy_name(rel, checksum)
        found = self.copies.open_copy(copy, checksum, touch=True)
        if found is not None:
            return found
        data = fetch_verified(self.remote, rel, checksum)
        self.stats_counter.add_many({"bytes_downloaded": len(data), "other_bytes": len(data)})
        status, reservation, used = self.copies.reserve(copy, len(data), self._policy(table, None, None))
        if status == "reserved":
            self._free = self.limit - used
            reservation.commit(data)
            self.stats_counter.add_many({
                "evictions": len(reservation.evicted),
                "evicted_bytes": sum(r.size for r in reservation.evicted)})
        elif status == BUSY:
            self.copies.wait_for(copy)
        elif status == REFUSED:
            self.stats_counter.add("refused_copies")
        self.stats_counter.flush()
        found = None if status == REFUSED else self.copies.open_copy(copy, checksum, touch=True)
        return data if found is None else found

    def _release_unneeded(self, snapshot: tuple) -> None:
        """Close the copies the plan does not read again within the window: open, they would be
        kept from eviction for nothing."""
        held = np.fromiter(self._fds, dtype=np.int64, count=len(self._fds))
        next_use, _ = _lookup(snapshot, held)
        for b in held[next_use == _NEVER].tolist():
            fd, _, _ = self._fds.pop(b)
            os.close(fd)

    def _byte_range(self, table: Any, item: int, b: int, lo: int, hi: int
                    ) -> tuple[tuple[str, str, int], int, int]:
        """((file, checksum, size), first byte, end byte) of tokens [lo, hi) of block b: a
        block's tokens are the last ``tokens * itemsize`` bytes of its safetensors file."""
        size = table.size(b)
        data_start = size - int(table.token_starts[b + 1] - table.token_starts[b]) * item
        if data_start < 8:
            raise CacheFormatError(f"{self.url}/{table.path(b)}: the manifest gives a size too "
                                   "small for its tokens (corrupted); run `torchcache verify`")
        key = (table.path(b), table.checksum(b), size)
        return key, data_start + lo * item, data_start + hi * item

    def _start_copy(self, table: Any, b: int, snapshot: tuple | None) -> Future | None:
        """Our download of block b's copy (True once a copy is there, False if refused): the
        one under way, or one started now if the policy admits it; None: read it by range."""
        future = self._blocks.get(b)
        if future is None and self._admit(table, b, snapshot):
            future = self._executor().submit(self._fetch_block, b, table.path(b), table.size(b),
                                             table.checksum(b), self._policy(table, b, snapshot))
            self._blocks[b] = future
            future.add_done_callback(lambda f, b=b: self._blocks.pop(b, None)
                                     if self._blocks.get(b) is f else None)
        return future

    @staticmethod
    def _pread_pieces(entry: tuple[int, int, str], lo: np.ndarray, hi: np.ndarray,
                      dest: np.ndarray, flat: memoryview, item: int) -> None:
        """Tokens ``[lo, hi)`` of a block from its open copy into ``flat`` at byte ``dest``."""
        fd, data_start, path = entry
        for first, end, to in zip(lo.tolist(), hi.tolist(), dest.tolist()):
            _pread_fully(fd, flat[to:to + (end - first) * item], data_start + first * item, path)

    # ------------------------------------------------------------ policy
    def _admit(self, table: Any, b: int, snapshot: tuple | None) -> bool:
        """Whether copying block b whole may pay (the reservation decides what to evict)."""
        size = table.size(b)
        if size > self.limit:
            return False
        until = self._refused.get(b)
        if until is not None and until > self._reads:
            return False
        if self._free is None or self._free >= size:
            return True  # fill
        if snapshot is not None:
            _, uses = _lookup(snapshot, np.array([b]))
            return int(uses[0]) * self._row_bytes() > size
        recent = self._recent.get(b)
        return recent is not None and recent[1] >= self._reads - self.lookahead and 2 * recent[0] >= size

    def _row_bytes(self) -> int:
        """What one planned read served by a copy saves: its bytes, plus 1/16 for the request
        (so that, bytes being equal, one request for a block beats one per read)."""
        plan = self._plan
        return plan.length * self.itemsize * 17 // 16 if plan is not None else 0

    def _policy(self, table: Any, b: int | None, snapshot: tuple | None):
        """The eviction order and budget for copying block b (None: for evict())."""
        row_bytes = self._row_bytes()

        def policy(residents: list[Resident]):
            ids = self._block_ids(table, residents)
            mtimes = np.array([r.mtime for r in residents], dtype=np.float64)
            if snapshot is None:
                order = np.argsort(mtimes, kind="stable")
                return [(residents[i], 0.0) for i in order.tolist()], None
            next_use, uses = _lookup(snapshot, ids)
            next_use = np.where(ids < 0, _NEVER, next_use)
            order = np.lexsort((mtimes, -next_use))  # furthest next use first, then oldest
            if b is None:
                return [(residents[i], 0.0) for i in order.tolist()], None
            b_next, b_uses = _lookup(snapshot, np.array([b]))
            budget = float(int(b_uses[0]) * row_bytes - table.size(b))
            later = [i for i in order.tolist() if next_use[i] > b_next[0]]
            return [(residents[i], float(uses[i]) * row_bytes) for i in later], budget
        return policy

    def _block_ids(self, table: Any, residents: list[Resident]) -> np.ndarray:
        """Block number of each resident copy (-1 if not a committed block of the table)."""
        with self._mu:
            keys = self._keys
            if keys is None or keys[0] != len(table):
                records = table.records
                key = (records["input"].astype(np.int64) << 32) | records["index"].astype(np.int64)
                order = np.argsort(key, kind="stable")
                keys = self._keys = (len(table), key[order], order)
        _, sorted_keys, order = keys
        wanted = np.empty(len(residents), dtype=np.int64)
        for i, r in enumerate(residents):
            input_index, block_index = r.rel.rsplit("/", 1)[-1].split(".", 1)[0].split("-")
            wanted[i] = (int(input_index) << 32) | int(block_index)
        if not len(sorted_keys):
            return np.full(len(residents), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(sorted_keys, wanted), len(sorted_keys) - 1)
        ids = np.where(sorted_keys[pos] == wanted, order[pos], -1)
        for i, r in enumerate(residents):  # a copy of other bytes (stale) is no block's copy
            b = int(ids[i])
            if b >= 0 and r.rel != copy_name(table.path(b), table.checksum(b)):
                ids[i] = -1
        return ids

    def _note_ranged(self, b: int, nbytes: int) -> None:
        if self.order is not None:
            return
        recent = self._recent.get(b)
        if recent is None or recent[1] < self._reads - self.lookahead:
            recent = self._recent[b] = [0, 0]
        recent[0] += nbytes
        recent[1] = self._reads
        if len(self._recent) > 8192:
            old = self._reads - self.lookahead
            self._recent = {k: v for k, v in self._recent.items() if v[1] >= old}

    # ------------------------------------------------------------ fetching
    def _fetch_block(self, b: int, rel: str, size: int, checksum: str, policy) -> bool:
        """Copy block b whole if room can be made; True when a copy is there afterwards."""
        copy = copy_name(rel, checksum)
        status, reservation, used = self.copies.reserve(copy, size, policy)
        if status == EXISTS:
            return True
        if status == BUSY:  # another process is copying it: wait for that copy
            return self.copies.wait_for(copy)
        if status == REFUSED:
            with self._mu:
                self._refused[b] = self._reads + max(1, self.lookahead // 4)
                if len(self._refused) > 8192:
                    self._refused = {k: v for k, v in self._refused.items() if v > self._reads}
            self._free = self.limit - used
            self.stats_counter.add("refused_copies")
            self.stats_counter.flush()
            return False
        self._free = self.limit - used
        try:  # (its committed size: one request, where s3fs asks for the size of a whole file)
            data = fetch_verified(self.remote, rel, checksum, max_size=size)
        except BaseException:
            reservation.abort()
            raise
        reservation.commit(data)
        self.stats_counter.add_many({
            "bytes_downloaded": len(data), "whole_block_downloads": 1, "whole_block_bytes": len(data),
            "evictions": len(reservation.evicted),
            "evicted_bytes": sum(r.size for r in reservation.evicted)})
        self.stats_counter.flush()
        return True

    def _fetch_parts(self, parts: list[tuple[tuple[str, str, int], int, int]]) -> bytes:
        """The bytes of one read, one ranged request per block it crosses (pinned to a
        verified version of the block)."""
        began = time.perf_counter()
        data = [self._ranged(key, a, z) for key, a, z in parts]
        spent = time.perf_counter() - began  # (a hint for fetch_depth: written without the lock)
        self._service_s = spent if not self._service_s else 0.8 * self._service_s + 0.2 * spent
        self.stats_counter.flush()
        return data[0] if len(data) == 1 else b"".join(data)

    def _ranged(self, key: tuple[str, str, int], a: int, z: int) -> bytes:
        """Bytes [a, z) of a block's remote file, as committed: from its verified version."""
        rel, checksum, _ = key
        for _ in range(2):
            pinned, whole = self._pin(key)
            if whole is not None:  # downloaded whole to verify it: serve the read from it
                return whole[a:z]
            try:
                data = read_pinned(pinned, a, z)
            except ObjectChangedError:  # replaced since pinned: verify the new version
                with self._mu:
                    self._pins.pop((rel, checksum), None)
                unpin(self.copies.dir.path(copy_name(rel, checksum)), pinned)
                continue
            self.stats_counter.add_many({"bytes_downloaded": len(data), "ranged_bytes": len(data),
                                         "ranged_reads": 1})
            return data
        raise CacheFormatError(f"{self.url}/{rel}: replaced twice while being read: the "
                               "remote cache changed after commit; rebuild or restore it, then "
                               "open it again")

    def _pin(self, key: tuple[str, str, int]) -> tuple[PinnedObject, bytes | None]:
        """Block ``key``'s remote file pinned to a version verified against its checksum (and
        its bytes when verifying it downloaded them now)."""
        rel, checksum, size = key
        with self._mu:
            pinned = self._pins.get((rel, checksum))
            if pinned is not None:
                self._pins.move_to_end((rel, checksum))
                return pinned, None
            pinning = self._pinning.setdefault((rel, checksum), threading.Lock())
        with pinning:  # the reads of a block fetched at once pin it once (one metadata request)
            with self._mu:
                pinned = self._pins.get((rel, checksum))
            if pinned is not None:
                return pinned, None
            copy = self.copies.dir.path(copy_name(rel, checksum))
            pinned, whole = pin_verified(self.remote, rel, checksum, size, copy)
            if whole is not None:
                self.stats_counter.add_many({"bytes_downloaded": len(whole),
                                             "verified_bytes": len(whole)})
            with self._mu:
                self._pins[(rel, checksum)] = pinned
                self._pinning.pop((rel, checksum), None)
                while len(self._pins) > _MAX_PINS:
                    self._pins.popitem(last=False)
        return pinned, whole

    def _pump(self, table: Any, dtype: np.dtype, snapshot: tuple | None) -> None:
        """Start fetching this process's next planned reads: as many as cover the time a request
        takes at the pace reads are made (:func:`fetch_depth`), each ranged read together with the
        later reads of its block among the next ``readahead`` (at most ``_AHEAD_BYTES`` of them)
        it can be coalesced with."""
        plan, batch = self._plan, self._batch
        if plan is None or batch is None or self.readahead <= 0:
            return
        first, size = batch
        most = min(self.readahead, max(size, _AHEAD_BYTES // (plan.length * self.itemsize)))
        if len(self._rows) >= most:
            self._drop_stale_rows(plan)
            if len(self._rows) >= most:
                return
        workers = self.order.workers
        step = max(1, workers) * size  # this worker's next batch starts step reads later
        horizon = min(plan.hi, plan.cursor + 1 + plan.lookahead // 2)  # keep what the policy sees
        if workers:  # a worker exits at the end of the loader epoch (unless persistent)
            end = self.order.pass_end(plan.cursor)
            if end is not None:
                horizon = min(horizon, end)
        mine = _own_reads(first, size, step, horizon, most)
        todo = mine[:fetch_depth(self._service_s, self._per_read_s, size, most, self._boost)]
        todo = todo[todo > self._pumped]
        if not len(todo):
            return
        starts = plan.starts[mine - plan.lo]
        token_starts = table.token_starts
        window = (mine, starts, np.searchsorted(token_starts, starts, side="right") - 1,
                  np.searchsorted(token_starts, starts + (plan.length - 1), side="right") - 1)
        for k in todo.tolist():
            if len(self._rows) >= most:
                return
            if not self._prefetch(table, dtype, snapshot, k, plan.start(k), plan.length, window):
                return
            self._pumped = k

    def _note_pace(self, reads: int) -> None:
        """Measure the time between this process's reads (a pause of over a second per read,
        e.g. an evaluation, counts as one second)."""
        now = time.perf_counter()
        if self._last_call is not None and reads:
            per = min(1.0, (now - self._last_call) / reads)
            self._per_read_s = per if not self._per_read_s else 0.9 * self._per_read_s + 0.1 * per
        self._last_call = now

    def _coalesce(self, gap: int, piece: int) -> bool:
        """Whether one request may span ``gap`` unasked bytes to also fetch a ``piece`` of that
        many bytes: the rule is a gap of at most the piece's size and at most ``_MAX_GAP``,
        with this process's spanned bytes staying within 1/``_WASTE_SHARE`` of the ranged bytes
        it asks for. Counts both when it may (``wasted_bytes`` in the stats)."""
        if gap > min(_MAX_GAP, piece) or (self._wasted + gap) * _WASTE_SHARE > self._useful + piece:
            return False
        self._wasted += gap
        self._useful += piece
        self.stats_counter.add("wasted_bytes", gap)
        return True

    def _prefetch(self, table: Any, dtype: np.dtype, snapshot: tuple | None, k: int, start: int,
                  length: int, window: tuple) -> bool:
        """Start fetching read k: copies of its blocks the policy admits, else a ranged read.
        False (nothing started) when it waits for a free slot for a block copy."""
        if start in self._rows:
            return True
        item, token_starts = dtype.itemsize, table.token_starts
        b = int(np.searchsorted(token_starts, start, side="right")) - 1
        base = int(token_starts[b])
        if start + length <= int(token_starts[b + 1]):  # inside one block (the usual read)
            parts = [(b, start - base, start + length - base)]
        else:
            _, blocks, los, his = block_pieces(token_starts, np.array([start], dtype=np.int64),
                                               np.array([length], dtype=np.int64))
            parts = list(zip(blocks.tolist(), los.tolist(), his.tolist()))
        ranged, copies = False, []
        for b, _, _ in parts:
            if b in self._fds or b in self._blocks:
                continue
            rel = table.path(b)
            if os.path.exists(self._copy_path(rel, table.checksum(b))):
                continue
            if self._admit(table, b, snapshot):
                copies.append((b, rel))
            else:
                ranged = True
        if len(self._blocks) + len(copies) > max(1, self.fetch_threads // 4):
            return False  # copies in flight are at their bound: come back at the next read
        for b, rel in copies:
            future = self._executor().submit(self._fetch_block, b, rel, table.size(b),
                                             table.checksum(b), self._policy(table, b, snapshot))
            self._blocks[b] = future
            future.add_done_callback(lambda f, b=b: self._blocks.pop(b, None)
                                     if self._blocks.get(b) is f else None)
        if ranged and len(parts) == 1:
            self._prefetch_run(table, item, k, start, parts[0], length, window)
        elif ranged:
            where = [self._byte_range(table, item, b, lo, hi) for b, lo, hi in parts]
            self._useful += length * item
            self._rows[start] = (k, self._executor().submit(self._fetch_parts, where), length, 0)
        return True

    def _copy_path(self, rel: str, checksum: str) -> str:
        """Where block file ``rel``'s copy is when there is one (resolved, and checked to lead
        nowhere outside the directory, once per block: a hint for the read-ahead, which opens
        copies through LocalCopies.open_copy)."""
        key = (rel, checksum)
        path = self._copy_paths.get(key)
        if path is None:
            if len(self._copy_paths) >= 1 << 16:
                self._copy_paths.clear()
            path = self._copy_paths[key] = self.copies.dir.path(copy_name(rel, checksum))
        return path

    def _prefetch_run(self, table: Any, item: int, k: int, start: int, part: tuple[int, int, int],
                      length: int, window: tuple) -> None:
        """One ranged request for read k (tokens ``[lo, hi)`` of block b) and the later reads of
        block b in ``window`` (this process's next planned reads) that :meth:`_coalesce` lets it
        span to, nearest first; each read a row of the request's bytes."""
        b, lo, hi = part
        ks, starts, first_block, last_block = window
        base = int(table.token_starts[b])
        later = np.flatnonzero((first_block == b) & (last_block == b) & (ks > k))
        found: dict[int, int] = {}
        for s, kk in zip(starts[later].tolist(), ks[later].tolist()):
            if s != start and s not in self._rows:
                found.setdefault(s, kk)
        members = [(start, k, lo)]
        run_lo, run_hi = lo, hi
        self._useful += (hi - lo) * item
        if found:
            los = np.array(sorted(found), dtype=np.int64) - base
            right, left = los[los >= lo].tolist(), los[los < lo][::-1].tolist()
            for a in right:  # toward the end of the block
                z = a + length
                if a > run_hi and not self._coalesce((a - run_hi) * item, length * item):
                    break
                if a <= run_hi:
                    self._useful += length * item
                members.append((base + a, found[base + a], a))
                run_hi = max(run_hi, z)
            for a in left:  # toward its start
                z = a + length
                if z < run_lo and not self._coalesce((run_lo - z) * item, length * item):
                    break
                if z >= run_lo:
                    self._useful += length * item
                members.append((base + a, found[base + a], a))
                run_lo = min(run_lo, a)
        where = self._byte_range(table, item, b, run_lo, run_hi)
        future = self._executor().submit(self._fetch_parts, [where])
        for s, kk, a in members:
            self._rows[s] = (kk, future, length, (a - run_lo) * item)

    def _drop_stale_rows(self, plan: _Plan) -> None:
        """Forget reads fetched ahead that the plan will not make soon (it moved)."""
        behind, beyond = plan.cursor - plan.back, plan.cursor + plan.lookahead
        for start in [s for s, (k, *_) in self._rows.items() if not behind <= k <= beyond]:
            self._rows.pop(start, None)

    # ------------------------------------------------------------ reports and eviction
    def stats(self) -> dict[str, Any]:
        totals: dict[str, Any] = self.stats_counter.totals()
        served = totals["hits"] + totals["misses"]
        totals["hit_rate"] = totals["hits"] / served if served else None
        totals["local_bytes"] = self.copies.usage()
        totals["cache_limit"] = self.limit
        return totals

    def evict(self, table: Any, keep_bytes: int) -> int:
        """Evict copies not in use (needed last first) until at most ``keep_bytes`` remain."""
        snapshot = self._plan.snapshot(table.token_starts) if self._plan is not None else None
        fds, self._fds = self._fds, OrderedDict()  # our own idle copies must not block it
        for fd, _, _ in fds.values():
            os.close(fd)
        evicted = self.copies.evict(keep_bytes, self._policy(table, None, snapshot))
        freed = sum(r.size for r in evicted)
        self.stats_counter.add_many({"evictions": len(evicted), "evicted_bytes": freed})
        self.stats_counter.flush()
        self._free = None
        return freed


def fetch_depth(request_s: float, read_s: float, batch: int, most: int, boost: float = 1.0) -> int:
    """How many of its next planned reads a process keeps fetched ahead: the reads it makes
    while one request is answered (``request_s``, measured seconds per remote request, over
    ``read_s``, measured seconds between its reads), twice over (times ``boost``, which grows
    while reads fetched ahead come in late), plus one batch; between one ``batch`` and ``most``.
    Two batches before anything is measured (a time of 0).

    >>> fetch_depth(0.030, 0.005, 8, 1024), fetch_depth(0.100, 0.005, 8, 1024), fetch_depth(0, 0, 8, 1024)
    (20, 48, 16)
    """
    if not (request_s > 0 and read_s > 0):
        return max(batch, min(most, 2 * batch))
    depth = batch + int(np.ceil(2 * boost * request_s / read_s))
    return max(batch, min(most, depth))


def _own_reads(first: int, size: int, step: int, horizon: int, count: int) -> np.ndarray:
    """The numbers of a process's next ``count`` planned reads before ``horizon``: the batches
    of ``size`` reads that start ``step``, ``2 * step``, ... reads after ``first``."""
    batches = -(-count // max(1, size)) + 1
    begins = first + step * np.arange(1, batches + 1, dtype=np.int64)
    ks = (begins[:, None] + np.arange(size, dtype=np.int64)).reshape(-1)
    return ks[ks < horizon][:count]


def _scatter(data: bytes, targets: list[tuple[memoryview, int]]) -> None:
    """Copy a request's bytes to where its pieces go (``(destination, offset in data)``)."""
    view = memoryview(data)
    for target, offset in targets:
        target[:] = view[offset:offset + len(target)]


def _pread_fully(fd: int, dest: memoryview, offset: int, path: str) -> None:
    fmt.read_into(fd, dest, offset, path, "delete this local copy (it is downloaded again)", "block file")


def _after_fork_in_child() -> None:
    for reader in list(_READERS):
        reader._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
