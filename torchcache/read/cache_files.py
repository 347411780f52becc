"""The files of one cache, opened safely: where they are, and each one checked against the manifest.

A cache is read from its local directory, or from local copies of a remote cache's files
(downloaded once per machine, verified by checksum, named by it, and checked again when
reused). Every file is opened through format.CacheDir (regular files inside the cache
directory only, sizes capped before reading),
and a block's header, offsets and keys are checked against their manifest entry: O(1) per
block, no checksums unless asked. Anything wrong is a CacheFormatError naming the file.
:class:`torchcache.TokenCache` reads through this module, and so does :func:`torchcache.check_cache`.
"""

from __future__ import annotations

import faulthandler
import fcntl
import json
import os
import sys
import tempfile
import types
from typing import Any, Callable

import numpy as np

from ..format import blocks as fmt
from ..errors import CacheFormatError
from ..format.provenance import RUNS_TENSOR, check_runs
from .local_copies import (SessionStats, copy_name, discard_copy, fetch_verified, mark_verified,
                           trusted_copy)
from ..format.storage import TMP_MARK, LocalStorage, RemoteStorage, Storage, is_remote, open_storage

__all__ = ["CacheFiles", "check_block_file", "load_keys", "load_offsets", "load_record_runs",
           "locate_cache", "memory_file",
           "named_map_copy", "offsets_max_size"]


def _copy_from_map(dest: memoryview, source: memoryview, offset: int) -> None:
    dest[:] = source[offset:offset + len(dest)]


def named_map_copy(path: str) -> Callable[[memoryview, memoryview, int], None]:
    """``copy(dest, source, offset)``: fill ``dest`` from ``source``, a memoryview of the memory
    map of block file ``path`` (one copy), in a function whose code is named after the file.

    A mapped file cut short under its reader by another program (or a failing disk) ends the
    process with a bus error (SIGBUS) in the middle of the copy: nothing can be raised then, and
    no Python handler can run. faulthandler (enabled here, chained to any handler installed
    before it) prints the stack at that moment, and this frame's "file" is the block file, so
    the process's last words name it.
    """
    _report_faults()
    code = _copy_from_map.__code__.replace(co_filename=path, co_name="read_memory_mapped_block",
                                           co_qualname="read_memory_mapped_block",
                                           co_firstlineno=0)  # its one line: "line 1"
    return types.FunctionType(code, _copy_from_map.__globals__, "read_memory_mapped_block")


def _report_faults() -> None:
    """Enable faulthandler (stack on SIGBUS/SIGSEGV) to stderr, unless something already did."""
    if faulthandler.is_enabled():
        return
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.enable(file=stream)
            return
        except (AttributeError, ValueError, OSError, RuntimeError):  # no usable descriptor
            continue


