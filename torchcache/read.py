"""TokenCache: read a cache's token stream and documents with pread, never loading it into RAM.

Reading a damaged or hostile cache is safe: the manifest is fully validated when read (fields,
block names, stream order); every file is opened through format.CacheDir (regular files inside
the cache directory only, sizes capped before reading); a block's header and a block's offsets
are checked against the manifest when first opened (O(1) per block, no checksums). Anything
wrong is a CacheFormatError (or an OSError) naming the file.

Open block files are shared by all TokenCaches of a process in one bounded pool (see
_OpenBlocks), so many caches (a mixture of 20 sources) never exhaust the descriptor limit.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from . import format as fmt
from .storage import TMP_MARK, RemoteStorage, is_remote, open_storage

_MAX_OPEN_BLOCKS = 128  # block files open at once in a process, all TokenCaches together
_MAX_CACHED_OFFSETS = 64


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


class _Block:
    """An open block file: its descriptor, where its tokens start, and who owns it."""

    __slots__ = ("fd", "data_start", "path", "index", "owner", "used")

    def __init__(self, fd: int, data_start: int, path: str, index: int, owner: weakref.ref):
        self.fd, self.data_start, self.path, self.index, self.owner = fd, data_start, path, index, owner
        self.used = True  # CLOCK bit: set on every use, cleared by the eviction sweep


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
    After fork the child closes the inherited descriptors and starts with an empty pool; every
    cache re-opens lazily. Fork waits for the pool lock, so the child's table is consistent.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.RLock()
        self.blocks: OrderedDict[_Block, None] = OrderedDict()
        self.dead: list[_Block] = []  # blocks of collected caches, closed at the next add()
        self.caches: weakref.WeakSet[TokenCache] = weakref.WeakSet()

    def register(self, cache: "TokenCache") -> None:
        with self.lock:
            self.caches.add(cache)

    def add(self, block: _Block) -> None:
        """Track a newly opened block; close the least recently used ones above the limit."""
        with self.lock:
            while self.dead:
                self.discard(self.dead.pop())
            self.blocks[block] = None
            while len(self.blocks) > self.limit:
                self._evict_one()

    def _evict_one(self) -> None:
        while True:
            victim, _ = self.blocks.popitem(last=False)
            if not victim.used:
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
        self.blocks.pop(block, None)
        self.close(block)

    @staticmethod
    def close(block: _Block) -> None:
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
        self.blocks, self.dead = OrderedDict(), []
        for block in inherited:
            self.close(block)


_POOL = _OpenBlocks(_MAX_OPEN_BLOCKS)
os.register_at_fork(before=_POOL.before_fork, after_in_parent=_POOL.after_fork_in_parent,
                    after_in_child=_POOL.after_fork_in_child)


class _Source:
    """Where a cache's files are read from: a local directory, or local copies of a remote cache."""

    def __init__(self, url: str, root: str, remote: RemoteStorage | None):
        self.url, self.root, self.remote = url, root, remote
        self.dir = fmt.CacheDir(root)

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "root": self.root, "remote": self.remote}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["root"], state["remote"])

    def open(self, rel: str, checksum: str | None, verify: bool,
             max_size: int | None = None) -> tuple[str, int]:
        """(path, descriptor) of a regular file of the cache; remote files are copied here first
        (verified by checksum). With `verify`, a local file's checksum is recomputed, unless it is
        larger than `max_size` (refused before it is read: hashing gigabytes proves nothing)."""
        if self.remote is not None:
            path = self.dir.path(rel)
            if not os.path.exists(path):
                _download(self.remote, rel, path, checksum)
        try:
            path, fd = self.dir.open(rel)
        except FileNotFoundError:
            raise fmt.CacheFormatError(
                f"{os.path.join(self.root, rel)}: file is missing; the cache is damaged: run "
                f"`torchcache verify {self.url}` to list every bad file, then rebuild it") from None
        if verify and checksum is not None:
            try:
                _check_size(fd, path, max_size)
                _check_checksum(fd, path, checksum)
            except BaseException:
                os.close(fd)
                raise
        return path, fd


