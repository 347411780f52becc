"""TokenCache: read a cache's token stream and documents, never loading it into RAM.

Reading a damaged or hostile cache is safe: the manifest is fully validated when read (fields,
block names, stream order); every file is opened and checked through :mod:`torchcache.read.cache_files`
(regular files inside the cache directory only, sizes capped before reading, a block's header,
offsets and keys checked against the manifest when first opened: O(1) per block, no checksums).
Anything wrong is a CacheFormatError (or an OSError) naming the file.

Open block files are shared by all TokenCaches of a process in one bounded pool (see
_OpenBlocks), so many caches (a mixture of 20 sources) never exhaust the descriptor limit.

Tokens are copied out of a local block through a read-only memory map while the process maps
at most ``TORCHCACHE_MAP_BYTES`` (default 256 MiB) of block files, and with pread beyond that
(and once the pool has closed the block: a cache of more blocks than the pool holds).
A mapped copy of a few KB costs a third of a pread, but the pages it touches stay counted in the
process's RSS (as shared page cache) until the block is closed; the budget keeps that bounded,
whatever the cache's size. DataLoader worker processes (often many per GPU, and not where the
time goes) and remote caches' local copies always read with pread, so their RSS stays flat. So
do prefetch threads: a copy from a map holds the GIL, a pread lets the training loop run.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
import stat
import threading
import sys
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..format import blocks as fmt
from .._util.args import index_array, int_arg
from .._util.lru import LRUCache
from .cache_files import (check_block_file, load_keys, load_offsets, locate_cache, named_map_copy,
                          offsets_max_size, pread_fully)
from ..errors import CacheFormatError
from ..format.ledger import BlockTable, CacheState, open_state, refresh_state
from .local_copies import STAT_FIELDS, SessionStats, parse_size, tree_bytes
from .prefetch import in_prefetch_thread
from .remote_reads import ArrayReads, BoundedReader, ReadOrder
from ..format.tokenizer import cache_tokenizer

__all__ = ["TokenCache"]

_MAX_DESCRIPTORS = 128  # descriptors of block files open at once in a process (all caches)
_MAX_CACHED_OFFSETS = 64  # blocks whose document offsets a TokenCache keeps in memory
_MAX_CACHED_KEYS = 4  # blocks whose document keys a TokenCache keeps (a keys file can be large)
_MAX_CHECKED_BLOCKS = 1 << 16  # blocks a TokenCache remembers as checked (path and token start)
_MAP_BYTES_VARIABLE = "TORCHCACHE_MAP_BYTES"
_DEFAULT_MAP_BYTES = 256 << 20  # block bytes a process maps at most, all TokenCaches together


def _map_budget() -> int:
    """The process's budget of mapped block bytes: ``$TORCHCACHE_MAP_BYTES`` (a size such as
    ``"1GiB"``; 0 reads everything with pread) or the default."""
    value = os.environ.get(_MAP_BYTES_VARIABLE)
    if value is None:
        return _DEFAULT_MAP_BYTES
    return parse_size(value.strip(), f"the environment variable {_MAP_BYTES_VARIABLE}", minimum=0)


def _locked(method):
    """Run a method under the cache's lock: one thread must not close a file another reads.

    On the way out, close the blocks another thread's eviction left to this cache (it could not
    close them while this cache was reading).
    """
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            finally:
                if self._doomed:
                    self._close_doomed()
    return wrapper


def _in_dataloader_worker() -> bool:
    """True in a torch DataLoader worker process (torch is not imported for this)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


class _Block:
    """An open block file: its descriptor, where global tokens lie in it, who owns it, and its
    memory map while the pool's budget allows one (None: read with pread)."""

    __slots__ = ("fd", "data_end", "base", "path", "index", "owner", "used", "map", "copy")

    def __init__(self, fd: int, data_start: int, path: str, index: int, owner: weakref.ref,
                 first_token: int, tokens: int, itemsize: int):
        self.fd, self.path, self.index, self.owner = fd, path, index, owner
        self.data_end = data_start + tokens * itemsize  # file offset past the last token
        self.base = data_start - first_token * itemsize  # global token t is at base + t * itemsize
        self.used = True  # CLOCK bit: set on every use, cleared by the eviction sweep
        self.map: mmap.mmap | None = None
        self.copy = None  # with a map: copies out of it in a frame named after the file (SIGBUS)

    def read_into(self, dest: memoryview, offset: int, use_map: bool) -> None:
        """Fill ``dest`` with the block file's bytes from ``offset`` (from the map if there is
        one and ``use_map``): an error names the file."""
        m = self.map
        if m is not None and use_map:
            self.copy(dest, m, offset)
            return
        pread_fully(self.fd, dest, offset, self.path, "run `torchcache verify`")


def _descriptors(block: _Block) -> int:
    return 1 if block.map is None else 2


