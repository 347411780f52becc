"""Where a cache lives: a local directory, or any fsspec URL (s3://, gs://, memory://...).

Local files are written under a temporary name, fsynced and renamed. Object stores have no atomic
rename, so there each file is written in one put; a block only becomes visible to readers through
the manifest, which is itself written in one put, last.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import socket
import stat
import sys
import threading
import time
import uuid
from typing import Any, Iterable

import fsspec

from ..errors import CacheFormatError

TMP_MARK = ".tmp-"


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
             (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def open_regular(path: str) -> int:
    """A read-only descriptor of `path`, refusing anything but a regular file.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer, and the fstat
    check refuses FIFOs, devices (/dev/zero never ends) and directories, so a planted special file
    gives an error naming it instead of a hang. O_NONBLOCK has no effect on regular files.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CacheFormatError(f"{path}: is {_file_kind(mode)}, not a regular file; a cache holds "
                                   "only regular files (replace it, or rebuild the cache)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str, limit: int) -> bytes:
    """The whole of a regular file, refused before reading if it is larger than `limit` bytes."""
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CacheFormatError(f"{path}: {size:,} bytes, more than the {limit:,} allowed for this "
                                   "file; it is corrupted or not part of a torchcache cache")
        data = f.read(size + 1)  # one byte more notices a file that grew meanwhile
    if len(data) > limit:
        raise CacheFormatError(f"{path}: grew past {limit:,} bytes while read; refusing it")
    return data


def is_remote(url: str | os.PathLike) -> bool:
    url = os.fspath(url)
    return "://" in url and not url.startswith("file://")


def open_storage(url: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> "Storage":
    url = os.fspath(url)
    if is_remote(url):
        return RemoteStorage(url, storage_options or {})
    if url.startswith("file://"):
        url = url[len("file://"):]
    return LocalStorage(os.path.abspath(url))


class Storage:
    """The few file operations a cache needs, by path relative to the cache root."""

    url: str

    def write(self, rel: str, parts: Iterable[bytes | memoryview]) -> tuple[int, str]:
        """Write a whole file so that it appears complete or not at all; (size, sha256 checksum)."""
        raise NotImplementedError

    def write_json(self, rel: str, obj: Any) -> None:
        data = json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n"
        self.write(rel, [data])

    def read(self, rel: str) -> bytes:
        raise NotImplementedError

    def extend(self, rel: str, keep: int, data: bytes) -> None:
        """Make file `rel` hold `data`, whose first `keep` bytes it already holds (or `keep` is 0).

        Locally only the new bytes are written, in place, and made durable: readers never look
        past what a commit point (head.json) says is there, so the tail may be torn by a crash.
        Object stores cannot append: there the whole of `data` is written again, in one put.
        """
        raise NotImplementedError

    def sync_dir(self, rel: str) -> None:
        """Make the names created in directory `rel` durable (a no-op where renames are atomic)."""

    def exists(self, rel: str) -> bool:
        raise NotImplementedError

    def listdir(self, rel: str) -> list[str]:
        """File names directly inside `rel` (empty if it does not exist)."""
        raise NotImplementedError

    def delete(self, rel: str) -> None:
        raise NotImplementedError

    def lock(self) -> "Lock":
        raise NotImplementedError


def _digest(parts: list) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    for part in parts:
        digest.update(part)
        size += len(part)
    return size, "sha256:" + digest.hexdigest()


_DIGEST_THREAD_BYTES = 4 << 20  # parts at least this large are hashed while they are written


def _digest_meanwhile(parts: list) -> Any:
    """``_digest(parts)`` as a function to call once they are written: for large parts (an arrays
    sidecar of a few MB...) computed meanwhile in a thread (hashlib releases the GIL), so that
    hashing overlaps the writes and the fsync instead of following them; the thread's error, if
    any, is raised by the call."""
    if sum(len(part) for part in parts) < _DIGEST_THREAD_BYTES:
        return lambda: _digest(parts)
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["digest"] = _digest(parts)
        except BaseException as e:  # noqa: BLE001 - raised by result(), in the writer's thread
            out["error"] = e

    thread = threading.Thread(target=run, name="torchcache-digest", daemon=True)
    thread.start()

    def result() -> tuple[int, str]:
        thread.join()
        if "error" in out:
            raise out["error"]
        return out["digest"]
    return result


class LocalStorage(Storage):
    def __init__(self, root: str):
        self.root = self.url = root

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def write(self, rel: str, parts: Iterable[bytes | memoryview]) -> tuple[int, str]:
        parts = list(parts)
        digest = _digest_meanwhile(parts)
        final = self._path(rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = f"{final}{TMP_MARK}{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            if rel in COMMIT_POINTS:  # it makes blocks visible: their renames must be durable first
                blocks = self._path(BLOCK_DIR)
                if os.path.isdir(blocks):
                    _fsync_dir(blocks)
            os.replace(tmp, final)
        except OSError as e:  # a full disk, say: leave no partial file behind, name the file
            _remove_quietly(tmp)
            if e.filename is None:
                raise type(e)(e.errno, e.strerror, final) from e
            raise
        except BaseException:
            _remove_quietly(tmp)
            raise
        if rel in COMMIT_POINTS:
            _fsync_dir(self.root)
        return digest()

    def extend(self, rel: str, keep: int, data: bytes) -> None:
        path = self._path(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if os.fstat(fd).st_size < keep:
                raise OSError(f"{path}: holds {os.fstat(fd).st_size} bytes, fewer than the {keep} "
                              "already committed; the cache is damaged, run `torchcache verify`")
            os.ftruncate(fd, keep)
            view = memoryview(data)[keep:]
            while view:
                written = os.pwrite(fd, view, keep)
                view, keep = view[written:], keep + written
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_dir(self, rel: str) -> None:
        _fsync_dir(self._path(rel))

    def read(self, rel: str, limit: int | None = None) -> bytes:
        """A whole regular file (never a FIFO or device), refused if larger than `limit` bytes."""
        return read_regular(self._path(rel), sys.maxsize if limit is None else limit)

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def listdir(self, rel: str) -> list[str]:
        path = self._path(rel)
        return sorted(os.listdir(path)) if os.path.isdir(path) else []

    def delete(self, rel: str) -> None:
        try:
            os.unlink(self._path(rel))
        except FileNotFoundError:
            pass

    def makedirs(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def lock(self) -> "Lock":
        return _FileLock(os.path.join(self.root, ".lock"))


#: URL schemes of object stores, whose first path component is a bucket (no folders).
BUCKET_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def missing_bucket(fs: Any, url: str) -> str | None:
    """The bucket of object-store ``url`` when the store says it does not exist; None when it
    exists, when ``url`` is not on an object store, or when this reader may not look at the
    bucket itself (writes into it may still work)."""
    scheme, _, path = url.partition("://")
    bucket = path.partition("/")[0]
    if scheme not in BUCKET_SCHEMES or not bucket:
        return None
    try:
        fs.info(bucket)
    except FileNotFoundError:
        return bucket
    except PermissionError:
        return None
    return None


class RemoteStorage(Storage):
    """A cache under an fsspec URL; `storage_options` go to the filesystem (credentials...)."""

    def __init__(self, url: str, storage_options: dict[str, Any]):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options)
        self._connect()

    def _connect(self) -> None:
        self._fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self._pid = os.getpid()
        _reuse_parsed_models(self._fs)

    @property
    def fs(self):
        """The filesystem, re-created after a fork (clients like s3fs are not fork-safe)."""
        if self._pid != os.getpid():
            self._connect()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["url"], state["storage_options"])

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def write(self, rel: str, parts: Iterable[bytes | memoryview]) -> tuple[int, str]:
        parts = [bytes(p) for p in parts]
        self.fs.pipe_file(self._path(rel), b"".join(parts))  # one put: whole or nothing
        return _digest(parts)

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self._path(rel))

    def extend(self, rel: str, keep: int, data: bytes) -> None:
        self.write(rel, [data])

    def read_range(self, rel: str, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of a file, in one ranged request (fewer if the file is shorter)."""
        return self.fs.cat_file(self._path(rel), start=start, end=stop)

    def open_pinned(self, rel: str, tag: str | None = None) -> "PinnedObject | None":
        """File `rel` as it is now (one metadata request), every later ranged read pinned to
        this version of it: see :class:`PinnedObject`. With ``tag`` (a :attr:`PinnedObject.tag`
        seen before): that version, with no request at all; None where this store cannot pin a
        read to a tag (the caller then opens it without one)."""
        if tag is None:
            return PinnedObject(self, rel)
        return PinnedObject.from_tag(self, rel, tag)

    def exists(self, rel: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self._path(rel))

    def listdir(self, rel: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self._path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rpartition("/")[2] for e in entries)

    def delete(self, rel: str) -> None:
        try:
            self.fs.rm_file(self._path(rel))
        except FileNotFoundError:
            pass

    def makedirs(self) -> None:
        """Make the cache's folder; on an object store (no folders) check that its bucket
        exists instead: fsspec's makedirs would silently create a misspelled bucket."""
        if self.url.partition("://")[0] not in BUCKET_SCHEMES:
            self.fs.makedirs(self.root, exist_ok=True)
            return
        bucket = missing_bucket(self.fs, self.url)
        if bucket is not None:
            raise FileNotFoundError(f"{self.url}: bucket {bucket!r} does not exist; create it "
                                    "first, or check the URL (and the store's endpoint in "
                                    "storage_options)")

    def lock(self) -> "Lock":
        return _LeaseLock(self)


#: the last s3fs filesystems connected in this process (or, in a forked one, in its parent):
#: where a new one finds API models already parsed (kept alive: a fork's copies are read only)
_S3_FILESYSTEMS: list[Any] = []


def _reuse_parsed_models(fs: Any) -> None:
    """Make s3fs filesystem ``fs``, when new, create its client from the API models another one
    of this process, or of its parent (a DataLoader worker is a fork of the training process),
    already parsed. Each new process otherwise parses botocore's JSON descriptions of S3 again
    before its first request (0.1 to 0.3 s of CPU in every worker of every epoch, while the
    training loop waits for its first batches). Only the loader of those files is shared (no
    connection, credentials or event loop); other filesystems are left alone."""
    if not _conditional(fs) or any(known is fs for known in _S3_FILESYSTEMS):
        return
    _S3_FILESYSTEMS[:] = _S3_FILESYSTEMS[-3:] + [fs]
    if getattr(fs, "session", False) is not None:
        return  # (it has its own session already)
    for known in reversed(_S3_FILESYSTEMS):
        session = getattr(known, "session", None)
        if session is not None:  # an aiobotocore session: a new one of the same kind, as s3fs
            fresh = type(session)(**fs.kwargs)  # makes it, with the parsed files' loader
            fresh.register_component("data_loader", session.get_component("data_loader"))
            fs.session = fresh
            return


class ObjectChangedError(OSError):
    """A remote file is no longer the version a reader pinned: it was replaced or rewritten."""


# Stores whose files pin their ranged reads to the version seen at open (s3fs sends If-Match
# with the ETag, so a read of another version fails instead of returning its bytes).
_PINNING_PROTOCOLS = {"s3", "s3a"}
_IDENTITY_FIELDS = ("ETag", "etag", "VersionId", "generation", "md5Hash", "version_id")
_TIME_FIELDS = ("LastModified", "mtime", "last_modified", "updated", "created")
_TAG_SAFE = re.compile(r"[0-9A-Za-z_-]{1,80}")  # ETags that can be part of a file name


def _conditional(fs: Any) -> bool:
    """Whether ranged reads of ``fs`` can be pinned to a version by the store itself."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return bool(_PINNING_PROTOCOLS & set(protocols))


def object_identity(info: dict[str, Any]) -> str:
    """A version tag of a remote file from its fsspec ``info()``: its ETag, generation or
    version where the store has one, else its size and modification time."""
    found = [f"{k}={info[k]}" for k in _IDENTITY_FIELDS if info.get(k) not in (None, "")]
    if not found:
        found = [f"{k}={info[k]}" for k in _TIME_FIELDS if info.get(k) not in (None, "")][:1]
    return ";".join([f"size={info.get('size')}"] + found)


class PinnedObject:
    """One remote file, read by range, every read checked to come from the version seen when
    it was opened (``identity``); a read of any other version raises ObjectChangedError.

    Where the store supports conditional reads (S3: If-Match on the ETag) the check is part of
    the read itself; elsewhere the file's identity is looked up again after each read (a
    version that was replaced and then put back between the two is the only miss).
    Safe to share between threads: reads keep no position.
    """

    def __init__(self, storage: RemoteStorage, rel: str, known: tuple[int, str] | None = None):
        self.url = f"{storage.url}/{rel}"
        self._storage, self._path = storage, storage._path(rel)
        fs = storage.fs
        self._conditional = _conditional(fs)
        if self._conditional and known is not None:  # the version seen before: no request
            size, etag = known
            file = fs.open(self._path, "rb", cache_type="none", size=size)
            file.details = {"name": self._path, "size": size, "ETag": etag, "type": "file"}
            if not getattr(fs, "local_expiry_check", False):  # (else s3fs compares the ETag)
                file.read_kw = {**file.read_kw, "IfMatch": etag}
            info, self._fetch = file.details, file.cache.fetcher
        elif self._conditional:  # s3fs: a file opened for reading sends If-Match on every read
            fs.invalidate_cache(self._path)
            file = fs.open(self._path, "rb", cache_type="none")
            info, self._fetch = file.details, file.cache.fetcher  # (start, stop) -> bytes
        else:
            fs.invalidate_cache(self._path)
            info = fs.info(self._path)
            self._fetch = lambda start, stop: storage.read_range(rel, start, stop)
        self.size = int(info["size"])
        self.identity = object_identity(info)
        etag = str(info.get("ETag") or "").strip('"')
        #: a file-name-safe string naming this version, from which :meth:`from_tag` pins a read
        #: to it without a metadata request (conditional reads only; else None)
        self.tag = (f"{self.size}-{etag}" if self._conditional and _TAG_SAFE.fullmatch(etag)
                    and not getattr(fs, "version_aware", False) else None)

    @classmethod
    def from_tag(cls, storage: RemoteStorage, rel: str, tag: str) -> "PinnedObject | None":
        """File ``rel`` pinned to the version a :attr:`tag` names, with no request (a read of
        any other version raises ObjectChangedError, as for every pinned file); None where
        the store cannot pin reads to it (no conditional reads, a version-aware filesystem) or
        ``tag`` is not a tag."""
        size, _, etag = tag.partition("-")
        fs = storage.fs
        if (not size.isdigit() or not _TAG_SAFE.fullmatch(etag) or not _conditional(fs)
                or getattr(fs, "version_aware", False)):
            return None
        return cls(storage, rel, known=(int(size), f'"{etag}"'))

    def read_range(self, start: int, stop: int) -> bytes:
        """Bytes [start, stop) of the pinned version (fewer where the file ends)."""
        stop = min(stop, self.size)
        if stop <= start:
            return b""
        try:
            data = self._fetch(start, stop)
        except OSError as e:
            if type(e).__name__ == "FileExpired":  # s3fs: If-Match failed, another version
                raise ObjectChangedError(e.errno, f"{self.url}: changed since it was opened "
                                         f"(was {self.identity})") from e
            raise
        if not self._conditional:
            fs = self._storage.fs
            fs.invalidate_cache(self._path)
            now = object_identity(fs.info(self._path))
            if now != self.identity:
                raise ObjectChangedError(errno.ESTALE, f"{self.url}: changed since it was opened "
                                         f"(was {self.identity}, now {now})")
        return data


MANIFEST = "manifest.json"
HEAD = "head.json"  # format v2's commit point
BLOCK_DIR = "blocks"
COMMIT_POINTS = (MANIFEST, HEAD)  # writes that make blocks visible to readers


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Lock:
    """Exclusive right to build into a cache; `acquire()` raises RuntimeError if it is taken."""

    def acquire(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise RuntimeError if the lock may no longer be ours (call before every commit)."""

    def release(self) -> None:
        raise NotImplementedError

    def is_held(self) -> bool:
        """True when a builder holds this lock now (without taking it)."""
        raise NotImplementedError


class _FileLock(Lock):
    """flock on a local file: a crashed builder releases it by dying."""

    def __init__(self, path: str):
        self.path, self.fd = path, None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError("locked") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def is_held(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            return False  # never built here by this version, or a read-only copy
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)


class _LeaseLock(Lock):
    """A lease object renewed by a heartbeat thread: a crashed builder's lease simply expires.

    Object stores offer no flock; two builders starting within the same instant could both
    believe they won, so the winner is re-read after writing and the later writer backs off.
    A renewal that fails is retried; once the last successful renewal is half a TTL old (or
    another owner holds the lease), `check()` fails, so the builder stops before the lease can
    expire and a second builder take over.
    """

    TTL = 60.0
    RETRY = 1.0

    def __init__(self, storage: RemoteStorage, ttl: float | None = None):
        self.storage, self.ttl = storage, ttl or self.TTL
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed = 0.0  # time.monotonic() of the last successful renewal
        self._taken_by: str | None = None  # another owner found in the lease object
        self._error = "none"  # the last renewal failure, for the message

    def _current(self) -> dict | None:
        try:
            return json.loads(self.storage.read(".lock"))
        except (FileNotFoundError, ValueError):
            return None

    def _write(self) -> None:
        started = time.monotonic()
        self.storage.write(".lock", [json.dumps({"owner": self.owner,
                                                 "expires": time.time() + self.ttl}).encode()])
        self._renewed = started

    def acquire(self) -> None:
        held = self._current()
        if held and held.get("owner") != self.owner and held.get("expires", 0) > time.time():
            raise RuntimeError("locked")
        self._write()
        time.sleep(0.2)
        held = self._current()
        if not held or held.get("owner") != self.owner:
            raise RuntimeError("locked")
        self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="torchcache-lease")
        self._thread.start()

    def _heartbeat(self) -> None:
        wait = self.ttl / 3
        while not self._stop.wait(wait):
            try:
                held = self._current()
                if held is not None and held.get("owner") != self.owner:
                    self._taken_by = str(held.get("owner"))
                    return
                self._write()
                wait = self.ttl / 3
            except Exception as e:  # noqa: BLE001 - reported by check(), which stops the build
                self._error = f"{type(e).__name__}: {e}"
                wait = self.RETRY

    def check(self) -> None:
        if self._thread is None:
            return
        stop = "stopping before writing more; committed blocks are kept and a re-run resumes"
        if self._taken_by is not None:
            raise RuntimeError(f"{self.storage.url}: another builder ({self._taken_by}) took this "
                               f"builder's lease; {stop}")
        age = time.monotonic() - self._renewed
        if age >= self.ttl / 2:
            raise RuntimeError(f"{self.storage.url}: this builder could not renew its lease for "
                               f"{age:.0f} s (last error: {self._error}); {stop}")

    def is_held(self) -> bool:
        held = self._current()
        return bool(held) and held.get("expires", 0) > time.time()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if (self._current() or {}).get("owner") == self.owner:
                self.storage.delete(".lock")