def _check_size(fd: int, path: str, max_size: int | None) -> None:
    size = os.fstat(fd).st_size
    if max_size is not None and size > max_size:
        raise fmt.CacheFormatError(f"{path}: {size:,} bytes, more than the {max_size:,} its manifest "
                                   "entry allows: the file is corrupted or replaced; repair it "
                                   "with `torchcache verify --repair`")


def _max_sizes(entry: dict[str, Any]) -> tuple[int, int, int]:
    """The largest a block entry's block, offsets and keys files can be."""
    offsets = 8 + fmt._MAX_HEADER + 8 * (entry["num_documents"] + 1)
    return entry["size"], offsets, fmt.MAX_KEYS_BYTES


def _check_checksum(fd: int, path: str, checksum: str) -> None:
    if fmt.fd_checksum(fd) != checksum:
        raise fmt.CacheFormatError(f"{path}: checksum mismatch (the file is corrupted); repair it "
                                   "with `torchcache verify --repair`")


def _locate(url: str, storage_options: dict[str, Any] | None, local_dir: str | None,
            check_order: bool = True) -> tuple[_Source, dict[str, Any]]:
    """The files and the (validated) manifest of the cache at `url`."""
    if not is_remote(url):
        root = open_storage(url).url
        return _Source(root, root, None), fmt.read_manifest(root, check_order=check_order)
    remote = RemoteStorage(url, storage_options or {})
    manifest = fmt.read_manifest(remote, check_order=check_order)
    base = local_dir or os.environ.get("TORCHCACHE_LOCAL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torchcache", "remote")
    root = os.path.abspath(os.path.join(base, manifest["fingerprint"]))  # 32 hex digits: checked
    return _Source(remote.url, root, remote), manifest


# ---------------------------------------------------------------- per-file checks (O(1) per block)

def _check_block_file(fd: int, path: str, dtype: np.dtype, num_tokens: int, size: int) -> int:
    """Check an open block file against its manifest entry; the offset where its tokens start."""
    file_size = os.fstat(fd).st_size
    if file_size != size:
        raise fmt.CacheFormatError(
            f"{path}: file is {file_size} bytes, the manifest says {size}: the block is truncated "
            "or replaced; run `torchcache verify`, which can repair it")
    header = fmt.read_tensor_header(fd, path, "tokens", file_size)
    if header.length != num_tokens or header.dtype != dtype:
        raise fmt.CacheFormatError(
            f"{path}: holds {header.length} {fmt.dtype_name(header.dtype)} tokens, the manifest says "
            f"{num_tokens} {fmt.dtype_name(dtype)}; the block is corrupted or from another cache")
    return header.data_start


def _load_offsets(fd: int, path: str, num_documents: int, num_tokens: int) -> np.ndarray:
    """A block's document offsets, checked against its manifest entry before and after reading."""
    header = fmt.read_tensor_header(fd, path, "offsets", os.fstat(fd).st_size)
    if header.dtype != fmt._DTYPES["I64"] or header.length != num_documents + 1:
        raise fmt.CacheFormatError(
            f"{path}: holds {header.length} {fmt.dtype_name(header.dtype)} offsets, the manifest says "
            f"{num_documents} documents ({num_documents + 1} I64 offsets): the sidecar or the manifest "
            "is corrupted; run `torchcache verify`")
    offsets = fmt.read_tensor_data(fd, path, header)
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise fmt.CacheFormatError(
            f"{path}: offsets run from {offsets[0]} to {offsets[-1]}, the block has {num_tokens} "
            "tokens (corrupted); run `torchcache verify`")
    if not (offsets[1:] >= offsets[:-1]).all():
        first = int(np.argmax(offsets[1:] < offsets[:-1]))
        raise fmt.CacheFormatError(f"{path}: offsets decrease after document {first} (corrupted); "
                                   "run `torchcache verify`")
    return offsets


