"""TokenCache: read a cache's token stream and documents, never loading it into RAM.

Reading a damaged or hostile cache is safe: the manifest is fully validated when read (fields,
block names, stream order); every file is opened and checked through :mod:`torchcache.read.cache_files`
(regular files inside the cache directory only, sizes capped before reading, a block's header,
offsets and keys checked against the manifest when first opened: O(1) per block, no checksums).
Anything wrong is a CacheFormatError (or an OSError) naming the file.

Open block files are shared by all TokenCaches of a process in one bounded pool (see
_OpenBlocks), so many caches (a mixture of 20 sources) never exhaust the descriptor limit.

Every read is one gather (:meth:`TokenCache.read_ranges`: a list of token ranges into one
array, block by block); ``read`` and ``read_many`` are its common shapes. Tokens are copied out
of a block file through a read-only memory map while the cache's maps stay within its
``map_bytes`` (an argument, default 256 MiB), and with pread beyond that (and once the pool has
closed the block: a cache of more blocks than the pool holds). A mapped copy of a few KB costs a
third of a pread, but the pages it touches stay counted in the process's RSS (as shared page
cache) until the block is closed; the budget keeps that bounded, whatever the cache's size.
``map_bytes=0`` reads everything with pread, so RSS stays flat: what a loader wants in its
worker processes (:meth:`TokenCache.with_map_bytes` gives such a copy). A remote cache read under
a ``cache_limit`` reads through :mod:`torchcache.read.remote_reads` instead (local copies with
pread, ranged requests for the rest), one call per batch of ranges.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import mmap
import os
import pickle
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from ..format import blocks as fmt
from .._util.args import index_array, int_arg, unsigned_max
from .._util.lru import LRUCache
from .cache_files import (check_block_file, load_keys, load_offsets, load_record_runs, locate_cache,
                          memory_file, named_map_copy, offsets_max_size)
from ..errors import CacheFormatError
from ..format.arrays import BlockArrays, arrays_name, read_arrays_file
from ..format.documents import (BlockDocuments, docs_max_size, has_arrays, has_loss_mask,
                                read_docs_file)
from ..format.ledger import BlockTable, CacheState, open_state, refresh_state
from ..format.provenance import derived_records_hold, input_records, past_the_input, record_at
from .trained_runs import TrainedRuns
from .local_copies import STAT_FIELDS, STATS_DIR, SessionStats, parse_size, tree_bytes
from .remote_reads import ArrayReads, BoundedReader, ReadOrder
from ..format.tokenizer import cache_tokenizer
from ..format.tokenizer_backends import TokenizerBackend, stored_file_names
from ..format.tokenizer_kinds import cache_backend

__all__ = ["RowPlan", "TokenCache", "gather_rows"]

_MAX_DESCRIPTORS = 128  # descriptors of block files open at once in a process (all caches)
_MAX_CACHED_OFFSETS = 64  # blocks whose document offsets a TokenCache keeps in memory
_MAX_CACHED_KEYS = 4  # blocks whose document keys a TokenCache keeps (a keys file can be large)
_MAX_CACHED_DOCS = 64  # blocks whose documents sidecar (v3: mask runs, records) a TokenCache keeps
_MAX_MAPPED_COPIES = 2  # arrays sidecars kept mapped under a cache_limit (a mapped copy cannot be evicted)
_MAX_CHECKED_BLOCKS = 1 << 16  # blocks a TokenCache remembers as checked (path and token start)
DEFAULT_MAP_BYTES = 256 << 20  # block bytes a TokenCache maps at most, unless told otherwise
_TRUNCATED = "run `torchcache verify`"  # what to do about a block file that ends too soon


def _locked(method):
    """Run a method under the cache's lock: one thread must not close a file another reads.

    On the way out, close the blocks another thread's eviction left to this cache (it could not
    close them while this cache was reading).
    """
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._lock.acquire()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._end_read()
    return wrapper


class _MapBudget:
    """The bytes of block files one TokenCache may map (``limit``) and has mapped (``used``,
    changed under the pool lock only)."""

    __slots__ = ("limit", "used")

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def room(self, size: int) -> bool:
        return 0 < size <= self.limit - self.used


class _Block:
    """An open block file: its descriptor, where global tokens lie in it, who owns it, and its
    memory map while its cache's budget allows one (None: read with pread)."""

    __slots__ = ("fd", "data_end", "base", "path", "index", "owner", "used", "map", "mapping",
                 "copy", "budget")

    def __init__(self, fd: int, data_start: int, path: str, index: int, owner: weakref.ref,
                 first_token: int, tokens: int, itemsize: int, budget: _MapBudget):
        self.fd, self.path, self.index, self.owner = fd, path, index, owner
        self.data_end = data_start + tokens * itemsize  # file offset past the last token
        self.base = data_start - first_token * itemsize  # global token t is at base + t * itemsize
        self.used = True  # CLOCK bit: set on every use, cleared by the eviction sweep
        self.map: memoryview | None = None  # a view of `mapping`: a slice of it copies once
        self.mapping: mmap.mmap | None = None
        self.copy = None  # with a map: copies out of it in a frame named after the file (SIGBUS)
        self.budget = budget  # the owner's map budget (what closing the map gives back)


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
        self.lock = threading.RLock()
        self.blocks: OrderedDict[_Block, None] = OrderedDict()
        self.held = 0  # descriptors of the blocks in the table
        self.dead: list[_Block] = []  # blocks of collected caches, closed at the next add()
        self.caches: weakref.WeakSet[TokenCache] = weakref.WeakSet()

    def register(self, cache: "TokenCache") -> None:
        with self.lock:
            self.caches.add(cache)

    def add(self, block: _Block, map_size: int | None) -> None:
        """Track a newly opened block (mapped if ``map_size`` is given and its cache's budget
        has room); close the least recently used ones above the limit."""
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

    @staticmethod
    def _map(block: _Block, size: int) -> None:
        """Map a block file of ``size`` bytes if its cache's budget has room for it."""
        if not block.budget.room(size):
            return
        try:
            block.mapping = mmap.mmap(block.fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # no address space or descriptor, or a filesystem that
            return  # cannot map: the block is read with pread, as beyond the budget
        block.map = memoryview(block.mapping)
        block.copy = named_map_copy(block.path)
        block.budget.used += size

    @staticmethod
    def close(block: _Block) -> None:
        view, m, block.map, block.mapping = block.map, block.mapping, None, None
        if m is not None:
            view.release()  # (a map cannot close while a view of it exists)
            block.budget.used -= len(m)
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
        for block in inherited:  # (their budgets are the parent's: each cache has a new one)
            self.close(block)


_POOL = _OpenBlocks(_MAX_DESCRIPTORS)
os.register_at_fork(before=_POOL.before_fork, after_in_parent=_POOL.after_fork_in_parent,
                    after_in_child=_POOL.after_fork_in_child)


# ---------------------------------------------------------------- the reader

class TokenCache:
    """A built (or still building) cache: its global token stream and its documents.

    Safe to share between threads (e.g. a prefetch thread and the training loop).

    The global token stream is the blocks' tokens in manifest order. Block files are opened
    lazily in each process and read through memory maps (at most ``map_bytes`` of this cache's
    block files) or with pread, so nothing is copied into RAM beyond what is asked for; pickling
    a TokenCache (for DataLoader workers) sends only the path and a few small arrays.
    `refresh()` picks up blocks committed since it was opened.

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
            :meth:`plan_reads`; :class:`torchcache.DataLoader` plans a
            :class:`torchcache.TokenDataset`'s reads when it starts iterating); copies in use
            by any process are never evicted. A block's arrays sidecar is copied whole under
            the same limit (read into memory where no room can be made). None (the default):
            copy every block read and keep it. Ignored for a local cache (read in place). All
            the processes sharing
            ``local_dir`` should use the same limit.
        fetch_threads: with ``cache_limit``, the most remote requests one process makes at once.
        readahead: with ``cache_limit``, the most of its next planned reads a process holds
            fetched ahead (whole blocks the policy keeps, ranged reads of the others): it fetches
            as far ahead as the measured time of a request needs, and coalesces the ranged reads
            of one block within this window into fewer requests (0: no read-ahead).
        lookahead: with ``cache_limit``, how many planned reads the eviction policy looks at.
        map_bytes: the most bytes of block files this cache keeps memory-mapped in a process
            (an int or a size string, as ``cache_limit``); blocks beyond it are read with
            pread. 0 reads everything with pread: the process's RSS then stays flat (for
            DataLoader worker processes, see :meth:`with_map_bytes`). Default 256 MiB.

    A tiny cache, built here from a word-level tokenizer, shows the reads:

    >>> import tempfile
    >>> import torchcache as tc
    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> words = "the cat sat on a mat dog ran far <eos>".split()
    >>> vocab = {w: i for i, w in enumerate(words)} | {"[UNK]": len(words)}
    >>> tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    >>> tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tmp = tempfile.TemporaryDirectory()
    >>> docs = ["the cat sat on a mat", "a dog ran far", "the dog sat"] * 4
    >>> built = tc.build_cache(iter(docs), f"{tmp.name}/cache", tokenizer, eos="<eos>",
    ...                        block_tokens=16, num_workers=1, progress=False)
    >>> cache = tc.TokenCache(f"{tmp.name}/cache")
    >>> cache.num_tokens, cache.num_documents, cache.num_blocks
    (64, 12, 4)
    >>> cache.decode(cache.read(0, 7))
    'the cat sat on a mat <eos>'

    Many reads in one call: equal rows with :meth:`read_many`, any ranges with
    :meth:`read_ranges` (the gather every read goes through; here they cross blocks):

    >>> cache.read_many([0, 7, 12], 5)
    array([[0, 1, 2, 3, 4],
           [4, 6, 7, 8, 9],
           [0, 6, 2, 9, 0]], dtype=uint16)
    >>> other = tc.TokenCache(f"{tmp.name}/cache")  # rows of several caches in one array:
    >>> gather_rows([cache, other], [1, 0], [7, 0], 5)
    array([[4, 6, 7, 8, 9],
           [0, 1, 2, 3, 4]], dtype=uint16)
    >>> cache.block_token_starts()[:3], cache.read_ranges([14, 0], [4, 2])
    (array([ 0, 16, 32]), array([2, 9, 0, 1, 0, 1], dtype=uint16))

    Documents, and where tokens come from:

    >>> cache.document_span(1), cache.document_at(10), cache.document_starts_in(0, 16)
    ((7, 12), 1, array([ 7, 12]))
    >>> cache.decode(cache.document(2))
    'the dog sat <eos>'
    >>> cache.trace(13)["offset_in_document"]
    1

    A copy that reads with pread only (what a DataLoader worker process wants), and no reads
    left open:

    >>> pread_only = cache.with_map_bytes(0)
    >>> pread_only.map_bytes, bool((pread_only.read(0, 64) == cache.read(0, 64)).all())
    (0, True)
    >>> cache.close(); other.close(); pread_only.close(); tmp.cleanup()

    A remote cache larger than the local disk (needs a store):

    >>> remote = tc.TokenCache("s3://bucket/cache", local_dir="/nvme/tc", cache_limit="200GB")  # doctest: +SKIP
    >>> remote.stats()["hit_rate"]  # after some training  # doctest: +SKIP
    0.25
    """

    def __init__(self, path: str | os.PathLike, *, verify_checksums: bool = False,
                 storage_options: dict[str, Any] | None = None, local_dir: str | None = None,
                 cache_limit: int | str | None = None, fetch_threads: int = 16,
                 readahead: int = 1024, lookahead: int = 16384,
                 map_bytes: int | str = DEFAULT_MAP_BYTES):
        limit = None if cache_limit is None else parse_size(cache_limit, "cache_limit")
        fetch_threads = int_arg(fetch_threads, "fetch_threads", 1, 1024)
        readahead = int_arg(readahead, "readahead", 0, 1 << 20)
        lookahead = int_arg(lookahead, "lookahead", 1, 1 << 24)
        self.map_bytes: int = parse_size(map_bytes, "map_bytes", minimum=0)
        self.verify_checksums = verify_checksums
        self._offsets: LRUCache[np.ndarray] = LRUCache(_MAX_CACHED_OFFSETS)
        # (path, token start) of local blocks checked once, to reopen them cheaply
        self._checked_blocks: LRUCache[tuple[str, int]] = LRUCache(_MAX_CHECKED_BLOCKS)
        self._keys_cache: LRUCache[list[str | None]] = LRUCache(_MAX_CACHED_KEYS)
        self._docs_cache: LRUCache[BlockDocuments] = LRUCache(_MAX_CACHED_DOCS)
        self._arrays_cache: LRUCache[BlockArrays] = LRUCache(_MAX_CACHED_DOCS)
        self._runs_cache: LRUCache[tuple] = LRUCache(_MAX_CACHED_DOCS)  # (record runs or None,)
        self._input_docs: tuple[int, np.ndarray, np.ndarray] | None = None  # see _input_documents
        self._trained = TrainedRuns()  # the mask runs of the blocks read so far
        self._verified: set[str] = set()
        self._init_process_state()
        self._source = locate_cache(os.fspath(path), storage_options, local_dir)
        self.url, self.root = self._source.url, self._source.root
        self._remote = self._source.remote
        self._load(open_state(self._source.metadata))
        self._bounded: BoundedReader | None = None
        if self._remote is not None:
            stats = SessionStats(os.path.join(self.root, STATS_DIR))
            self._source.stats = stats
            if limit is not None:
                self._source.in_memory = True  # sidecars and tokenizer: read into memory, not copied
                self._bounded = BoundedReader(self._source, limit, self.dtype.itemsize,
                                              fetch_threads=fetch_threads, readahead=readahead,
                                              lookahead=lookahead, stats=stats)
                self._arrays_cache = self._new_arrays_cache()

    def with_map_bytes(self, map_bytes: int | str) -> "TokenCache":
        """A new TokenCache of the same cache, as this one is now (committed blocks, read plan,
        statistics session), that maps at most ``map_bytes`` of block files (0: pread only).

        It is what a DataLoader worker process would get (the TokenCache pickled): nothing open
        is shared, so each may be used, and closed, on its own. A loader that starts worker
        processes hands them a ``with_map_bytes(0)`` copy, so their RSS stays flat.

        >>> workers_cache = cache.with_map_bytes(0)  # doctest: +SKIP
        """
        limit = parse_size(map_bytes, "map_bytes", minimum=0)
        clone = pickle.loads(pickle.dumps(self))
        clone.map_bytes = limit
        clone._maps = _MapBudget(limit)
        return clone

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
        self._maps = _MapBudget(self.map_bytes)

    # ------------------------------------------------------------ committed state
    def _load(self, state: CacheState) -> None:
        self._state = state
        self.spec: dict[str, Any] = state.spec
        self.complete: bool = state.complete
        self.fingerprint: str = state.fingerprint
        self.skipped: dict[str, int] = dict(state.skipped)
        self._table = state.table
        self._token_starts = state.table.token_starts
        self._num_tokens = int(self._token_starts[-1])  # (read on every batch: kept as an int)
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
        return self._num_tokens

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
        for name in ("_lock", "_open", "_doomed", "_tokenizer", "_ref", "_maps"):
            del state[name]
        state["_verified"] = set()  # (the LRU caches pickle empty)
        state["_input_docs"] = None  # (made again where needed)
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
        # mapped arrays sidecars: unmapped once the arrays handed out are gone too
        self._arrays_cache = self._new_arrays_cache()
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
                      self._block_tokens(b), self.dtype.itemsize, self._maps)

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
        if ``may_map`` and this cache's budget has room)."""
        self._open[block.index] = block
        _POOL.add(block, self._table.size(block.index) if may_map else None)
        return block

    def _forget(self, block: _Block) -> None:
        """Drop a block the pool is closing (caller holds this cache's lock)."""
        if self._open.get(block.index) is block:
            del self._open[block.index]

    def _end_read(self) -> None:
        """Release the lock a read took (held on entry), first closing the blocks another
        thread's eviction left to this cache (it could not close them while this cache read)."""
        try:
            if self._doomed:
                self._close_doomed()
        finally:
            self._lock.release()

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

    # ------------------------------------------------------------ reading: one gather
    @_locked
    def read_ranges(self, starts: Any, lengths: Any, out: np.ndarray | None = None,
                    out_offsets: Any = None) -> np.ndarray:
        """Many token ranges in one call, the gather every read goes through: range ``k``
        (tokens ``[starts[k], starts[k] + lengths[k])``, crossing blocks as needed) goes to
        ``out.reshape(-1)[out_offsets[k]:]``, in the cache's dtype.

        ``out``: a C-contiguous array of the cache's dtype (default: a new flat one of
        ``sum(lengths)`` tokens); ``out_offsets``: where each range goes in it (default: one
        after the other). Returns ``out``. The ranges are read block by block: from a local
        block (its memory map or pread), or from a remote cache's local copies and ranged
        requests (one per block run of ranges, in parallel).

        >>> cache.read_ranges([14, 0], [4, 2])  # doctest: +SKIP
        array([2, 9, 0, 1, 0, 1], dtype=uint16)
        """
        starts = index_array(starts, "starts").reshape(-1)
        lengths = index_array(lengths, "lengths").reshape(-1)
        if len(lengths) != len(starts):
            raise ValueError(f"starts and lengths must have the same length, got {len(starts)} "
                             f"and {len(lengths)}")
        if out_offsets is None:
            out_offsets = np.cumsum(lengths) - lengths
        else:
            out_offsets = index_array(out_offsets, "out_offsets").reshape(-1)
            if len(out_offsets) != len(starts):
                raise ValueError(f"out_offsets must have one offset per range ({len(starts)}), "
                                 f"got {len(out_offsets)}")
        # each check is one reduction over all the ranges (a batch reads a few dozen ranges: a
        # numpy call per condition would cost more than the copies). Viewed as unsigned, a
        # negative value is past every bound; and where starts and lengths are at most
        # num_tokens, their sum cannot wrap around.
        n = self.num_tokens
        if len(starts) and int(np.maximum.reduce(np.concatenate((starts, lengths, starts + lengths))
                                       .view(np.uint64))) > n:
            k = int(np.flatnonzero((lengths < 0) | (starts < 0) | (starts > n) | (lengths > n)
                                   | (starts + lengths > n))[0])
            start, length = int(starts[k]), int(lengths[k])
            raise IndexError(f"token range [{start}, {start + length}) outside [0, {n})")
        if out is None:
            out = np.empty(int(lengths.sum()), dtype=self.dtype)
        elif out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {self.dtype} array")
        if len(starts) == 0:
            return out
        if int(np.maximum.reduce(np.concatenate((out_offsets, out_offsets + lengths))
                                 .view(np.uint64))) > out.size:
            raise IndexError(f"a range goes past the end of out ({out.size} tokens) or before "
                             "its start: check out_offsets")
        self._gather(starts, lengths, out, out_offsets)
        return out

    @_locked
    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, stop) of the global stream (crossing blocks), in the cache's dtype.

        ``out``: an array of ``stop - start`` tokens of the cache's dtype to read into.

        >>> cache.read(0, 4)  # doctest: +SKIP
        array([0, 1, 2, 3], dtype=uint16)
        """
        start, stop = int_arg(start, "start", minimum=None), int_arg(stop, "stop", minimum=None)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        if out is None:
            out = np.empty(stop - start, dtype=self.dtype)
        elif out.size != stop - start or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous {self.dtype} array of {stop - start} tokens")
        if stop > start:
            self._gather(np.array([start], dtype=np.int64), stop - start, out)
        return out

    @_locked
    def read_many(self, starts: Any, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``out[i]`` = tokens ``[starts[i], starts[i] + length)``: many equal reads in one
        call (:meth:`read_ranges` of equal ranges, into a 2-d array; :func:`gather_rows` for
        rows of several caches).

        >>> cache.read_many([0, 7, 12], 5).shape  # doctest: +SKIP
        (3, 5)
        """
        starts = index_array(starts, "starts").reshape(-1)
        length = int_arg(length, "length", minimum=None)
        out = _rows_out(out, len(starts), length, self.dtype)
        if starts.size == 0:
            return out
        if length < 0 or unsigned_max(starts) + length > self.num_tokens:
            bad = starts[(starts < 0) | (starts + length > self.num_tokens)]
            first = int(bad[0]) if bad.size else int(starts[0])
            raise IndexError(f"token range [{first}, {first + length}) outside [0, {self.num_tokens})")
        if length:
            self._gather(starts, length, out)
        return out

    def _gather(self, starts: np.ndarray, lengths: np.ndarray | int, out: np.ndarray,
                at: np.ndarray | None = None) -> None:
        """Checked ranges into ``out`` (lock held): the one read path. Range ``k`` is tokens
        ``[starts[k], starts[k] + lengths[k])`` (``lengths`` an int: all of that length) and
        goes to flat token offset ``at[k]`` (None: rows of ``lengths``, one after the other).

        A remote cache under a limit reads through its BoundedReader; otherwise each range is
        copied from the block it starts in (its memory map, or pread), with nothing else in the
        loop: a batch costs its copies. A range that runs into the next blocks (rare) goes on
        there (:meth:`_gather_across`).
        """
        item = self.dtype.itemsize
        if isinstance(lengths, int):
            if self._bounded is not None:
                if at is None:
                    at = np.arange(len(starts), dtype=np.int64) * lengths
                lengths = np.full(len(starts), lengths, dtype=np.int64)
            else:  # equal rows (the usual batch): no per-range arrays
                item_bytes = lengths * item
                sizes: Iterable[int] = itertools.repeat(item_bytes)
                dests: Iterable[int] = (range(0, len(starts) * item_bytes, item_bytes) if at is None
                                        else (at * item).tolist())
        if at is None and not isinstance(lengths, int):
            at = np.cumsum(lengths) - lengths
        if not isinstance(lengths, int) and not lengths.all():  # empty ranges read nothing
            keep = lengths > 0  # (and may start at the very end of the stream)
            starts, lengths, at = starts[keep], lengths[keep], at[keep]
        if self._bounded is not None:
            self._bounded.read_ranges(self._table, self.dtype, starts, lengths, out, at)
            return
        if not isinstance(lengths, int):
            sizes, dests = (lengths * item).tolist(), (at * item).tolist()
        self._copy(starts, sizes, dests, memoryview(out.reshape(-1).view(np.uint8)))

    def _copy(self, starts: np.ndarray, sizes: Iterable[int], dests: Iterable[int],
              view: memoryview) -> None:
        """Copy range ``k`` (token ``starts[k]``, ``sizes[k]`` bytes) to byte ``dests[k]`` of
        ``view`` (lock held): one copy out of the block it starts in (:func:`_copy_ranges`)."""
        blocks = self._token_starts.searchsorted(starts, side="right") - 1
        _copy_ranges(itertools.repeat(self), blocks.tolist(), starts.tolist(), sizes, dests, view,
                     self.dtype.itemsize)

    def _gather_across(self, b: int, position: int, dest: memoryview) -> None:
        """The rest of :meth:`_gather` for one range that starts in block b (at byte
        ``position`` of the global stream) and runs into the next blocks: a copy per block."""
        done = 0
        while done < len(dest):
            block = self._open.get(b) or self._open_block(b)
            block.used = True
            offset = block.base + position + done
            count = min(len(dest) - done, block.data_end - offset)
            part = dest[done:done + count]
            if block.map is not None:
                block.copy(part, block.map, offset)
            else:
                fmt.read_into(block.fd, part, offset, block.path, _TRUNCATED, "block file")
            done += count
            b += 1

    # ------------------------------------------------------------ remote caches under a limit
    @_locked
    def plan_reads(self, order: ReadOrder | Any | None, length: int | None = None) -> None:
        """Tell a remote cache with a ``cache_limit`` what this process reads next, in order, so it
        fetches ahead and keeps the blocks needed soonest (a no-op for other caches).

        ``order``: a :class:`torchcache.read.remote_reads.ReadOrder` (an endless order, e.g. a
        sampler's), or the token starts of the next reads (an array) with their ``length`` in
        tokens; None forgets the plan (eviction is then least recently used). Giving the order
        already planned changes nothing. :class:`torchcache.DataLoader` plans a
        :class:`torchcache.TokenDataset`'s reads in its sampler's order when it starts
        iterating (:meth:`torchcache.TokenDataset.plan_reads`); the plan travels with the cache
        into DataLoader workers.

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
        ``whole_block_bytes`` (block copies), ``ranged_reads`` and ``ranged_bytes`` (ranged
        requests for just the bytes of samples, coalesced), ``other_bytes`` (offsets, keys,
        tokenizer, arrays sidecars), ``hits`` (reads served from local copies), ``misses``
        (reads that needed remote bytes; ``prefetched``
        of them were fetched ahead), ``hit_rate``, ``evictions``, ``evicted_bytes``,
        ``refused_copies`` (blocks read by range because no room was worth making),
        ``verified_bytes`` (blocks downloaded whole once per machine before their first ranged
        read, to check them against their committed checksums),
        ``wasted_bytes`` (bytes between ranges that one coalesced request spanned, part of
        ``ranged_bytes``), ``local_bytes`` (the copy directory's size now) and ``cache_limit``.
        Hits and misses are counted only under a ``cache_limit``; a local cache reports zeros.

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
        totals["local_bytes"] = (tree_bytes(self.root, skip=(STATS_DIR,))
                                 if self._remote is not None else 0)
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

    @_locked
    def document_spans(self, indices: Any) -> np.ndarray:
        """:meth:`document_span` of each of documents ``indices``, as int64 [n, 2] (start, stop)
        rows, in one call (a few vectorised lookups per block, for a batch of documents).

        >>> cache.document_spans([3, 0]).tolist()  # doctest: +SKIP
        [[1840, 2011], [0, 219]]
        """
        idx = self._check_documents(indices)
        spans = np.empty((len(idx), 2), dtype=np.int64)
        blocks = np.searchsorted(self._doc_starts, idx, side="right") - 1
        for b in set(blocks.tolist()):
            where = blocks == b
            local = idx[where] - self._doc_starts[b]
            offsets, base = self.block_offsets(b), self._token_starts[b]
            spans[where, 0] = base + offsets[local]
            spans[where, 1] = base + offsets[local + 1]
        return spans

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

    def document_pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The documents overlapping global token range [start, stop), in order, as
        ``(document, a, b)``: tokens [a, b) *of that document* (0 = its first token), so that
        ``cache.document(d)[a:b]`` over the list concatenates to ``cache.read(start, stop)``.

        Reads only offsets sidecars (kept per block): O(log blocks) plus the documents spanned.
        Empty documents are left out (they hold no token of the range).

        >>> cache.document_pieces(200, 500)  # doctest: +SKIP
        [(0, 200, 212), (1, 0, 219), (2, 0, 69)]
        """
        start, stop = int_arg(start, "start", minimum=None), int_arg(stop, "stop", minimum=None)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens}): "
                             "give 0 <= start <= stop <= num_tokens")
        if start == stop:
            return []
        first = self.document_at(start)
        # where the range's documents begin (empty ones too: they repeat a position)
        bounds = [start, *self.document_starts_in(start, stop).tolist(), stop]
        begins = [self.document_span(first)[0], *bounds[1:-1]]
        return [(first + k, a - begin, b - begin)
                for k, (a, b, begin) in enumerate(zip(bounds, bounds[1:], begins)) if b > a]

    def document_key(self, i: int) -> str | None:
        """The source sample key of document i (webdataset `__key__`), or None if not recorded.

        A block's keys are read once and kept (for the last few blocks asked about).

        >>> cache.document_key(0)  # doctest: +SKIP
        'shard-000000/sample-0001'
        """
        i = self._check_document(i)
        b = self._document_block(i)
        if self._table.docs:  # format v3: the keys are in the documents sidecar, when it has them
            return self._block_docs(b).key_of(i - int(self._doc_starts[b]))
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

    # ------------------------------------------------------------ v3: loss masks, provenance
    @property
    def has_loss_mask(self) -> bool:
        """True for a cache built from chat, instruction or pre-tokenized records with a loss mask
        (format v3); in every other cache each token is trained."""
        return has_loss_mask(self.spec)

    @property
    def chat_template(self) -> str | None:
        """The chat template's text a "messages" cache was rendered with (None for others)."""
        return (self.spec.get("documents") or {}).get("chat_template")

    @_locked
    def _block_docs(self, b: int) -> BlockDocuments:
        """Block b's documents sidecar (v3 caches only), read once and kept for a while."""
        def load() -> BlockDocuments:
            n_docs, n_tokens = self._block_documents(b), self._block_tokens(b)
            path, fd = self._open_file(self._table.docs_path(b), self._table.checksum(b, "keys_checksum"),
                                       docs_max_size(n_docs, n_tokens))
            try:
                documents = self.spec["documents"]
                return read_docs_file(fd, path, n_docs, n_tokens, mask=documents["loss_mask"],
                                      fields=bool(documents["keep_fields"]),
                                      arrays=has_arrays(self.spec))
            finally:
                os.close(fd)
        return self._docs_cache.get_or_make(b, load)

    @property
    def array_fields(self) -> tuple[str, ...]:
        """The names of the arrays each document carries (() in a cache without arrays)."""
        return tuple(sorted((self.spec.get("documents") or {}).get("arrays") or ()))

    @_locked
    def document_arrays(self, i: int) -> dict[str, np.ndarray]:
        """Document i's arrays, field name -> numpy array in the record's shape ({} in a cache
        without arrays): read-only views of the block's memory-mapped arrays sidecar.

        >>> cache.document_arrays(0)["input_features"].shape  # doctest: +SKIP
        (412, 80)
        """
        i = self._check_document(i)
        if not self.array_fields:
            return {}
        b = self._document_block(i)
        return self._block_arrays(b).document(i - int(self._doc_starts[b]))

    def gather_arrays(self, indices: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The arrays of documents ``indices`` (negative ones count from the end), each field
        copied in one gather: field name -> (values, shapes), ``values`` the documents' values
        flattened end to end in a new writable array, ``shapes`` int64 [n, rank] (document k's
        array is its next ``shapes[k].prod()`` values, in that shape). {} in a cache without
        arrays (and for no indices while no block is committed: no layout is known yet).

        >>> values, shapes = cache.gather_arrays([3, 0])["input_features"]  # doctest: +SKIP
        >>> shapes.tolist(), values.size == shapes.prod(axis=1).sum()  # doctest: +SKIP
        ([[412, 80], [97, 80]], True)
        """
        return {name: (np.concatenate(views) if views else np.empty(0, dtype), shapes)
                for name, (views, shapes, dtype) in self.array_pieces(indices).items()}

    @_locked
    def array_pieces(self, indices: Any) -> dict[str, tuple[list[np.ndarray], np.ndarray, np.dtype]]:
        """The arrays of documents ``indices`` (negative ones count from the end) where they lie:
        field name -> (views, shapes, dtype), ``views[k]`` document k's values flattened (a
        read-only view of the memory-mapped sidecar, as :meth:`document_arrays` gives),
        ``shapes`` int64 [n, rank]. For a reader that copies a batch's arrays once, where it
        wants them (:class:`torchcache.DocumentDataset`: straight into the padded batch): a few
        vectorised lookups per block, no dict per document. {} as for :meth:`gather_arrays`.

        >>> views, shapes, dtype = cache.array_pieces([3, 0])["input_features"]  # doctest: +SKIP
        >>> views[1].reshape(shapes[1]).shape, dtype  # doctest: +SKIP
        ((97, 80), dtype('float32'))
        """
        idx = self._check_documents(indices)
        fields = self.array_fields
        if not fields or (not idx.size and not self.num_blocks):
            return {}
        blocks = np.searchsorted(self._doc_starts, idx, side="right") - 1
        groups = [(0, np.arange(0))] if not idx.size else \
            [(b, np.flatnonzero(blocks == b)) for b in sorted(set(blocks.tolist()))]
        out = {}
        for name in fields:
            pieces: list[Any] = [None] * len(idx)
            shapes, dtype = None, None
            for b, where in groups:
                views, block_shapes, dtype = self._block_arrays(b).pieces(
                    name, idx[where] - self._doc_starts[b])
                if shapes is None:
                    shapes = np.empty((len(idx), block_shapes.shape[1]), dtype=np.int64)
                shapes[where] = block_shapes
                for k, view in zip(where.tolist(), views):
                    pieces[k] = view
            out[name] = (pieces, shapes, dtype)
        return out

    def _check_documents(self, indices: Any) -> np.ndarray:
        """``indices`` as int64 document positions in [0, num_documents) (negative from the end);
        TypeError for non-integers, IndexError naming the first out of range."""
        idx = index_array(indices, "indices").reshape(-1)
        n = self.num_documents
        if idx.size and unsigned_max(idx) >= n:  # negative or past the end
            bad = idx[(idx >= n) | (idx < -n)]
            if bad.size:
                raise IndexError(f"document {int(bad[0])} outside [0, {n})")
            idx = np.where(idx < 0, idx + n, idx)
        return idx

    def _new_arrays_cache(self) -> LRUCache[BlockArrays]:
        """The blocks whose arrays sidecar this cache keeps mapped: few under a cache_limit,
        where each is a local copy that its mapping keeps from eviction."""
        return LRUCache(_MAX_MAPPED_COPIES if self._bounded is not None else _MAX_CACHED_DOCS)

    def _block_arrays(self, b: int) -> BlockArrays:
        """Block b's arrays sidecar, checked against the checksum its documents sidecar holds
        (with verify_checksums) and its structure (always), kept mapped for a while."""
        def load() -> BlockArrays:
            checksum = self._block_docs(b).arrays_sha256
            rel = arrays_name(self._table.path(b))
            if self._bounded is not None and checksum is not None:  # a copy under the limit
                got = self._bounded.open_sidecar(self._table, rel, checksum)
                path, fd = got if isinstance(got, tuple) else (f"{self.url}/{rel}", memory_file(got))
            else:
                path, fd = self._open_file(rel, checksum)
            try:
                return read_arrays_file(fd, path, self._block_documents(b), self.array_fields)
            finally:
                os.close(fd)
        return self._arrays_cache.get_or_make(b, load)

    @property
    def token_array_fields(self) -> tuple[str, ...]:
        """The per-token array fields (built with ``token_arrays=``): one row per token, read
        with the tokens by :meth:`token_arrays` (() in a cache without them)."""
        arrays = (self.spec.get("documents") or {}).get("arrays") or {}
        return tuple(sorted(name for name, d in arrays.items() if d.get("per_token")))

    def token_array_layout(self, name: str) -> tuple[np.dtype | None, tuple[int, ...]]:
        """(dtype, shape of one row) of per-token field `name`; the dtype is the declared one,
        else the first block's (None while a cache without a declared dtype has no block)."""
        if name not in self.token_array_fields:
            raise KeyError(f"{name!r} is not a per-token array field of the cache at {self.url} "
                           f"(its per-token fields: {list(self.token_array_fields)})")
        declared = self.spec["documents"]["arrays"][name]
        trailing = tuple(int(d) for d in declared["shape"][1:])
        if declared["dtype"] is not None:
            return np.dtype(declared["dtype"]), trailing
        if not self.num_blocks:
            return None, trailing
        return self._block_arrays(0).token_rows(name, self._block_tokens(0), trailing).dtype, trailing

    def token_arrays(self, name: str, starts: Any, length: int) -> np.ndarray:
        """Per-token field `name` for the token ranges [s, s + length) of `starts`, as a
        (rows, length, *row shape) array: the rows of `read_many`, for the field.

        >>> cache.token_arrays("weights", [0, 2048], 2048).shape  # doctest: +SKIP
        (2, 2048)
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int_arg(length, "length", minimum=0)
        dtype, trailing = self.token_array_layout(name)
        out = np.zeros((len(starts), length) + trailing, dtype=dtype or np.float32)
        return self.token_array_ranges(name, starts, np.full(len(starts), length),
                                       out, np.arange(0, len(starts) * length, length))

    @_locked
    def token_array_ranges(self, name: str, starts: Any, lengths: Any, out: np.ndarray,
                           out_offsets: Any) -> np.ndarray:
        """Set rows ``out_offsets[k]`` on of ``out`` (C-contiguous, seen as (-1, *row shape)) to
        per-token field `name` of tokens ``[starts[k], starts[k] + lengths[k])``: the array
        twin of :meth:`read_ranges`, crossing blocks as needed. Returns `out`."""
        _, trailing = self.token_array_layout(name)
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        out_offsets = np.asarray(out_offsets, dtype=np.int64).reshape(-1)
        if not out.flags.c_contiguous or out.shape[out.ndim - len(trailing):] != trailing:
            raise ValueError(f"out must be a C-contiguous array of rows of shape {list(trailing)}")
        if not len(starts):
            return out
        if starts.min() < 0 or lengths.min() < 0 or int((starts + lengths).max()) > self.num_tokens:
            raise IndexError(f"token ranges reach outside [0, {self.num_tokens})")
        rows = out.reshape((-1,) + trailing)
        for start, length, at in zip(starts.tolist(), lengths.tolist(), out_offsets.tolist()):
            while length > 0:
                b = int(np.searchsorted(self._token_starts, start, side="right")) - 1
                first, size = int(self._token_starts[b]), self._block_tokens(b)
                take = min(length, first + size - start)
                data = self._block_arrays(b).token_rows(name, size, trailing)
                rows[at: at + take] = data[start - first: start - first + take]
                start, at, length = start + take, at + take, length - take
        return out

    def loss_mask(self, start: int, stop: int) -> np.ndarray:
        """Which tokens of the global range [start, stop) are trained, as a bool array (all True
        in a cache without a loss mask)."""
        start, stop = int_arg(start, "start", minimum=0), int_arg(stop, "stop", minimum=0)
        if stop < start or stop > self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        return self.loss_masks(np.asarray([start], np.int64), stop - start)[0]

    @_locked
    def loss_masks(self, starts: Any, length: int) -> np.ndarray:
        """Trained flags of the ranges [s, s + length) for each s of `starts`, as a (rows, length)
        bool array: the rows of `read_many`, for the mask (all True without a loss mask)."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int_arg(length, "length", minimum=0)
        if not self.has_loss_mask:
            return np.ones((len(starts), length), dtype=bool)
        if len(starts) and (starts.min() < 0 or starts.max() + length > self.num_tokens):
            raise IndexError(f"token ranges of {length} tokens from {starts.min()} to "
                             f"{starts.max()} reach outside [0, {self.num_tokens})")
        return self._trained.flags(starts, length, self._token_starts, self._block_runs) \
            .reshape(len(starts), length)

    @_locked
    def loss_mask_ranges(self, starts: Any, lengths: Any, out: np.ndarray,
                         out_offsets: Any) -> np.ndarray:
        """Set ``out.reshape(-1)[out_offsets[k]:][:lengths[k]]`` to the trained flags of tokens
        ``[starts[k], starts[k] + lengths[k])``: the mask twin of :meth:`read_ranges` (all True
        without a loss mask). Returns `out`."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
        out_offsets = np.asarray(out_offsets, dtype=np.int64).reshape(-1)
        if not len(starts):
            return out
        if starts.min() < 0 or lengths.min() < 0 or int((starts + lengths).max()) > self.num_tokens:
            raise IndexError(f"token ranges reach outside [0, {self.num_tokens})")
        at = (out_offsets - (lengths.cumsum() - lengths)).repeat(lengths) + np.arange(int(lengths.sum()))
        flat = out.reshape(-1)
        if not self.has_loss_mask:
            flat[at] = True
        else:
            flat[at] = self._trained.flags(starts, lengths, self._token_starts, self._block_runs)
        return out

    def _block_runs(self, b: int) -> np.ndarray:
        """Block b's trained runs, (start, length) block-relative (what the runs table loads)."""
        return self._block_docs(b).runs

    def document_loss_mask(self, i: int) -> np.ndarray:
        """Which tokens of document i are trained (bool, the length of `document(i)`).

        >>> cache.document_loss_mask(0)[:6]  # doctest: +SKIP
        array([False, False, False, False,  True,  True])
        """
        start, stop = self.document_span(i)
        return self.loss_mask(start, stop)

    def document_info(self, i: int) -> dict[str, Any]:
        """Where document i came from: its input file, the 0-based index of its record there
        (line - 1 of a JSON lines file, row of a Parquet file, sample of a tar, item of an
        iterable), the fields kept with it, and its sample key where it has one. ``record`` is
        None only in caches built before records were kept, where it cannot be known (a text
        cache with blank or skipped records, see :mod:`torchcache.format.provenance`). A stored
        record past its input's record count is a CacheFormatError naming the sidecar.

        >>> cache.document_info(12)  # doctest: +SKIP
        {'document': 12, 'input': 'chats/part-0.jsonl', 'record': 12, 'fields': {'id': 'a7'}}
        """
        i = self._check_document(i)
        b = self._document_block(i)
        local, k = i - int(self._doc_starts[b]), self._table.input(b)
        info: dict[str, Any] = {"document": i, "input": self.spec["inputs"][k]["path"],
                                "record": None, "fields": {}}
        count = input_records(self._state.head, k)
        if self.spec.get("documents") is not None:
            docs = self._block_docs(b)
            info.update(record=int(docs.records[local]), fields=docs.fields_of(local))
            past_the_input(docs.path, info["record"], count, info["input"])
        else:
            (runs,) = self._runs_cache.get_or_make(b, lambda: (self._load_record_runs(b),))
            if runs is not None:
                info["record"] = record_at(runs, local)
                past_the_input(f"{self.url}/{self._table.offsets_path(b)}", info["record"], count,
                               info["input"])
            else:
                before, totals = self._input_documents()
                if derived_records_hold(self._state.head, k, int(totals[k])):
                    info["record"] = int(before[b]) + local
                    past_the_input(f"{self.url}/head.json", info["record"], count, info["input"])
        key = self.document_key(i)
        if key is not None:
            info["key"] = key
        return info

    def _input_documents(self) -> tuple[np.ndarray, np.ndarray]:
        """Per block, the documents of its input's earlier blocks, and per input its committed
        documents: made once per count of committed blocks (O(blocks)), so document_info costs
        O(1) on a cache of any size."""
        n = len(self._table.records)
        if self._input_docs is None or self._input_docs[0] != n:
            inputs = self._table.records["input"].astype(np.int64)
            counts = self._table.records["num_documents"].astype(np.int64)
            order = np.argsort(inputs, kind="stable")  # each input's blocks, in stream order
            exclusive = np.cumsum(counts[order]) - counts[order]
            first = np.searchsorted(inputs[order], inputs[order])  # its input's first block
            before = np.empty(n, dtype=np.int64)
            before[order] = exclusive - exclusive[first]
            totals = np.zeros(len(self.spec["inputs"]), dtype=np.int64)
            np.add.at(totals, inputs, counts)
            self._input_docs = (n, before, totals)
        return self._input_docs[1], self._input_docs[2]

    @_locked
    def _load_record_runs(self, b: int) -> np.ndarray | None:
        """Block b's record runs from its offsets sidecar (None: it stores none)."""
        path, fd = self._open_file(self._table.offsets_path(b),
                                   self._table.checksum(b, "offsets_checksum"),
                                   offsets_max_size(self._block_documents(b)))
        try:
            return load_record_runs(fd, path, self._block_documents(b))
        finally:
            os.close(fd)

    def document_lengths(self) -> np.ndarray:
        """Length in tokens of every document (reads all offset sidecars; for stats).

        >>> float(cache.document_lengths().mean())  # doctest: +SKIP
        101381.6
        """
        parts = [np.diff(self.block_offsets(b)) for b in range(self.num_blocks)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------ tokenizer
    @_locked
    def tokenizer(self) -> Tokenizer | TokenizerBackend:
        """The tokenizer the cache was built with (stored in the cache directory; loaded once): a
        ``tokenizers.Tokenizer``, or for a tiktoken or SentencePiece cache its backend (with
        ``encode(text) -> ids`` and ``decode(ids)``; its library must be installed).

        >>> cache.tokenizer().encode("hello").ids  # doctest: +SKIP
        [31373]
        """
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def _load_tokenizer(self) -> Tokenizer | TokenizerBackend:
        if self.spec["tokenizer"] is None:
            raise ValueError(f"{self.url} was converted from pre-tokenized data and has no "
                             "tokenizer; read token ids instead (e.g. `torchcache show --ids`)")
        if "kind" in self.spec["tokenizer"]:  # tiktoken, SentencePiece: the backend's own files
            files, paths = {}, {}
            for name in stored_file_names(self.spec["tokenizer"]):
                paths[name], files[name] = self._read_tokenizer_file(name)
            return cache_backend(self.spec["tokenizer"], files, paths.__getitem__)
        path, data = self._read_tokenizer_file(fmt.TOKENIZER_NAME)
        return cache_tokenizer(data, self.spec["tokenizer"]["fingerprint"], path)

    def _read_tokenizer_file(self, name: str) -> tuple[str, bytes]:
        """(path, bytes) of one of the cache's tokenizer files, capped in size."""
        path, fd = self._open_file(name, None)
        try:
            size = os.fstat(fd).st_size
            if size > fmt.MAX_TOKENIZER_BYTES:
                raise CacheFormatError(f"{path}: {size:,} bytes, more than the "
                                           f"{fmt.MAX_TOKENIZER_BYTES:,} allowed for a tokenizer")
            data = fmt.read_exact(fd, 0, size, path)
        finally:
            os.close(fd)
        return path, data

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of token ``ids`` (any sequence of ints: list, array, tensor), with the cache's tokenizer.

        The tokenizer is loaded on the first call and kept, so a call costs what the
        tokenizer's own decode costs.

        >>> cache.decode(cache.document(0)[:12])  # doctest: +SKIP
        'The Project Gutenberg eBook of Pride and Prejudice'
        """
        return self.tokenizer().decode([int(x) for x in ids], skip_special_tokens=skip_special_tokens)


def _copy_ranges(caches: Iterable[TokenCache], blocks: Iterable[int], starts: Iterable[int],
                 sizes: Iterable[int], dests: Iterable[int], view: memoryview, item: int) -> None:
    """The copy loop every read ends in (locks held): range ``k`` of ``caches[k]`` starts at
    token ``starts[k]`` in its block ``blocks[k]``; its ``sizes[k]`` bytes go to byte
    ``dests[k]`` of ``view``, in one copy out of that block's memory map (or one pread)."""
    for cache, b, start, size, dest in zip(caches, blocks, starts, sizes, dests):
        block = cache._open.get(b) or cache._open_block(b)
        block.used = True
        offset = block.base + start * item
        end = dest + size
        m = block.map
        if offset + size > block.data_end:  # runs into the next block
            cache._gather_across(b, start * item, view[dest:end])
        elif m is not None:  # the hot path: one copy out of the map
            block.copy(view[dest:end], m, offset)
        else:  # one pread, almost always whole; read_into finishes (or names) a short one
            part = view[dest:end]
            try:
                got = os.preadv(block.fd, (part,), offset)
            except OSError:
                got = 0
            if got != size:
                fmt.read_into(block.fd, part[got:], offset + got, block.path, _TRUNCATED, "block file")


def _end_reads(caches: list[TokenCache]) -> None:
    """``_end_read`` of every cache in ``caches``: each lock is released, even if closing a
    block of an earlier one fails."""
    try:
        caches[0]._end_read()
    finally:
        if len(caches) > 1:
            _end_reads(caches[1:])


def _rows_out(out: np.ndarray | None, rows: int, length: int, dtype: np.dtype) -> np.ndarray:
    """``out`` checked as a C-contiguous (rows, length) array of ``dtype``, or a new one."""
    if out is None:
        return np.empty((rows, max(length, 0)), dtype=dtype)
    if out.shape != (rows, length) or out.dtype != dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {dtype} array of shape ({rows}, {length})")
    return out


class RowPlan:
    """Rows of ``length`` tokens at fixed places of several caches of one dtype, checked and
    located once, then read in any subset, any number of times: row ``i`` is tokens
    ``[starts[i], starts[i] + length)`` of ``caches[which[i]]``.

    A mixture reads batch after batch from the same stretch of its schedule: planning that
    stretch once leaves each batch its copies (see the TokenCache example). Blocks are never
    rewritten, so a plan stays valid while the caches grow.
    """

    def __init__(self, caches: Sequence[TokenCache], which: Any, starts: Any, length: int):
        caches = list(caches)
        dtype = caches[0].dtype if caches else None
        if dtype is None or any(not isinstance(c, TokenCache) or c.dtype != dtype for c in caches):
            raise TypeError("caches must be a non-empty sequence of TokenCache of one token "
                            f"dtype (their rows share one array), got {caches!r}")
        which = index_array(which, "which").reshape(-1)
        starts = index_array(starts, "starts").reshape(-1)
        self.length = int_arg(length, "length")
        if len(which) != len(starts):
            raise ValueError(f"which and starts must have one entry per row, got {len(which)} and "
                             f"{len(starts)}")
        if which.size and unsigned_max(which) >= len(caches):
            raise IndexError(f"which must be in [0, {len(caches)}) (an index into caches)")
        blocks = np.empty(len(starts), dtype=np.int64)  # each row's block in its cache
        for k, cache in enumerate(caches):
            where = np.flatnonzero(which == k)
            part = starts[where]
            if part.size and unsigned_max(part) > cache.num_tokens - self.length:
                first = int(part[(part < 0) | (part > cache.num_tokens - self.length)][0])
                raise IndexError(f"token range [{first}, {first + self.length}) outside [0, "
                                 f"{cache.num_tokens}) of {cache.url}")  # (negatives are huge)
            blocks[where] = cache.block_token_starts().searchsorted(part, side="right") - 1
        self.caches, self.dtype, self.rows = caches, dtype, len(starts)
        self._which, self._starts = which, starts
        self._bounded = any(c._bounded is not None for c in caches)
        self._cache_of = [caches[k] for k in which.tolist()]
        self._block_of, self._start_of = blocks.tolist(), starts.tolist()

    def read(self, rows: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``rows`` of the plan (indices, or a slice: the cheapest way to read consecutive
        rows; default all, in order) into one (len(rows), length) array."""
        if rows is None:
            rows = slice(None)
        if isinstance(rows, slice):
            picked = range(self.rows)[rows]
        else:
            picked = index_array(rows, "rows").reshape(-1)
            if picked.size and unsigned_max(picked) >= self.rows:
                raise IndexError(f"rows must be in [0, {self.rows}) (the plan's rows)")
            picked = picked.tolist()
        out = _rows_out(out, len(picked), self.length, self.dtype)
        if not len(picked) or not self.length:
            return out
        for cache in self.caches:  # each cache's lock, as in its own reads
            cache._lock.acquire()
        try:
            if self._bounded:  # remote caches under a limit: each reads its rows its own way
                chosen = np.asarray(picked, dtype=np.int64)
                which = self._which[chosen]
                for k, cache in enumerate(self.caches):
                    where = np.flatnonzero(which == k)
                    if where.size:
                        cache._gather(self._starts[chosen[where]],
                                      np.full(where.size, self.length, dtype=np.int64), out,
                                      where * self.length)
                return out
            item = self.dtype.itemsize
            size = self.length * item
            cache_of, block_of, start_of = self._cache_of, self._block_of, self._start_of
            if isinstance(picked, range):  # consecutive rows: slices of the plan
                part = slice(picked.start, picked.stop, picked.step)
                rows_of = (cache_of[part], block_of[part], start_of[part])
            else:
                rows_of = ([cache_of[r] for r in picked], [block_of[r] for r in picked],
                           [start_of[r] for r in picked])
            _copy_ranges(*rows_of, itertools.repeat(size),
                         range(0, len(picked) * size, size),
                         memoryview(out.reshape(-1).view(np.uint8)), item)
        finally:
            _end_reads(self.caches)
        return out


def gather_rows(caches: Sequence[TokenCache], which: Any, starts: Any, length: int,
                out: np.ndarray | None = None) -> np.ndarray:
    """Rows of ``length`` tokens from several caches of one dtype, in one array: row ``i`` =
    tokens ``[starts[i], starts[i] + length)`` of ``caches[which[i]]``.

    :meth:`TokenCache.read_many` over several caches, in one call: a :class:`RowPlan` read once.
    """
    return RowPlan(caches, which, starts, length).read(out=out)