class CacheFiles:
    """Where a cache's files are read from: a local directory, or local copies of a remote cache.

    >>> files = locate_cache("runs/quickstart/cache", None, None)  # doctest: +SKIP
    >>> path, fd = files.open("blocks/000000-000000.safetensors", None, verify=False)  # doctest: +SKIP
    """

    def __init__(self, url: str, root: str, remote: RemoteStorage | None, in_memory: bool = False,
                 stats: SessionStats | None = None):
        self.url, self.root, self.remote = url, root, remote
        self.dir = fmt.CacheDir(root)
        # where the manifest and commits are read: the remote cache itself, or the directory
        self.metadata: Storage = remote if remote is not None else LocalStorage(root)
        # A remote cache read under a cache_limit: its small files (offsets, keys, tokenizer) are
        # read into memory, never copied (the copy directory holds only blocks, within the limit).
        self.in_memory = in_memory
        self.stats = stats  # counts downloads (remote caches)

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "root": self.root, "remote": self.remote,
                "in_memory": self.in_memory, "stats": self.stats}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["root"], state["remote"], state.get("in_memory", False),
                      state.get("stats"))

    def open(self, rel: str, checksum: str | None, verify: bool,
             max_size: int | None = None) -> tuple[str, int]:
        """(path, descriptor) of a regular file of the cache; remote files are copied here first
        (verified by checksum), or with ``in_memory`` read into an anonymous in-memory file (the
        path is then the URL). With `verify`, a local file's checksum is recomputed, unless it is
        larger than `max_size` (refused before it is read: hashing gigabytes proves nothing); a
        remote file is then checked on the store itself, not only in a copy made earlier."""
        if self.remote is not None:
            if self.in_memory or checksum is None:  # a copy is only ever named by its checksum
                return self._open_in_memory(rel, checksum, max_size)
            copy = copy_name(rel, checksum)
            found = _open_trusted(self.dir, copy, checksum)
            if found is not None and verify:
                try:  # the store may have changed since the copy was made
                    fetch_verified(self.remote, rel, checksum, max_size=max_size)
                except BaseException:
                    os.close(found[1])
                    raise
            if found is not None:
                return found
            _download(self.remote, rel, self.dir.path(copy), checksum, self.stats)
            rel = copy
        try:
            path, fd = self.dir.open(rel)
        except FileNotFoundError:
            raise CacheFormatError(
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

    def _open_in_memory(self, rel: str, checksum: str | None,
                        max_size: int | None) -> tuple[str, int]:
        """A remote file read whole (verified by checksum) into an anonymous file in memory."""
        data = fetch_verified(self.remote, rel, checksum, max_size=max_size)
        if self.stats is not None:
            self.stats.add_many({"bytes_downloaded": len(data), "other_bytes": len(data)})
            self.stats.flush()
        return f"{self.url}/{rel}", memory_file(data)


def memory_file(data: bytes) -> int:
    """A descriptor of a file in memory holding ``data`` (a remote file read whole, verified):
    what a file read from a local copy would be, with no copy on disk."""
    fd = _anonymous_file()
    try:
        view, done = memoryview(data), 0
        while done < len(view):
            done += os.pwrite(fd, view[done:], done)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _anonymous_file() -> int:
    """A read-write descriptor of a file that lives only in memory (or, without memfd, an
    unnamed temporary file), gone when it is closed."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("torchcache", getattr(os, "MFD_CLOEXEC", 0))
    with tempfile.TemporaryFile() as f:  # pragma: no cover - systems without memfd
        return os.dup(f.fileno())


def _check_size(fd: int, path: str, max_size: int | None) -> None:
    size = os.fstat(fd).st_size
    if max_size is not None and size > max_size:
        raise CacheFormatError(f"{path}: {size:,} bytes, more than the {max_size:,} its manifest "
                               "entry allows: the file is corrupted or replaced; repair it "
                               "with `torchcache verify --repair`")


def offsets_max_size(num_documents: int) -> int:
    """The largest the offsets sidecar of a block of ``num_documents`` documents can be: its
    safetensors header (capped), one int64 start per document plus the end, and at most one
    (record, count) run per document (see :mod:`torchcache.format.provenance`).

    >>> offsets_max_size(0) - offsets_max_size(1)
    -24
    """
    return 8 + fmt.MAX_HEADER_BYTES + 8 * (num_documents + 1) + 16 * num_documents


def _check_checksum(fd: int, path: str, checksum: str) -> None:
    if fmt.fd_checksum(fd) != checksum:
        raise CacheFormatError(f"{path}: checksum mismatch (the file is corrupted); repair it "
                               "with `torchcache verify --repair`")


def locate_cache(url: str, storage_options: dict[str, Any] | None,
                 local_dir: str | None) -> CacheFiles:
    """The files of the cache at `url` (its manifest and commits are read through
    ``files.metadata``, see `ledger`).

    A remote cache's block files are copied on demand under ``local_dir`` (default
    ``$TORCHCACHE_LOCAL_DIR`` or ``~/.cache/torchcache/remote``), in a folder named by its
    fingerprint.
    """
    if not is_remote(url):
        root = open_storage(url).url
        return CacheFiles(root, root, None)
    remote = RemoteStorage(url, storage_options or {})
    manifest, _, path = fmt.load_manifest(remote)
    fingerprint = manifest.get("fingerprint")
    if not isinstance(fingerprint, str) or not fmt.is_fingerprint(fingerprint):
        raise CacheFormatError(f"{path}: fingerprint {fingerprint!r} is malformed; the manifest is "
                               "corrupted")
    base = local_dir or os.environ.get("TORCHCACHE_LOCAL_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torchcache", "remote")
    return CacheFiles(remote.url, os.path.abspath(os.path.join(base, fingerprint)), remote)


# ---------------------------------------------------------------- per-file checks (O(1) per block)

def check_block_file(fd: int, path: str, dtype: np.dtype, num_tokens: int, size: int) -> int:
    """Check an open block file against its manifest entry; the offset where its tokens start."""
    file_size = os.fstat(fd).st_size
    if file_size != size:
        raise CacheFormatError(
            f"{path}: file is {file_size} bytes, the manifest says {size}: the block is truncated "
            "or replaced; run `torchcache verify`, which can repair it")
    header = fmt.read_tensor_header(fd, path, "tokens", file_size)
    if header.length != num_tokens or header.dtype != dtype:
        raise CacheFormatError(
            f"{path}: holds {header.length} {fmt.dtype_name(header.dtype)} tokens, the manifest says "
            f"{num_tokens} {fmt.dtype_name(dtype)}; the block is corrupted or from another cache")
    return header.data_start


def load_offsets(fd: int, path: str, num_documents: int, num_tokens: int) -> np.ndarray:
    """A block's document offsets, checked against its manifest entry before and after reading."""
    size = os.fstat(fd).st_size
    header = fmt.read_tensors_header(fd, path, ("offsets",), (RUNS_TENSOR,), size)["offsets"]
    if header.dtype != fmt.DTYPES["I64"] or header.length != num_documents + 1:
        raise CacheFormatError(
            f"{path}: holds {header.length} {fmt.dtype_name(header.dtype)} offsets, the manifest says "
            f"{num_documents} documents ({num_documents + 1} I64 offsets): the sidecar or the manifest "
            "is corrupted; run `torchcache verify`")
    offsets = fmt.read_tensor_data(fd, path, header)
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise CacheFormatError(
            f"{path}: offsets run from {offsets[0]} to {offsets[-1]}, the block has {num_tokens} "
            "tokens (corrupted); run `torchcache verify`")
    if not (offsets[1:] >= offsets[:-1]).all():
        first = int(np.argmax(offsets[1:] < offsets[:-1]))
        raise CacheFormatError(f"{path}: offsets decrease after document {first} (corrupted); "
                               "run `torchcache verify`")
    return offsets