def _load_keys(fd: int, path: str, num_documents: int) -> list[str | None]:
    """A block's document keys, checked against its manifest entry."""
    size = os.fstat(fd).st_size
    if size > fmt.MAX_KEYS_BYTES:
        raise fmt.CacheFormatError(f"{path}: {size:,} bytes, more than the {fmt.MAX_KEYS_BYTES:,} "
                                   "allowed for a keys file (corrupted)")
    try:
        keys = json.loads(fmt.read_exact(fd, 0, size, path))
    except (ValueError, RecursionError) as e:
        raise fmt.CacheFormatError(f"{path}: unreadable keys file ({e}); run `torchcache verify`") from None
    if (not isinstance(keys, list) or len(keys) != num_documents
            or not all(k is None or isinstance(k, str) for k in keys)):
        raise fmt.CacheFormatError(f"{path}: keys do not match the manifest (corrupted); "
                                   "run `torchcache verify`")
    return keys


# ---------------------------------------------------------------- the reader

class TokenCache:
    """A built (or still building) cache: its global token stream and its documents.

    Safe to share between threads (e.g. a prefetch thread and the training loop).

    The global token stream is the blocks' tokens in manifest order. Block files are opened
    lazily in each process and read with pread, so nothing is copied into RAM beyond what is
    asked for; pickling a TokenCache (for DataLoader workers) sends only the path and a few small
    arrays. `refresh()` picks up blocks committed since it was opened.
    """

    def __init__(self, path: str | os.PathLike, *, verify_checksums: bool = False,
                 storage_options: dict[str, Any] | None = None, local_dir: str | None = None):
        self.verify_checksums = verify_checksums
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified: set[str] = set()
        self._init_process_state()
        self._source, manifest = _locate(os.fspath(path), storage_options, local_dir)
        self.url, self.root = self._source.url, self._source.root
        self._remote = self._source.remote
        self._load(manifest)

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

    # ------------------------------------------------------------ manifest
    def _load(self, manifest: dict[str, Any]) -> None:
        self.spec: dict[str, Any] = manifest["spec"]
        self.complete: bool = manifest["complete"]
        self.fingerprint: str = manifest["fingerprint"]
        self.skipped: dict[str, int] = dict(manifest.get("skipped", {}))
        blocks = manifest["blocks"]
        self._paths = [(b["path"], b["offsets"]) for b in blocks]
        self._checksums = [(b["checksum"], b["offsets_checksum"]) for b in blocks]
        self._keys = [(b["keys"], b["keys_checksum"]) if "keys" in b else None for b in blocks]
        self._inputs = [self.spec["inputs"][b["input"]]["path"] for b in blocks]
        self._sizes = np.array([b["size"] for b in blocks], dtype=np.int64)
        self._token_starts = np.zeros(len(blocks) + 1, dtype=np.int64)
        np.cumsum([b["num_tokens"] for b in blocks], out=self._token_starts[1:])
        self._doc_starts = np.zeros(len(blocks) + 1, dtype=np.int64)
        np.cumsum([b["num_documents"] for b in blocks], out=self._doc_starts[1:])
        self.dtype = fmt._DTYPES[self.spec["dtype"]]

    @_locked
    def refresh(self) -> bool:
        """Re-read the manifest; True if new blocks were committed since the last look."""
        manifest = fmt.read_manifest(self._remote or self.root)
        if manifest["fingerprint"] != self.fingerprint:
            raise fmt.CacheFormatError(f"{self.url}: the cache was replaced by a different one "
                                       "while it was open; reopen it")
        known = len(self._paths)
        new_paths = [(b["path"], b["offsets"]) for b in manifest["blocks"][:known]]
        if new_paths != self._paths:
            raise fmt.CacheFormatError(f"{self.url}: committed blocks changed under the reader; "
                                       "the cache was rebuilt while open; reopen it")
        grew = len(manifest["blocks"]) > known or manifest["complete"] != self.complete
        self._load(manifest)
        return grew

    @property
    def num_tokens(self) -> int:
        return int(self._token_starts[-1])

    @property
    def num_documents(self) -> int:
        return int(self._doc_starts[-1])

    @property
    def num_blocks(self) -> int:
        return len(self._paths)

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size (None for pre-tokenized data converted without one)."""
        return self.spec["vocab_size"]

    @property
    def eos_id(self) -> int | None:
        return self.spec["eos_id"]

    @property
    def bos_id(self) -> int | None:
        return self.spec["bos_id"]

    def block_token_starts(self) -> np.ndarray:
        """Global token offset where each block starts, plus the total at the end."""
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
        state["_offsets"] = OrderedDict()
        state["_verified"] = set()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_process_state()

    @_locked
    def close(self) -> None:
        """Close this cache's open block files now (they are also closed when it is collected)."""
        with _POOL.lock:
            for block in self._open.values():
                _POOL.discard(block)
            self._open.clear()
            self._doomed.clear()

    def __del__(self) -> None:
        # No locks here (the collector may run inside the pool's own critical section): the pool
        # closes these blocks at its next add(); until then they count against its limit.
        blocks = getattr(self, "_open", None)
        if blocks and _POOL is not None:  # None only while the interpreter shuts down
            _POOL.dead.extend(blocks.values())

    # ------------------------------------------------------------ block access
    def _open_block(self, b: int) -> _Block:
        """Open block b (checked against the manifest) and add it to the process's pool."""
        rel, checksum = self._paths[b][0], self._checksums[b][0]
        path, fd = self._open_file(rel, checksum, int(self._sizes[b]))
        try:
            start = _check_block_file(fd, path, self.dtype, self._block_tokens(b), int(self._sizes[b]))
        except BaseException:
            os.close(fd)
            raise
        block = _Block(fd, start, path, b, self._ref)
        self._open[b] = block
        _POOL.add(block)
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
        """Cumulative document offsets of block b (n_docs + 1 int64, local to the block)."""
        cached = self._offsets.get(b)
        if cached is not None:
            self._offsets.move_to_end(b)
            return cached
        n_docs = self._block_documents(b)
        path, fd = self._open_file(self._paths[b][1], self._checksums[b][1],
                                   8 + fmt._MAX_HEADER + 8 * (n_docs + 1))
        try:
            offsets = _load_offsets(fd, path, n_docs, self._block_tokens(b))
        finally:
            os.close(fd)
        self._offsets[b] = offsets
        if len(self._offsets) > _MAX_CACHED_OFFSETS:
            self._offsets.popitem(last=False)
        return offsets

    # ------------------------------------------------------------ reading
    @_locked
    def read(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, stop) of the global stream (crossing blocks), in the cache's dtype."""
        start, stop = int(start), int(stop)
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"token range [{start}, {stop}) outside [0, {self.num_tokens})")
        if out is None:
            out = np.empty(stop - start, dtype=self.dtype)
        b = int(np.searchsorted(self._token_starts, start, side="right")) - 1
        pos = start
        view = memoryview(out.view(np.uint8))
        item = self.dtype.itemsize
        opened = self._open
        while pos < stop:
            block = opened.get(b) or self._open_block(b)
            block.used = True
            local = pos - int(self._token_starts[b])
            count = min(stop, int(self._token_starts[b + 1])) - pos
            dest = view[(pos - start) * item:(pos - start + count) * item]
            offset = block.data_start + local * item
            try:
                got = os.preadv(block.fd, [dest], offset)
            except OSError as e:
                raise OSError(e.errno, f"{block.path}: {e.strerror}") from e
            if got != count * item:
                self._read_fully(block, dest, got, offset)
            pos += count
            b += 1
        return out

    @_locked
    def read_many(self, starts: np.ndarray, length: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows ``out[i]`` = tokens ``[starts[i], starts[i] + length)``: many equal reads in one call.

        The same as calling :meth:`read` per row, with the block lookup vectorised and one pread
        per row that lies inside one block (a row crossing blocks goes through :meth:`read`).
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
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
        item = self.dtype.itemsize
        nbytes = length * item
        blocks = np.searchsorted(self._token_starts, starts, side="right") - 1
        inside = starts + length <= self._token_starts[blocks + 1]
        offsets = (starts - self._token_starts[blocks]) * item
        flat = memoryview(out.reshape(-1).view(np.uint8))
        opened = self._open
        for row, (b, offset, simple) in enumerate(zip(blocks.tolist(), offsets.tolist(),
                                                      inside.tolist())):
            if not simple:
                start = int(starts[row])
                self.read(start, start + length, out=out[row])
                continue
            block = opened.get(b) or self._open_block(b)
            block.used = True
            dest = flat[row * nbytes:(row + 1) * nbytes]
            try:
                got = os.preadv(block.fd, [dest], block.data_start + offset)
            except OSError as e:
                raise OSError(e.errno, f"{block.path}: {e.strerror}") from e
            if got != nbytes:
                self._read_fully(block, dest, got, block.data_start + offset)
        return out

    @staticmethod
    def _read_fully(block: _Block, dest: memoryview, got: int, offset: int) -> None:
        while got < len(dest):
            n = os.preadv(block.fd, [dest[got:]], offset + got)
            if n == 0:
                raise fmt.CacheFormatError(f"{block.path}: unexpected end of block file "
                                           "(truncated?); run `torchcache verify`")
            got += n

    def _check_document(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self.num_documents
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} outside [0, {self.num_documents})")
        return i

    def _document_block(self, i: int) -> int:
        return int(np.searchsorted(self._doc_starts, i, side="right")) - 1

    def document_span(self, i: int) -> tuple[int, int]:
        """Global token range [start, stop) of document i."""
        i = self._check_document(i)
        b = self._document_block(i)
        offsets = self.block_offsets(b)
        local = i - int(self._doc_starts[b])
        base = int(self._token_starts[b])
        return base + int(offsets[local]), base + int(offsets[local + 1])

    def document_at(self, token: int) -> int:
        """Index of the document containing global token position `token`."""
        if not 0 <= token < self.num_tokens:
            raise IndexError(f"token {token} outside [0, {self.num_tokens})")
        b = int(np.searchsorted(self._token_starts, token, side="right")) - 1
        local = int(np.searchsorted(self.block_offsets(b), token - int(self._token_starts[b]),
                                    side="right")) - 1
        return int(self._doc_starts[b]) + local

    def document(self, i: int) -> np.ndarray:
        """The i-th document in stream order, as stored (with its BOS/EOS), as int64."""
        start, stop = self.document_span(i)
        return self.read(start, stop).astype(np.int64)

    def document_starts_in(self, start: int, stop: int) -> np.ndarray:
        """Global token positions in (start, stop) where a document begins (int64, sorted)."""
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

    @_locked
    def document_key(self, i: int) -> str | None:
        """The source sample key of document i (webdataset `__key__`), or None if not recorded."""
        i = self._check_document(i)
        b = self._document_block(i)
        if self._keys[b] is None:
            return None
        path, fd = self._open_file(*self._keys[b], fmt.MAX_KEYS_BYTES)
        try:
            keys = _load_keys(fd, path, self._block_documents(b))
        finally:
            os.close(fd)
        return keys[i - int(self._doc_starts[b])]

    def trace(self, token: int) -> dict[str, Any]:
        """Where global token position `token` came from: document, its key and input file."""
        doc = self.document_at(int(token))
        start, stop = self.document_span(doc)
        manifest_input = self._inputs[self._document_block(doc)]
        return {"document": doc, "key": self.document_key(doc), "input": manifest_input,
                "document_tokens": (start, stop), "offset_in_document": int(token) - start}

    def document_lengths(self) -> np.ndarray:
        """Length in tokens of every document (reads all offset sidecars; for stats)."""
        parts = [np.diff(self.block_offsets(b)) for b in range(self.num_blocks)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------ tokenizer
    @_locked
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the cache was built with (stored in the cache directory; loaded once)."""
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
                raise fmt.CacheFormatError(f"{path}: {size:,} bytes, more than the "
                                           f"{fmt.MAX_TOKENIZER_BYTES:,} allowed for a tokenizer")
            data = fmt.read_exact(fd, 0, size, path)
        finally:
            os.close(fd)
        try:
            return Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers reports a bad file as a plain Exception
            raise fmt.CacheFormatError(f"{path}: not a valid tokenizer.json ({e}); restore the "
                                       "tokenizer the cache was built with") from e

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tokenizer().decode([int(x) for x in ids], skip_special_tokens=skip_special_tokens)


def _download(storage: RemoteStorage, rel: str, path: str, checksum: str | None,
              attempts: int = 3) -> None:
    """Copy one remote file to `path`, verified by checksum, exactly once per machine.

    An flock on a sibling lock file makes DataLoader workers and ranks that need the same file
    wait for one download instead of repeating it; the copy is renamed into place only once
    complete and verified, so nobody ever reads a partial one.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if os.path.exists(path):
            return
        problem = ""
        for attempt in range(attempts):
            try:
                data = storage.read(rel)
            except FileNotFoundError:
                raise fmt.CacheFormatError(f"{storage.url}/{rel}: missing from the remote cache; "
                                           "run `torchcache verify` on it") from None
            except Exception as e:  # network trouble: try again, then report it
                problem = f"{type(e).__name__}: {e}"
                time.sleep(0.2 * (attempt + 1))
                continue
            actual = "sha256:" + hashlib.sha256(data).hexdigest()
            if checksum is not None and actual != checksum:
                problem = f"checksum mismatch (got {actual[:19]}..., manifest says {checksum[:19]}...)"
                continue
            tmp = f"{path}{TMP_MARK}{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            return
        raise fmt.CacheFormatError(f"{storage.url}/{rel}: download failed {attempts} times "
                                   f"({problem}); the remote file is corrupted or unreachable")


# ---------------------------------------------------------------- verify

@dataclass(frozen=True)
class Problem:
    """One problem found by :func:`check_cache`.

    `entry` is the index of the damaged block entry in ``manifest["blocks"] +
    manifest.get("pending", [])`` (None for a cache-wide problem: the manifest itself, the stream
    order); `file` is the damaged file's path relative to the cache directory.
    """

    message: str
    entry: int | None = None
    file: str | None = None


def check_cache(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                local_dir: str | None = None) -> list[Problem]:
    """Check a whole cache: the manifest, the stream order, every file's checksum, and for intact
    files their headers, offsets and keys against the manifest. An empty list means all is well.

    For a remote cache, files are checked as they are copied locally (a bad one is reported).
    A directory without a manifest raises FileNotFoundError (it is not a cache).
    """
    url = os.fspath(path)
    try:
        source, manifest = _locate(url, storage_options, local_dir, check_order=False)
    except fmt.CacheFormatError as e:
        return [Problem(str(e), None, fmt.MANIFEST_NAME)]
    problems = []
    order = fmt.stream_order_problem(manifest)
    if order is not None:
        problems.append(Problem(f"{source.url}/{fmt.MANIFEST_NAME}: {order}; the manifest was edited "
                                "or corrupted (restore it or rebuild the cache)", None, fmt.MANIFEST_NAME))
    dtype = fmt._DTYPES[manifest["spec"]["dtype"]]
    for k, entry in enumerate(manifest["blocks"] + manifest.get("pending", [])):
        problems.extend(_check_entry(source, k, entry, dtype))
    return problems


def _check_entry(source: _Source, k: int, entry: dict[str, Any], dtype: np.dtype) -> list[Problem]:
    """Problems of one block entry's files: checksums first, then (if intact) their contents."""
    files = [(entry["path"], entry["checksum"]), (entry["offsets"], entry["offsets_checksum"])]
    if "keys" in entry:
        files.append((entry["keys"], entry["keys_checksum"]))
    problems, opened = [], []
    try:
        for (rel, checksum), max_size in zip(files, _max_sizes(entry)):
            try:
                opened.append(source.open(rel, checksum, verify=True, max_size=max_size))
            except fmt.CacheFormatError as e:
                problems.append(Problem(str(e), k, rel))
        if problems:
            return problems
        checks = [lambda fd, path: _check_block_file(fd, path, dtype, entry["num_tokens"], entry["size"]),
                  lambda fd, path: _load_offsets(fd, path, entry["num_documents"], entry["num_tokens"]),
                  lambda fd, path: _load_keys(fd, path, entry["num_documents"])]
        for (rel, _), (path, fd), check in zip(files, opened, checks):
            try:
                check(fd, path)
            except fmt.CacheFormatError as e:
                problems.append(Problem(str(e), k, rel))
        return problems
    finally:
        for _, fd in opened:
            os.close(fd)


def verify_cache(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                 local_dir: str | None = None) -> list[str]:
    """Recompute every checksum and header check; return one message per problem (empty = ok).

    Each message names the file; :func:`check_cache` gives the same as structured Problems.
    """
    return [p.message for p in check_cache(path, storage_options, local_dir)]
