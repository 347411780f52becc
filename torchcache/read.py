"""TokenCache: read a cache's token stream and documents with pread, never loading it into RAM."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from . import format as fmt
from .storage import TMP_MARK, RemoteStorage, is_remote, open_storage

_MAX_OPEN_FILES = 64
_MAX_CACHED_OFFSETS = 64


def _locked(method):
    """Run a method under the cache's lock: one thread must not close a file another reads."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return wrapper


class _Block:
    """An open block file: its descriptor and where its tokens start."""

    __slots__ = ("fd", "data_start", "length")

    def __init__(self, fd: int, data_start: int, length: int):
        self.fd, self.data_start, self.length = fd, data_start, length


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
        url = os.fspath(path)
        self.verify_checksums = verify_checksums
        self._files: OrderedDict[int, _Block] = OrderedDict()
        self._offsets: OrderedDict[int, np.ndarray] = OrderedDict()
        self._pid = os.getpid()
        self._lock = threading.RLock()
        if is_remote(url):
            self._remote: RemoteStorage | None = RemoteStorage(url, storage_options or {})
            self.url = self._remote.url
            manifest = fmt.read_manifest(self._remote)
            base = local_dir or os.environ.get("TORCHCACHE_LOCAL_DIR") or os.path.join(
                os.path.expanduser("~"), ".cache", "torchcache", "remote")
            self.root = os.path.abspath(os.path.join(base, manifest["fingerprint"]))
        else:
            self._remote = None
            self.root = self.url = open_storage(url).url
            manifest = fmt.read_manifest(self.root)
        self._load(manifest)

    # ------------------------------------------------------------ manifest
    def _load(self, manifest: dict[str, Any]) -> None:
        self.spec: dict[str, Any] = manifest["spec"]
        self.complete: bool = bool(manifest["complete"])
        self.fingerprint: str = manifest["fingerprint"]
        self.skipped: dict[str, int] = dict(manifest.get("skipped", {}))
        blocks = manifest["blocks"]
        self._paths = [(b["path"], b["offsets"]) for b in blocks]
        self._checksums = [(b["checksum"], b["offsets_checksum"]) for b in blocks]
        self._keys = [(b["keys"], b["keys_checksum"]) if "keys" in b else None for b in blocks]
        self._inputs = [self.spec["inputs"][b["input"]]["path"] for b in blocks]
        for path, offsets in self._paths:
            fmt.safe_join(self.root, path)
            fmt.safe_join(self.root, offsets)
        for keys in self._keys:
            if keys is not None:
                fmt.safe_join(self.root, keys[0])
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
        state["_files"] = OrderedDict()
        state["_offsets"] = OrderedDict()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()
        self._lock = threading.RLock()

    @_locked
    def close(self) -> None:
        for block in self._files.values():
            os.close(block.fd)
        self._files.clear()

    def __del__(self) -> None:
        try:
            if getattr(self, "_pid", None) == os.getpid():
                self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ block access
    def _block(self, b: int) -> _Block:
        if self._pid != os.getpid():  # forked: the parent's descriptors are shared, start afresh
            self._files, self._offsets, self._pid = OrderedDict(), OrderedDict(), os.getpid()
        block = self._files.get(b)
        if block is not None:
            self._files.move_to_end(b)
            return block
        block = self._open_block(b)
        self._files[b] = block
        if len(self._files) > _MAX_OPEN_FILES:
            _, old = self._files.popitem(last=False)
            os.close(old.fd)
        return block

    def _open_block(self, b: int) -> _Block:
        path = self._file(self._paths[b][0], self._checksums[b][0])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise fmt.CacheFormatError(f"{path}: block file is missing; run `torchcache verify "
                                       f"{self.url}`") from None
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                header = fmt.read_tensor_header(f, path, "tokens", os.fstat(fd).st_size)
            expected = int(self._token_starts[b + 1] - self._token_starts[b])
            if header.length != expected or header.dtype != self.dtype:
                raise fmt.CacheFormatError(
                    f"{path}: holds {header.length} {header.dtype} tokens, the manifest says "
                    f"{expected} {self.dtype}; the block is corrupted or from another cache")
        except BaseException:
            os.close(fd)
            raise
        return _Block(fd, header.data_start, header.length)

    def _file(self, rel: str, checksum: str | None) -> str:
        """Local path of a cache file; for a remote cache, copied here once and verified first."""
        path = fmt.safe_join(self.root, rel)
        if self._remote is None:
            if self.verify_checksums and checksum is not None:
                self._verify_file(path, checksum)
            return path
        if not os.path.exists(path):
            _download(self._remote, rel, path, checksum)
        return path

    @staticmethod
    def _verify_file(path: str, checksum: str) -> None:
        try:
            actual = fmt.file_checksum(path)
        except FileNotFoundError:
            raise fmt.CacheFormatError(f"{path}: file is missing") from None
        if actual != checksum:
            raise fmt.CacheFormatError(f"{path}: checksum mismatch (the file is corrupted); "
                                       "rebuild the cache")

    @_locked
    def block_offsets(self, b: int) -> np.ndarray:
        """Cumulative document offsets of block b (n_docs + 1 int64, local to the block)."""
        cached = self._offsets.get(b)
        if cached is not None:
            self._offsets.move_to_end(b)
            return cached
        path = self._file(self._paths[b][1], self._checksums[b][1])
        try:
            offsets = fmt.read_tensor_file(path, "offsets")
        except FileNotFoundError:
            raise fmt.CacheFormatError(f"{path}: offsets file is missing") from None
        n_docs = int(self._doc_starts[b + 1] - self._doc_starts[b])
        n_tokens = int(self._token_starts[b + 1] - self._token_starts[b])
        if len(offsets) != n_docs + 1 or offsets[0] != 0 or offsets[-1] != n_tokens:
            raise fmt.CacheFormatError(f"{path}: offsets do not match the manifest (corrupted)")
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
        while pos < stop:
            block = self._block(b)
            local = pos - int(self._token_starts[b])
            count = min(stop, int(self._token_starts[b + 1])) - pos
            dest = view[(pos - start) * item:(pos - start + count) * item]
            got = os.preadv(block.fd, [dest], block.data_start + local * item)
            if got != count * item:
                self._read_fully(block, dest, got, block.data_start + local * item, b)
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
        for row, (b, offset, simple) in enumerate(zip(blocks.tolist(), offsets.tolist(),
                                                      inside.tolist())):
            if not simple:
                start = int(starts[row])
                self.read(start, start + length, out=out[row])
                continue
            block = self._block(b)
            dest = flat[row * nbytes:(row + 1) * nbytes]
            got = os.preadv(block.fd, [dest], block.data_start + offset)
            if got != nbytes:
                self._read_fully(block, dest, got, block.data_start + offset, b)
        return out

    def _read_fully(self, block: _Block, dest: memoryview, got: int, offset: int, b: int) -> None:
        while got < len(dest):
            n = os.preadv(block.fd, [dest[got:]], offset + got)
            if n == 0:
                raise fmt.CacheFormatError(f"{self._paths[b][0]}: unexpected end of block file "
                                           "(truncated?); run `torchcache verify`")
            got += n

    def _check_document(self, i: int) -> int:
        i = int(i)
        if i < 0:
            i += self.num_documents
        if not 0 <= i < self.num_documents:
            raise IndexError(f"document {i} outside [0, {self.num_documents})")
        return i

    def document_span(self, i: int) -> tuple[int, int]:
        """Global token range [start, stop) of document i."""
        i = self._check_document(i)
        b = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
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

    def document_key(self, i: int) -> str | None:
        """The source sample key of document i (webdataset `__key__`), or None if not recorded."""
        i = self._check_document(i)
        b = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        if self._keys[b] is None:
            return None
        path = self._file(*self._keys[b])
        import json
        try:
            with open(path, "rb") as f:
                keys = json.loads(f.read())
        except (OSError, ValueError) as e:
            raise fmt.CacheFormatError(f"{path}: unreadable keys file ({e})") from None
        if not isinstance(keys, list) or len(keys) != self._doc_starts[b + 1] - self._doc_starts[b]:
            raise fmt.CacheFormatError(f"{path}: keys do not match the manifest (corrupted)")
        return keys[i - int(self._doc_starts[b])]

    def trace(self, token: int) -> dict[str, Any]:
        """Where global token position `token` came from: document, its key and input file."""
        doc = self.document_at(int(token))
        start, stop = self.document_span(doc)
        b = int(np.searchsorted(self._doc_starts, doc, side="right")) - 1
        manifest_input = self._inputs[b]
        return {"document": doc, "key": self.document_key(doc), "input": manifest_input,
                "document_tokens": (start, stop), "offset_in_document": int(token) - start}

    def document_lengths(self) -> np.ndarray:
        """Length in tokens of every document (reads all offset sidecars; for stats)."""
        parts = [np.diff(self.block_offsets(b)) for b in range(self.num_blocks)]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)

    # ------------------------------------------------------------ tokenizer
    def tokenizer(self):
        """The tokenizer the cache was built with (stored in the cache directory)."""
        from tokenizers import Tokenizer
        if self.spec["tokenizer"] is None:
            raise ValueError(f"{self.url} was converted from pre-tokenized data and has no "
                             "tokenizer; read token ids instead (e.g. `torchcache show --ids`)")
        return Tokenizer.from_file(self._file(fmt.TOKENIZER_NAME, None))

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


def verify_cache(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                 local_dir: str | None = None) -> list[str]:
    """Recompute every checksum and header check; return one message per bad file (empty = ok).

    For a remote cache, files are checked as they are copied locally (a bad one is reported).
    """
    cache = TokenCache(path, storage_options=storage_options, local_dir=local_dir)
    problems, bad = [], set()
    manifest = fmt.read_manifest(cache._remote or cache.root)
    for entry in manifest["blocks"] + manifest.get("pending", []):
        files = [(entry["path"], entry["checksum"]), (entry["offsets"], entry["offsets_checksum"])]
        if "keys" in entry:
            files.append((entry["keys"], entry["keys_checksum"]))
        for rel, checksum in files:
            try:
                TokenCache._verify_file(cache._file(rel, checksum), checksum)
            except fmt.CacheFormatError as e:
                problems.append(str(e))
                bad.add(rel)
    for b, (block, offsets) in enumerate(cache._paths):
        if block in bad or offsets in bad:
            continue
        try:  # intact files that disagree with the manifest's counts or dtype
            cache._block(b)
            cache.block_offsets(b)
        except fmt.CacheFormatError as e:
            problems.append(str(e))
    cache.close()
    return problems