class _OpenBlocks:
    """The process-wide pool of open block files, shared by every TokenCache (CLOCK eviction).

    Invariants that make it safe without locking the hot path:
    - a cache reads a block's descriptor only while holding its own lock, and never keeps a
      block across opening another one;
    - a descriptor is closed only under the pool lock, by a thread that holds the owner's lock
      (taken without blocking) or when the owner is gone; if the owner is busy reading in
      another thread, the block is handed to it (`owner._doomed`) and it closes it itself at
      the end of that call. So no descriptor is ever closed (and its number reused) under a
      reader, and no lock is ever waited for in the reverse order (no deadlock);
    - `fd` is set to -1 before the descriptor is closed, so a table entry with fd >= 0 is open.
    ``limit`` bounds the descriptors of the blocks in the table: a mapped block holds two (its
    memory map keeps a duplicate). After fork the child closes the inherited descriptors and
    starts with an empty pool; every cache re-opens lazily. Fork waits for the pool lock, so the
    child's table is consistent.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.map_budget: int | None = None  # read from the environment at the first map()
        self.mapped = 0  # bytes of the open blocks' memory maps
        self.lock = threading.RLock()
        self.blocks: OrderedDict[_Block, None] = OrderedDict()
        self.held = 0  # descriptors of the blocks in the table
        self.dead: list[_Block] = []  # blocks of collected caches, closed at the next add()
        self.caches: weakref.WeakSet[TokenCache] = weakref.WeakSet()

    def register(self, cache: "TokenCache") -> None:
        with self.lock:
            self.caches.add(cache)

    def add(self, block: _Block, map_size: int | None) -> None:
        """Track a newly opened block (mapped if ``map_size`` is given and the budget allows);
        close the least recently used ones above the limit."""
        with self.lock:
            while self.dead:
                self.discard(self.dead.pop())
            if map_size is not None and self.limit >= 2:
                self._map(block, map_size)
            self.blocks[block] = None
            self.held += _descriptors(block)
            while self.held > self.limit and len(self.blocks) > 1:
                self._evict_one()

    def _evict_one(self) -> None:
        while True:
            victim, _ = self.blocks.popitem(last=False)
            if not victim.used:
                self.held -= _descriptors(victim)
                return self._release(victim)
            victim.used = False  # a second chance
            self.blocks[victim] = None

    def _release(self, victim: _Block) -> None:
        owner = victim.owner()
        if owner is None:
            self.close(victim)
        elif owner._lock.acquire(blocking=False):  # the owner is idle (or it is us)
            try:
                owner._forget(victim)
                self.close(victim)
            finally:
                owner._lock.release()
        else:
            owner._doomed.append(victim)

    def discard(self, block: _Block) -> None:
        """Stop tracking a block and close it (pool lock held)."""
        if block in self.blocks:
            del self.blocks[block]
            self.held -= _descriptors(block)
        self.close(block)

    def _map(self, block: _Block, size: int) -> None:
        """Map a local block of ``size`` bytes if the budget has room for it (and this is not a
        DataLoader worker)."""
        if self.map_budget is None:
            self.map_budget = _map_budget()
        if not 0 < size <= self.map_budget - self.mapped or _in_dataloader_worker():
            return
        try:
            block.map = mmap.mmap(block.fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # no address space or descriptor, or a filesystem that
            return  # cannot map: the block is read with pread, as beyond the budget
        block.copy = named_map_copy(block.path)
        self.mapped += size

    def close(self, block: _Block) -> None:
        m, block.map = block.map, None
        if m is not None:
            self.mapped -= len(m)
            m.close()
        fd, block.fd = block.fd, -1
        if fd >= 0:
            os.close(fd)

    def before_fork(self) -> None:
        self.lock.acquire()

    def after_fork_in_parent(self) -> None:
        self.lock.release()

    def after_fork_in_child(self) -> None:
        """Close the inherited descriptors; caches re-open their blocks lazily."""
        self.lock = threading.RLock()
        inherited = list(self.blocks) + self.dead
        for cache in list(self.caches):
            inherited.extend(cache._open.values())
            cache._reset_process_state()
        self.blocks, self.dead, self.held = OrderedDict(), [], 0
        for block in inherited:
            self.close(block)
        self.mapped = 0


_POOL = _OpenBlocks(_MAX_DESCRIPTORS)
os.register_at_fork(before=_POOL.before_fork, after_in_parent=_POOL.after_fork_in_parent,
                    after_in_child=_POOL.after_fork_in_child)


# ---------------------------------------------------------------- the reader

class TokenCache:
    """A built (or still building) cache: its global token stream and its documents.

    Safe to share between threads (e.g. a prefetch thread and the training loop).

    The global token stream is the blocks' tokens in manifest order. Block files are opened
    lazily in each process and read through memory maps (at most ``$TORCHCACHE_MAP_BYTES``,
    default 256 MiB, of block files a process; never in DataLoader workers) or with pread, so
    nothing is copied into RAM beyond what is asked for; pickling a TokenCache (for DataLoader
    workers) sends only the path and a few small arrays. `refresh()` picks up blocks committed
    since it was opened.

    Args:
        path: the cache directory, or the URL of a remote one (``s3://...``).
        verify_checksums: check each file's checksum once, when first opened (slower start).
        storage_options: fsspec options of a remote cache (credentials, endpoint).
        local_dir: where a remote cache's files are copied (default
            ``$TORCHCACHE_LOCAL_DIR`` or ``~/.cache/torchcache/remote``), in a folder named by
            the cache's fingerprint. Every process of a machine may share it.
        cache_limit: bound the local copies of a remote cache to this many bytes: an int, or a
            string such as ``"200GB"`` or ``"500MiB"`` (KB, MB, GB: powers of 1000; KiB, MiB,
            GiB: of 1024). Blocks that are not copied are read by ranged requests for just the
            bytes asked; the copies kept are those the read plan needs soonest (see
            :meth:`plan_reads`; a DistributedSampler gives its order to a TokenDataset by
            itself); copies in use by any process are never evicted. None (the default): copy
            every block read and keep it. Ignored for a local cache (read in place). All the
            processes sharing ``local_dir`` should use the same limit.
        fetch_threads: with ``cache_limit``, the most remote requests one process makes at once.
        readahead: with ``cache_limit``, how many of its next planned reads a process fetches
            ahead (whole blocks the policy keeps, ranged reads of the others).
        lookahead: with ``cache_limit``, how many planned reads the eviction policy looks at.

    >>> cache = tc.TokenCache("runs/quickstart/cache")  # doctest: +SKIP
    >>> cache.num_tokens, cache.num_documents  # doctest: +SKIP
    (1419343, 14)
    >>> cache.decode(cache.read(0, 8))  # doctest: +SKIP
    'The Project Gutenberg eBook of Pride and'
    >>> remote = tc.TokenCache("s3://bucket/cache", local_dir="/nvme/tc", cache_limit="200GB")  # doctest: +SKIP
    >>> remote.stats()["hit_rate"]  # after some training  # doctest: +SKIP
    0.25
    """

    def __init__(self, path: str | os.PathLike, *, verify_checksums: bool = False,
                 storage_options: dict[str, Any] | None = None, local_dir: str | None = None,
                 cache_limit: int | str | None = None, fetch_threads: int = 16,
                 readahead: int = 256, lookahead: int = 16384):
        limit = None if cache_limit is None else parse_size(cache_limit, "cache_limit")
        fetch_threads = int_arg(fetch_threads, "fetch_threads", 1, 1024)
        readahead = int_arg(readahead, "readahead", 0, 1 << 20)
        lookahead = int_arg(lookahead, "lookahead", 1, 1 << 24)
        self.verify_checksums = verify_checksums
        self._offsets: LRUCache[np.ndarray] = LRUCache(_MAX_CACHED_OFFSETS)
        # (path, token start) of local blocks checked once, to reopen them cheaply
        self._checked_blocks: LRUCache[tuple[str, int]] = LRUCache(_MAX_CHECKED_BLOCKS)
        self._keys_cache: LRUCache[list[str | None]] = LRUCache(_MAX_CACHED_KEYS)
        self._verified: set[str] = set()
        self._init_process_state()
        self._source = locate_cache(os.fspath(path), storage_options, local_dir)
        self.url, self.root = self._source.url, self._source.root
        self._remote = self._source.remote
        self._load(open_state(self._source.metadata))
        self._bounded: BoundedReader | None = None
        if self._remote is not None:
            stats = SessionStats()
            self._source.stats = stats
            if limit is not None:
                self._source.in_memory = True  # sidecars and tokenizer: read into memory, not copied
                self._bounded = BoundedReader(self._source, limit, self.dtype.itemsize,
                                              fetch_threads=fetch_threads, readahead=readahead,
                                              lookahead=lookahead, stats=stats)

    def _init_process_state(self) -> None:
        """What never travels between processes: lock, open blocks, tokenizer."""
        self._reset_process_state()
        self._tokenizer: Tokenizer | None = None
        self._ref = weakref.ref(self)
        _POOL.register(self)

    def _reset_process_state(self) -> None:
        self._lock = threading.RLock()
        self._open: dict[int, _Block] = {}
        self._doomed: list[_Block] = []

    # ------------------------------------------------------------ committed state
    def _load(self, state: CacheState) -> None:
        self._state = state
        self.spec: dict[str, Any] = state.spec
        self.complete: bool = state.complete
        self.fingerprint: str = state.fingerprint
        self.skipped: dict[str, int] = dict(state.skipped)
        self._table = state.table
        self._token_starts = state.table.token_starts
        self._doc_starts = state.table.doc_starts
        self.dtype = fmt.DTYPES[self.spec["dtype"]]

    @_locked
    def refresh(self) -> bool:
        """Pick up what was committed since the last look; True if new blocks were committed (or
        the cache completed). Reads only the new commits (format v2).

        >>> while not cache.complete:  # doctest: +SKIP
        ...     if cache.refresh():
        ...         print(cache.num_tokens, "tokens committed")
        """
        state = refresh_state(self._source.metadata, self._state)
        if state.fingerprint != self.fingerprint:
            raise CacheFormatError(f"{self.url}: the cache was replaced by a different one "
                                   "while it was open; reopen it")
        known = len(self._table)
        if len(state.table) < known or (state.version == 1 and not np.array_equal(
                state.table.records[:known], self._table.records)):  # v2 only ever appends
            raise CacheFormatError(f"{self.url}: committed blocks changed under the reader; "
                                   "the cache was rebuilt while open; reopen it")
        grew = len(state.table) > known or state.complete != self.complete
        self._load(state)
        return grew

    @property
    def num_tokens(self) -> int:
        """Tokens in the committed global stream."""
        return int(self._token_starts[-1])

    @property
    def num_documents(self) -> int:
        """Committed documents."""
        return int(self._doc_starts[-1])

    @property
    def num_blocks(self) -> int:
        """Committed block files."""
        return len(self._table)

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size (None for pre-tokenized data converted without one)."""
        return self.spec["vocab_size"]

    @property
    def eos_id(self) -> int | None:
        """The id appended after each document, or None."""
        return self.spec["eos_id"]

    @property
    def bos_id(self) -> int | None:
        """The id put before each document, or None."""
        return self.spec["bos_id"]

    @property
    def block_table(self) -> BlockTable:
        """The committed blocks' index records (sizes, counts, raw checksums), one per block."""
        return self._table

    def content_digest(self, blocks: int | None = None) -> str:
        """sha256 (hex) of the index records of the first ``blocks`` committed blocks (default:
        all): their token and document counts, sizes, and the checksums of their block, offsets
        and keys files. Caches whose first blocks hold other data differ here even where their
        fingerprint (the build's spec) and size agree; a growing cache's digest of its first
        ``blocks`` never changes. Loader states record it, and refuse another cache's content.

        >>> state_digest = cache.content_digest(12)  # the first 12 blocks  # doctest: +SKIP
        """
        count = self.num_blocks if blocks is None else int_arg(blocks, "blocks", 0, self.num_blocks)
        memo = getattr(self, "_content_memo", None)
        if memo is None or memo[0] != count:
            memo = (count, hashlib.sha256(self._table.records[:count].tobytes()).hexdigest())
            self._content_memo = memo
        return memo[1]

    def block_token_starts(self) -> np.ndarray:
        """Global token offset where each block starts, plus the total at the end.

        >>> starts = cache.block_token_starts()  # doctest: +SKIP
        >>> first_block = cache.read(starts[0], starts[1])  # doctest: +SKIP
        """
        return self._token_starts

    def __repr__(self) -> str:
        state = "complete" if self.complete else "building"
        return (f"TokenCache({self.url!r}, {self.num_tokens:,} tokens, {self.num_documents:,} "
                f"documents, {self.num_blocks} blocks, {state})")

    # ------------------------------------------------------------ pickling: paths and small arrays only
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_lock", "_open", "_doomed", "_tokenizer", "_ref"):
            del state[name]
        state["_verified"] = set()  # (the LRU caches pickle empty)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    @_locked
    def close(self) -> None:
        """Close this cache's open block files now (they are also closed when it is collected).
        With a ``cache_limit``, also stop fetching ahead (waiting for the requests under way) and
        release the local copies this process holds.

        The cache stays usable: a later read opens what it needs again.

        >>> cache.close()  # doctest: +SKIP
        """
        with _POOL.lock:
            for block in self._open.values():
                _POOL.discard(block)
            self._open.clear()
            self._doomed.clear()
        if self._bounded is not None:
            self._bounded.close()

    def __del__(self) -> None:
        # No locks here (the collector may run inside the pool's own critical section): the pool
        # closes these blocks at its next add(); until then they count against its limit.
        blocks = getattr(self, "_open", None)
        if blocks and _POOL is not None:  # None only while the interpreter shuts down
            _POOL.dead.extend(blocks.values())

    # ------------------------------------------------------------ block access
    def _open_block(self, b: int) -> _Block:
        """Open block b (checked against the manifest) and add it to the process's pool.

        A local block checked once is reopened cheaply (its path and where its tokens start are
        kept): only a regular file of the recorded size, not followed through a symlink, is
        taken as the same file; anything else goes through the full check again, which names
        the problem. Random reads over many more blocks than the pool holds reopen blocks often;
        so a block is memory-mapped (within the budget) only when first opened: mapping a block
        again at each reopen costs more than its copies save.
        """
        size = self._table.size(b)
        known = self._checked_blocks.get(b)
        if known is not None:
            fd = self._reopen(known[0], size)
            if fd is not None:
                return self._track(self._block(fd, known[1], known[0], b), may_map=False)
        path, fd = self._open_file(self._table.path(b), self._table.checksum(b), size)
        try:
            start = check_block_file(fd, path, self.dtype, self._block_tokens(b), size)
        except BaseException:
            os.close(fd)
            raise
        if self._remote is None:
            self._checked_blocks.put(b, (path, start))
        return self._track(self._block(fd, start, path, b), may_map=known is None)

    def _block(self, fd: int, data_start: int, path: str, b: int) -> _Block:
        return _Block(fd, data_start, path, b, self._ref, int(self._token_starts[b]),
                      self._block_tokens(b), self.dtype.itemsize)

    @staticmethod
    def _reopen(path: str, size: int) -> int | None:
        """A descriptor of ``path`` if it is still a regular file of ``size`` bytes, else None."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size == size:
            return fd
        os.close(fd)
        return None

    def _track(self, block: _Block, may_map: bool) -> _Block:
        """Keep a newly opened block: in this cache's table and the process's pool (mapped there
        if ``may_map``, it is local and the budget allows)."""
        self._open[block.index] = block
        local = may_map and self._remote is None
        _POOL.add(block, self._table.size(block.index) if local else None)
        return block

    def _forget(self, block: _Block) -> None:
        """Drop a block the pool is closing (caller holds this cache's lock)."""
        if self._open.get(block.index) is block:
            del self._open[block.index]

    def _close_doomed(self) -> None:
        with _POOL.lock:
            for block in self._doomed:
                self._forget(block)
                _POOL.close(block)
            self._doomed.clear()

    def _open_file(self, rel: str, checksum: str | None, max_size: int | None = None) -> tuple[str, int]:
        """(path, descriptor) of a cache file; checked by checksum once if verify_checksums."""
        verify = self.verify_checksums and self._remote is None and rel not in self._verified
        path, fd = self._source.open(rel, checksum, verify, max_size)
        if verify:
            self._verified.add(rel)
        return path, fd

    def _block_tokens(self, b: int) -> int:
        return int(self._token_starts[b + 1] - self._token_starts[b])

    def _block_documents(self, b: int) -> int:
        return int(self._doc_starts[b + 1] - self._doc_starts[b])

    @_locked
    def block_offsets(self, b: int) -> np.ndarray:
        """Cumulative document offsets of block b (n_docs + 1 int64, local to the block).

        >>> cache.block_offsets(0)[:3]  # doctest: +SKIP
        array([  0, 212, 431])
        """
        b = self._check_block(b)
        return self._offsets.get_or_make(b, lambda: self._load_block_offsets(b))

    def _load_block_offsets(self, b: int) -> np.ndarray:
        n_docs = self._block_documents(b)
        path, fd = self._open_file(self._table.offsets_path(b),
                                   self._table.checksum(b, "offsets_checksum"), offsets_max_size(n_docs))
        try:
            return load_offsets(fd, path, n_docs, self._block_tokens(b))
        finally:
            os.close(fd)

    # ------------------------------------------------------------ reading
    @_locked
    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, stop) of the global stream (crossing blocks), in the cache's dtype.

        ``out``: an array of ``stop - start`` tokens of the cache's dtype to read into.

        >>> cache.read(0, 4)  # doctest: +SKIP
        array([  464,  4935, 20336, 46566], dtype=uint16)
        """
        start, stop = int_arg(start, "start", minimum=None), int_arg(stop, "stop", minimum=None)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        if out is None:
            out = np.empty(stop - start, dtype=self.dtype)
        if self._bounded is not None:
            if stop > start:
                self._bounded.read_many(self._table, self.dtype, np.array([start], dtype=np.int64),
                                        stop - start, out.reshape(1, -1))
            return out
        b = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        pos = start
        view = memoryview(out.view(np.uint8))
        item = self.dtype.itemsize
        opened, use_map = self._open, not in_prefetch_thread()
        while pos < stop:
            block = opened.get(b) or self._open_block(b)
            block.used = True
            count = min(stop, int(self._token_starts[b + 1])) - pos
            block.read_into(view[(pos - start) * item:(pos - start + count) * item],
                            block.base + pos * item, use_map)
            pos += count
            b += 1
        return out

    @_locked
    def read_many(self, starts: np.ndarray, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``out[i]`` = tokens ``[starts[i], starts[i] + length)``: many equal reads in one call.

        The same as calling :meth:`read` per row, with the block lookup vectorised and one pread
        per row that lies inside one block (a row crossing blocks goes through :meth:`read`).

        >>> rows = cache.read_many(np.array([0, 2048, 4096]), 2049)  # doctest: +SKIP
        >>> rows.shape  # doctest: +SKIP
        (3, 2049)
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int_arg(length, "length", minimum=None)
        if out is None:
            out = np.empty((len(starts), length), dtype=self.dtype)
        elif (out.shape != (len(starts), length) or out.dtype != self.dtype
              or not out.flags.c_contiguous):
            raise ValueError(f"out must be a C-contiguous {self.dtype} array of shape "
                             f"({len(starts)}, {length})")
        if starts.size == 0:
            return out
        if length < 0 or starts.min() < 0 or int(starts.max()) + length > self.num_tokens:
            bad = starts[(starts < 0) | (starts + length > self.num_tokens)]
            first = int(bad[0]) if bad.size else int(starts[0])
            raise IndexError(f"token range [{first}, {first + length}) outside [0, {self.num_tokens})")
        if self._bounded is not None:
            return self._bounded.read_many(self._table, self.dtype, starts, length, out)
        self._read_rows(starts, length, out)
        return out

    @_locked
    def _read_checked_rows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """:meth:`read_many` of int64 ``starts`` the caller checked (every row inside the
        stream): what a dataset's batch costs beyond the copies, kept small."""
        out = np.empty((len(starts), length), dtype=self.dtype)
        if self._bounded is not None:
            return self._bounded.read_many(self._table, self.dtype, starts, length, out)
        self._read_rows(starts, length, out)
        return out

    def _read_rows(self, starts: np.ndarray, length: int, out: np.ndarray) -> None:
        """Checked rows of a local cache into ``out`` (caller holds the lock): one copy per row
        inside one block, with little else in the loop; a row crossing blocks (rare) through
        :meth:`read`."""
        if length == 0:
            return
        item = self.dtype.itemsize
        nbytes = length * item
        flat = memoryview(out.reshape(-1).view(np.uint8))
        opened, at, use_map = self._open, 0, not in_prefetch_thread()
        blocks = self._token_starts.searchsorted(starts, side="right") - 1
        for b, start in zip(blocks.tolist(), starts.tolist()):
            block = opened.get(b) or self._open_block(b)
            block.used = True
            offset = block.base + start * item
            end = at + nbytes
            m = block.map
            if offset + nbytes > block.data_end:  # the row runs into the next block
                self.read(start, start + length, out=out.reshape(-1)[at // item:end // item])
            elif m is not None and use_map:  # read_into's map copy, inline: the hot path
                block.copy(flat[at:end], m, offset)
            else:
                block.read_into(flat[at:end], offset, False)
            at = end

    @_locked
    def read_ranges(self, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                    out_offsets: np.ndarray) -> np.ndarray:
        """Many token ranges of different lengths in one call: range ``k`` (tokens
        ``[starts[k], starts[k] + lengths[k])``) goes to ``out.reshape(-1)[out_offsets[k]:]``.

        One pread per range that lies inside one block (a range crossing blocks goes through
        :meth:`read`). ``out`` is a C-contiguous array of the cache's dtype.

        >>> flat = np.empty(10, dtype=cache.dtype)  # doctest: +SKIP
        >>> cache.read_ranges(np.array([100, 0]), np.array([4, 6]), flat, np.array([0, 4]))  # doctest: +SKIP
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        out_offsets = np.asarray(out_offsets, dtype=np.int64).reshape(-1)
        flat_out = out.reshape(-1)
        if out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {self.dtype} array")
        if not len(starts) == len(lengths) == len(out_offsets):
            raise ValueError("starts, lengths and out_offsets must have the same length")
        if starts.size == 0:
            return out
        if ((lengths < 0).any() or starts.min() < 0 or int((starts + lengths).max()) > self.num_tokens
                or out_offsets.min() < 0 or int((out_offsets + lengths).max()) > flat_out.size):
            raise IndexError(f"a token range outside [0, {self.num_tokens}) or past the end of out")
        if self._bounded is not None:
            for start, length, at in zip(starts.tolist(), lengths.tolist(), out_offsets.tolist()):
                self.read(start, start + length, out=flat_out[at:at + length])
            return out
        self._read_ranges(starts, lengths, flat_out, out_offsets)
        return out

    def _read_ranges(self, starts: np.ndarray, lengths: np.ndarray, flat_out: np.ndarray,
                     out_offsets: np.ndarray) -> None:
        """Checked ranges of a local cache into ``flat_out``: one pread per range inside one
        block, with nothing else in the loop; a range crossing blocks through :meth:`read`."""
        item = self.dtype.itemsize
        if not lengths.all():  # empty ranges read nothing (and may start at the very end)
            keep = lengths > 0
            starts, lengths, out_offsets = starts[keep], lengths[keep], out_offsets[keep]
        blocks = np.searchsorted(self._token_starts, starts, side="right") - 1
        inside = starts + lengths <= self._token_starts[blocks + 1]
        if not inside.all():  # rare: ranges crossing a block boundary
            for k in np.flatnonzero(~inside).tolist():
                start, length, at = int(starts[k]), int(lengths[k]), int(out_offsets[k])
                self.read(start, start + length, out=flat_out[at:at + length])
            starts, lengths, out_offsets, blocks = (
                starts[inside], lengths[inside], out_offsets[inside], blocks[inside])
        view = memoryview(flat_out.view(np.uint8))
        opened, use_map = self._open, not in_prefetch_thread()
        for b, start, size, at in zip(blocks.tolist(), starts.tolist(), (lengths * item).tolist(),
                                      (out_offsets * item).tolist()):
            block = opened.get(b) or self._open_block(b)
            block.used = True
            block.read_into(view[at:at + size], block.base + start * item, use_map)

    # ------------------------------------------------------------ remote caches under a limit
    @_locked
    def plan_reads(self, order: ReadOrder | Any | None, length: int | None = None) -> None:
        """Tell a remote cache with a ``cache_limit`` what this process reads next, in order, so it
        fetches ahead and keeps the blocks needed soonest (a no-op for other caches).

        ``order``: a :class:`torchcache.read.remote_reads.ReadOrder` (an endless order, e.g. a
        sampler's), or the token starts of the next reads (an array) with their ``length`` in
        tokens; None forgets the plan (eviction is then least recently used). A
        :class:`torchcache.DistributedSampler` over a :class:`torchcache.TokenDataset` plans for
        you (``ds.follow_sampler(sampler)``); the plan travels with the cache into DataLoader
        workers.

        >>> cache.plan_reads(np.array([4096, 0, 8192]) * 2048, length=2049)  # doctest: +SKIP
        >>> rows = cache.read_many(np.array([4096, 0, 8192]) * 2048, 2049)  # doctest: +SKIP
        """
        if order is not None and not isinstance(order, ReadOrder):
            starts = index_array(order, "order").reshape(-1)
            if length is None:
                raise TypeError("plan_reads(starts, length): give the length of the reads, in "
                                "tokens, with an array of token starts")
            order = ArrayReads(starts, int_arg(length, "length", 1))
        elif order is not None and int_arg(order.length, "order.length", 1) < 1:
            raise ValueError("order.length must be >= 1")
        if self._bounded is not None:
            self._bounded.set_order(order)

    def stats(self) -> dict[str, Any]:
        """Counters of remote reading since this cache was opened, summed over its DataLoader
        workers: ``bytes_downloaded`` (all remote bytes), ``whole_block_downloads`` and
        ``whole_block_bytes`` (block copies), ``ranged_reads`` and ``ranged_bytes`` (reads of
        just a sample's bytes), ``other_bytes`` (offsets, keys, tokenizer), ``hits`` (reads
        served from local copies), ``misses`` (reads that needed remote bytes; ``prefetched``
        of them were fetched ahead), ``hit_rate``, ``evictions``, ``evicted_bytes``,
        ``refused_copies`` (blocks read by range because no room was worth making),
        ``verified_bytes`` (blocks downloaded whole once per machine before their first ranged
        read, to check them against their committed checksums),
        ``local_bytes`` (the copy directory's size now) and ``cache_limit``. Hits and misses are
        counted only under a ``cache_limit``; a local cache reports zeros.

        >>> s = cache.stats()  # doctest: +SKIP
        >>> s["bytes_downloaded"] / cache_bytes, s["hit_rate"]  # doctest: +SKIP
        (1.21, 0.25)
        """
        if self._bounded is not None:
            return self._bounded.stats()
        totals: dict[str, Any] = dict.fromkeys(STAT_FIELDS, 0)
        if self._source.stats is not None:
            totals = self._source.stats.totals()
        totals["hit_rate"] = None
        totals["local_bytes"] = tree_bytes(self.root) if self._remote is not None else 0
        totals["cache_limit"] = None
        return totals

    @_locked
    def evict(self, keep_bytes: int | str = 0) -> int:
        """Delete local copies of a remote cache with a ``cache_limit`` until at most
        ``keep_bytes`` remain (an int or a size string); copies in use by any process of the
        machine stay. Returns the bytes freed. Those needed last go first.

        >>> cache.evict("10GB")  # doctest: +SKIP
        3221225472
        """
        keep = 0 if keep_bytes in (0, "0") else parse_size(keep_bytes, "keep_bytes")
        if self._bounded is None:
            raise ValueError(f"evict() needs a remote cache opened with cache_limit= ({self.url} "
                             f"is {'remote without a limit' if self._remote else 'local'})")
        return self._bounded.evict(self._table, keep)

    def _check_block(self, b: int) -> int:
        b = int_arg(b, "b", minimum=None)
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block {b} outside [0, {self.num_blocks})")
        return b

    def _check_document(self, i: int) -> int:
        i = int_arg(i, "i", minimum=None)
        if i < 0:
            i += self.num_documents
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} outside [0, {self.num_documents})")
        return i

    def _document_block(self, i: int) -> int:
        return int(np.searchsorted(self._doc_starts, i, side="right")) - 1

    def document_span(self, i: int) -> tuple[int, int]:
        """Global token range [start, stop) of document i (negative i counts from the end).

        >>> start, stop = cache.document_span(3)  # doctest: +SKIP
        >>> np.array_equal(cache.read(start, stop), cache.document(3))  # doctest: +SKIP
        True
        """
        i = self._check_document(i)
        b = self._document_block(i)
        offsets = self.block_offsets(b)
        local = i - int(self._doc_starts[b])
        base = int(self._token_starts[b])
        return base + int(offsets[local]), base + int(offsets[local + 1])

    def document_at(self, token: int) -> int:
        """Index of the document containing global token position `token`.

        >>> cache.document_at(0)  # doctest: +SKIP
        0
        """
        token = int_arg(token, "token", minimum=None)
        if not 0 <= token < self.num_tokens:
            raise IndexError(f"token {token} outside [0, {self.num_tokens})")
        b = int(np.searchsorted(self._token_starts, token, side="right")) - 1
        local = int(np.searchsorted(self.block_offsets(b), token - int(self._token_starts[b]),
                                    side="right")) - 1
        return int(self._doc_starts[b]) + local

    def document(self, i: int) -> np.ndarray:
        """The i-th document in stream order, as stored (with its BOS/EOS), as int64.

        >>> text = cache.decode(cache.document(0))  # doctest: +SKIP
        """
        start, stop = self.document_span(i)
        return self.read(start, stop).astype(np.int64)

    def document_starts_in(self, start: int, stop: int) -> np.ndarray:
        """Global token positions in (start, stop) where a document begins (int64, sorted).

        >>> cache.document_starts_in(0, 4096)  # doctest: +SKIP
        array([ 212,  431, 1877])
        """
        found = []
        b = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        while b < self.num_blocks and self._token_starts[b] < stop:
            base = int(self._token_starts[b])
            offsets = self.block_offsets(b)[:-1] + base
            lo = np.searchsorted(offsets, start, side="right")
            hi = np.searchsorted(offsets, stop, side="left")
            found.append(offsets[lo:hi])
            b += 1
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def document_key(self, i: int) -> str | None:
        """The source sample key of document i (webdataset `__key__`), or None if not recorded.

        A block's keys are read once and kept (for the last few blocks asked about).

        >>> cache.document_key(0)  # doctest: +SKIP
        'shard-000000/sample-0001'
        """
        i = self._check_document(i)
        b = self._document_block(i)
        if not self._table.has_keys(b):
            return None
        keys = self._keys_cache.get_or_make(b, lambda: self._load_block_keys(b))
        return keys[i - int(self._doc_starts[b])]

    @_locked
    def _load_block_keys(self, b: int) -> list[str | None]:
        path, fd = self._open_file(self._table.keys_path(b), self._table.checksum(b, "keys_checksum"),
                                   fmt.MAX_KEYS_BYTES)
        try:
            return load_keys(fd, path, self._block_documents(b))
        finally:
            os.close(fd)

    def trace(self, token: int) -> dict[str, Any]:
        """Where global token position `token` came from: document, its key and input file.

        >>> cache.trace(1000)["input"]  # doctest: +SKIP
        'data/books.jsonl'
        """
        token = int_arg(token, "token", minimum=None)
        doc = self.document_at(token)
        start, stop = self.document_span(doc)
        manifest_input = self.spec["inputs"][self._table.input(self._document_block(doc))]["path"]
        return {"document": doc, "key": self.document_key(doc), "input": manifest_input,
                "document_tokens": (start, stop), "offset_in_document": token - start}

    def document_lengths(self) -> np.ndarray:
        """Length in tokens of every document (reads all offset sidecars; for stats).

        >>> float(cache.document_lengths().mean())  # doctest: +SKIP
        101381.6
        """
        parts = [np.diff(self.block_offsets(b)) for b in range(self.num_blocks)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------ tokenizer
    @_locked
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the cache was built with (stored in the cache directory; loaded once).

        >>> cache.tokenizer().encode("hello").ids  # doctest: +SKIP
        [31373]
        """
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> Tokenizer:
        if self.spec["tokenizer"] is None:
            raise ValueError(f"{self.url} was converted from pre-tokenized data and has no "
                             "tokenizer; read token ids instead (e.g. `torchcache show --ids`)")
        path, fd = self._open_file(fmt.TOKENIZER_NAME, None)
        try:
            size = os.fstat(fd).st_size
            if size > fmt.MAX_TOKENIZER_BYTES:
                raise CacheFormatError(f"{path}: {size:,} bytes, more than the "
                                           f"{fmt.MAX_TOKENIZER_BYTES:,} allowed for a tokenizer")
            data = fmt.read_exact(fd, 0, size, path)
        finally:
            os.close(fd)
        return cache_tokenizer(data, self.spec["tokenizer"]["fingerprint"], path)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of token ``ids`` (any sequence of ints: list, array, tensor), with the cache's tokenizer.

        The tokenizer is loaded on the first call and kept, so a call costs what the
        tokenizer's own decode costs.

        >>> cache.decode(cache.document(0)[:12])  # doctest: +SKIP
        'The Project Gutenberg eBook of Pride and Prejudice'
        """
        return self.tokenizer().decode([int(x) for x in ids], skip_special_tokens=skip_special_tokens)