def load_record_runs(fd: int, path: str, num_documents: int) -> np.ndarray | None:
    """A block's record runs ((record, count) rows, checked against its document count), or None
    when its offsets sidecar has none (its records follow from the index, where they are known)."""
    headers = fmt.read_tensors_header(fd, path, ("offsets",), (RUNS_TENSOR,), os.fstat(fd).st_size)
    header = headers.get(RUNS_TENSOR)
    if header is None:
        return None

    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{path}: {what}; the offsets sidecar is corrupted (run "
                                "`torchcache verify --repair`)")
    if header.dtype != fmt.DTYPES["I64"] or header.length > 2 * num_documents:
        raise bad(f"{RUNS_TENSOR} holds {header.length} {fmt.dtype_name(header.dtype)} values, at "
                  f"most {2 * num_documents} I64 for {num_documents} documents")
    return check_runs(fmt.read_tensor_data(fd, path, header), num_documents, bad)


def load_keys(fd: int, path: str, num_documents: int) -> list[str | None]:
    """A block's document keys, checked against its manifest entry."""
    size = os.fstat(fd).st_size
    if size > fmt.MAX_KEYS_BYTES:
        raise CacheFormatError(f"{path}: {size:,} bytes, more than the {fmt.MAX_KEYS_BYTES:,} "
                               "allowed for a keys file (corrupted)")
    try:
        keys = json.loads(fmt.read_exact(fd, 0, size, path))
    except (ValueError, RecursionError) as e:
        raise CacheFormatError(f"{path}: unreadable keys file ({e}); run `torchcache verify`") from None
    if (not isinstance(keys, list) or len(keys) != num_documents
            or not all(k is None or isinstance(k, str) for k in keys)):
        raise CacheFormatError(f"{path}: keys do not match the manifest (corrupted); "
                               "run `torchcache verify`")
    return keys


# ---------------------------------------------------------------- remote copies

def _open_trusted(folder: fmt.CacheDir, rel: str, checksum: str) -> tuple[str, int] | None:
    """(path, descriptor) of the local copy ``rel`` if it is there and holds the bytes of
    ``checksum`` (see :func:`torchcache.read.local_copies.trusted_copy`), else None."""
    try:
        path, fd = folder.open(rel)
    except FileNotFoundError:
        return None
    try:
        if trusted_copy(fd, path, checksum):
            return path, fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _download(storage: RemoteStorage, rel: str, path: str, checksum: str,
              stats: SessionStats | None = None, attempts: int = 3) -> None:
    """Copy one remote file to `path` (named by its checksum), verified, once per machine.

    An flock on a sibling lock file makes DataLoader workers and ranks that need the same file
    wait for one download instead of repeating it; the copy is renamed into place only once
    complete and verified, so nobody ever reads a partial one. A copy found damaged is deleted
    and downloaded again. (No size limit here: see :mod:`torchcache.read.local_copies` for copies
    under a cache_limit.)
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        found = _open_trusted(fmt.CacheDir(os.path.dirname(path)), os.path.basename(path), checksum)
        if found is not None:
            os.close(found[1])
            return
        if os.path.exists(path):  # damaged
            discard_copy(path)
        data = fetch_verified(storage, rel, checksum, attempts)
        tmp = f"{path}{TMP_MARK}{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
            mark_verified(f.fileno(), path)  # after the rename, which changes its ctime
    if stats is not None:
        block = rel.endswith(".safetensors") and not rel.endswith(".offsets.safetensors")
        stats.add_many({"bytes_downloaded": len(data), "whole_block_downloads": int(block),
                        "whole_block_bytes": len(data) if block else 0,
                        "other_bytes": 0 if block else len(data)})
        stats.flush()
