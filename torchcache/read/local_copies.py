"""Local copies of a remote cache's block files in a directory of bounded size, shared safely by
the processes of one machine (DataLoader workers, ranks), and the byte counters they report.

The copy directory (``local_dir/<fingerprint>``) holds::

    blocks/IIIIII-KKKKKK.safetensors.SHA256       a complete copy, named by the checksum it was
                                                  verified against (so a copy of other bytes,
                                                  e.g. of a cache rebuilt at the same URL, is
                                                  never taken for it)
    blocks/NAME.SHA256.tmp-PID-rN                 a reservation: a copy being downloaded, created
                                                  at its full size and locked by its writer
    blocks/NAME.SHA256.ok-INO-SIZE-MTIME-CTIME    (empty) the copy was verified while it had this
                                                  inode, size and times; its mtime: last use
    blocks/NAME.SHA256.remote-ID                  (empty) the remote file's version ID (hashed)
                                                  was downloaded whole and matched the checksum
    .copies.lock                                  the directory lock (accounting and eviction)
    .stats/SESSION/PID.bin                        a reading session's counters, one file per
                                                  process (see SessionStats; not copies: outside
                                                  the limit, removed when the session ends)

Rules, each kept with flock (a process that dies releases what it held, so nothing is stuck):

- **The limit.** The apparent size of every file in the directory, copies and reservations
  together, stays <= the limit. Space is reserved under the directory lock (scan, evict, create
  the reservation at its full size) before a download starts, and a download is renamed into
  place under that lock too, so no scan ever misses or double-counts it.
- **No deletion under a reader.** A reader holds a shared flock on every copy it has open. The
  evictor takes an exclusive, non-blocking flock on a victim and skips it when that fails (the
  block is in use), and unlinks only while it holds that lock. A reader that opened a copy just
  before it was unlinked sees ``st_nlink == 0`` once it has its shared lock and drops it.
- **Crashes.** A reservation whose writer died (its flock is free) is deleted by the next scan.
- **Trust.** A copy is used only if its ``ok-`` marker names its current inode, size and times
  and is newer than its last change (else it is hashed again, and deleted if it does not match):
  a copy written to after its download is never served. Markers are empty, so they cost nothing
  against the limit.

>>> copies = LocalCopies("/nvme/tc/9c1f...", limit=parse_size("200GB"))  # doctest: +SKIP
>>> copies.usage()  # doctest: +SKIP
187904819200
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import operator
import os
import re
import shutil
import stat
import struct
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Callable, Iterator

from ..format import blocks as fmt
from ..errors import CacheFormatError
from ..format.storage import BLOCK_DIR, TMP_MARK, ObjectChangedError, PinnedObject, RemoteStorage

__all__ = ["LocalCopies", "Reservation", "Resident", "SessionStats", "STAT_FIELDS", "STATS_DIR", "copy_name",
           "discard_copy", "fetch_verified", "mark_verified", "parse_size", "pin_verified",
           "read_pinned", "tree_bytes", "trusted_copy", "unpin"]

LOCK_NAME = ".copies.lock"
# our reservations (a stale one, whose writer died, is ours to delete)
_RESERVATION = re.compile(re.escape(TMP_MARK) + r"\d+-r\d+$")
# block copies (and copies of blocks' arrays sidecars), named by checksum (a plain name: a copy
# made by an older torchcache, never read)
_BLOCK_COPY = re.compile(r"\d{6,}-\d{6,}(\.arrays)?\.safetensors(\.[0-9a-f]{64})?$")
_OK, _REMOTE = ".ok-", ".remote-"
_TAGGED = ".pinned-"  # + the tag of a remote file's version verified here (see pin_verified)

# ---------------------------------------------------------------- sizes

_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgtpe", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000 ** _i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024 ** _i
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def tree_bytes(root: str, skip: tuple[str, ...] = ()) -> int:
    """Apparent size of the files under ``root``, each counted once (a file renamed while the
    tree is walked may be listed under both names), leaving out the top-level folders ``skip``."""
    seen, total = set(), 0
    for folder, subfolders, names in os.walk(root):
        if folder == root:
            subfolders[:] = [f for f in subfolders if f not in skip]
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:
                continue
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    return total


def parse_size(value: Any, name: str = "cache_limit", minimum: int = 1) -> int:
    """A number of bytes from an int or a string such as ``"200GB"``, ``"1.5 TB"`` or ``"500MiB"``.

    Units (any case): B; KB, MB, GB, TB, PB, EB (or K, M, G, ...) are powers of 1000; KiB, MiB,
    GiB, TiB, PiB, EiB (or Ki, Mi, ...) are powers of 1024. Fractions are rounded down to whole
    bytes. Errors name the argument (``name``); below ``minimum`` bytes is a ValueError.

    >>> parse_size("200GB"), parse_size("500MiB"), parse_size(4096)
    (200000000000, 524288000, 4096)
    """
    if isinstance(value, str):
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name} must be a number of bytes (an int) or a size such as '200GB', '1.5TB' or "
                f"'500MiB' (KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024), "
                f"got {value!r}")
        try:
            number = int(Decimal(match.group(1)) * _UNITS[unit])
        except InvalidOperation:  # pragma: no cover - the pattern admits only decimals
            raise ValueError(f"{name}: cannot read the number in {value!r}") from None
    else:
        if isinstance(value, bool) or str(getattr(value, "dtype", "")) == "bool":
            raise TypeError(f"{name} must be a number of bytes (an int) or a string such as "
                            f"'200GB', not a bool ({value!r})")
        try:
            number = operator.index(value)
        except TypeError:
            raise TypeError(f"{name} must be a number of bytes (an int) or a string such as '200GB' "
                            f"or '500MiB', got {type(value).__name__} {value!r}") from None
    if number < minimum:
        raise ValueError(f"{name} must be at least {minimum} byte{'s' * (minimum != 1)}, "
                         f"got {value!r}")
    return number


# ---------------------------------------------------------------- downloads

_FINAL_ERRORS = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def _named(error: OSError, url: str, what: str = "") -> OSError:
    """``error`` again, of the same type where it can be rebuilt, its message naming ``url``."""
    message = f"{url}: {what}{error.strerror or error}"
    if isinstance(error, PermissionError):
        message += ("; the store refused this reader: check the credentials in storage_options "
                    "(key and secret, profile, or the environment) and its access to the file")
    try:
        if error.errno is None:
            return type(error)(message)
        return type(error)(error.errno, message)
    except TypeError:  # a subclass with its own constructor
        return OSError(error.errno, message)


def _fetch_with_retries(url: str, attempts: int, fetch: Callable[[], bytes],
                        check: Callable[[bytes], str | None], failed: str, why: str) -> bytes:
    """``fetch()`` retried on network errors and while ``check`` (which raises for a fatal
    problem) names one. Corruption (what ``check`` finds) is a CacheFormatError naming the URL:
    "`failed` N times (...); `why`"; an error that is not (credentials, permissions, an
    unreachable store) keeps its type and cause and names the URL; other exceptions (bugs)
    pass unchanged."""
    problem, network = "", None
    for attempt in range(attempts):
        try:
            data = fetch()
        except FileNotFoundError:
            raise CacheFormatError(f"{url}: missing from the remote cache; "
                                   "run `torchcache verify` on it") from None
        except _FINAL_ERRORS as e:
            raise _named(e, url) from e
        except OSError as e:  # network trouble, or a file replaced while read: try again
            problem, network = f"{type(e).__name__}: {e}", e
            time.sleep(0.2 * (attempt + 1))
            continue
        problem, network = check(data) or "", None
        if not problem:
            return data
    if network is not None:
        raise _named(network, url, f"{failed} {attempts} times: ") from network
    raise CacheFormatError(f"{url}: {failed} {attempts} times ({problem}); {why}")


_CHANGED = ("the remote cache changed after commit (or the file is damaged on the store): it no "
            "longer holds the bytes its index committed, and nothing of it is served; rebuild "
            "the remote cache or restore the file, then open it again")


def _mismatch(data: bytes, checksum: str | None, size: int | None = None) -> str | None:
    """What is wrong with ``data`` against the committed size and checksum, or None."""
    if size is not None and len(data) != size:
        return f"{len(data):,} bytes, the index says {size:,}"
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if checksum is not None and actual != checksum:
        return f"checksum mismatch (got {actual[:19]}..., committed {checksum[:19]}...)"
    return None


def fetch_verified(storage: RemoteStorage, rel: str, checksum: str | None, attempts: int = 3,
                   max_size: int | None = None) -> bytes:
    """The whole remote file ``rel``, checked against ``checksum``; retried on network errors and
    on a mismatch, then a CacheFormatError naming the URL. With ``max_size``, at most that many
    bytes (+1) are fetched and a larger file is refused."""
    url = f"{storage.url}/{rel}"

    def check(data: bytes) -> str | None:
        if max_size is not None and len(data) > max_size:
            raise CacheFormatError(f"{url}: more than the {max_size:,} bytes its "
                                   "manifest entry allows: the remote file is corrupted or "
                                   "replaced; run `torchcache verify` on it")
        return _mismatch(data, checksum)

    fetch = (lambda: storage.read(rel)) if max_size is None else (
        lambda: storage.read_range(rel, 0, max_size + 1))
    return _fetch_with_retries(url, attempts, fetch, check, "download failed", _CHANGED)


def read_pinned(pinned: PinnedObject, start: int, stop: int, attempts: int = 3) -> bytes:
    """Bytes [start, stop) of a pinned remote file in one ranged request, retried on network
    errors; a short answer is a CacheFormatError naming the URL, and ObjectChangedError (the
    file is no longer the version pinned) passes to the caller."""
    def check(data: bytes) -> None:
        if len(data) != stop - start:
            raise CacheFormatError(
                f"{pinned.url}: a read of bytes [{start}, {stop}) returned {len(data)} "
                "bytes; the remote file is truncated or replaced: run `torchcache verify` on it")

    def fetch() -> bytes:
        try:
            return pinned.read_range(start, stop)
        except ObjectChangedError as e:  # not a network error: no retry here
            raise _Changed(e) from e

    try:
        return _fetch_with_retries(pinned.url, attempts, fetch, check,
                                   f"ranged read of bytes [{start}, {stop}) failed",
                                   "the remote cache is unreachable")
    except _Changed as e:
        raise e.error from e.error.__cause__


class _Changed(Exception):
    """Carries an ObjectChangedError past the retries (which retry OSErrors)."""

    def __init__(self, error: ObjectChangedError):
        super().__init__(str(error))
        self.error = error


def pin_verified(storage: RemoteStorage, rel: str, checksum: str, size: int, copy_path: str,
                 attempts: int = 3) -> tuple[PinnedObject, bytes | None]:
    """Remote file ``rel`` pinned to a version that holds the committed bytes.

    An ETag (or version) proves only that a file did not change since it was seen; so the
    first time this machine sees a version of ``rel``, that version is downloaded whole (a
    pinned read) and checked against ``checksum``, and an empty marker beside ``copy_path``
    records it. Later, each process opens the file once (one metadata request), finds the
    marker, and pins every ranged read to that version; where the store pins reads to an ETag
    (S3), a second marker names the version's tag and later processes (a DataLoader's workers,
    epoch after epoch) pin their reads to it with no request at all (if it was replaced since,
    the first read says so: :func:`unpin`, then this again). Returns (pinned file, its bytes when
    they were downloaded here, else None). A version that does not match is a CacheFormatError
    naming the URL: the remote cache changed after commit.
    """
    url = f"{storage.url}/{rel}"
    os.makedirs(os.path.dirname(copy_path), exist_ok=True)
    tag = _verified_tag(copy_path)
    if tag is not None:  # a version verified on this machine before: pinned with no request
        pinned = _open_pinned(storage, rel, tag)
        if pinned is not None:
            return pinned, None
    for attempt in range(attempts):
        pinned = _open_pinned(storage, rel)
        marker = f"{copy_path}{_REMOTE}{hashlib.sha256(pinned.identity.encode()).hexdigest()[:32]}"
        if os.path.exists(marker):
            _mark_tag(copy_path, pinned)
            return pinned, None
        with open(copy_path + ".lock", "a+b") as lock:  # one download per machine
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            if os.path.exists(marker):
                return pinned, None
            try:
                data = read_pinned(pinned, 0, pinned.size, attempts)
            except ObjectChangedError:  # replaced while we read it: look again
                continue
            except CacheFormatError:  # shorter than it said: not the committed file either
                data = b""
            problem = _mismatch(data, checksum, size)
            if problem:
                raise CacheFormatError(f"{url}: {problem}: {_CHANGED}")
            _create_empty(marker)
            _mark_tag(copy_path, pinned)
        return pinned, data
    raise CacheFormatError(f"{url}: replaced {attempts} times while being verified; {_CHANGED}")


def unpin(copy_path: str, pinned: PinnedObject) -> None:
    """Forget that ``pinned``'s version was verified (it is no longer on the store): the next
    :func:`pin_verified` looks the file up again instead of pinning reads to that version."""
    if pinned.tag is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{copy_path}{_TAGGED}{pinned.tag}")


def _mark_tag(copy_path: str, pinned: PinnedObject) -> None:
    """Record the verified version's tag (an empty file named by it), so that the machine's
    other readers (a DataLoader's next workers) pin reads to it without a metadata request."""
    if pinned.tag is not None:
        _create_empty(f"{copy_path}{_TAGGED}{pinned.tag}")


def _verified_tag(copy_path: str) -> str | None:
    """The tag of the version of ``copy_path``'s remote file verified last on this machine (see
    :func:`_mark_tag`), or None."""
    folder, name = os.path.split(copy_path)
    prefix = name + _TAGGED
    found = []
    try:
        entries = os.scandir(folder)
    except FileNotFoundError:
        return None
    with entries:
        for entry in entries:
            if entry.name.startswith(prefix):
                with contextlib.suppress(FileNotFoundError):
                    found.append((entry.stat().st_mtime_ns, entry.name[len(prefix):]))
    return max(found)[1] if found else None


def _open_pinned(storage: RemoteStorage, rel: str, tag: str | None = None) -> PinnedObject | None:
    url = f"{storage.url}/{rel}"
    try:
        return storage.open_pinned(rel, tag)
    except FileNotFoundError:
        raise CacheFormatError(f"{url}: missing from the remote cache; "
                               "run `torchcache verify` on it") from None
    except OSError as e:
        raise _named(e, url) from e


# ---------------------------------------------------------------- trusted copies

def copy_name(rel: str, checksum: str) -> str:
    """Where the local copy of cache file ``rel`` with ``checksum`` lives (relative to the copy
    directory): named by its content, so a copy of other bytes can never stand in for it."""
    algorithm, _, digest = checksum.partition(":")
    if algorithm != "sha256" or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise CacheFormatError(f"{rel}: checksum {checksum!r} is malformed; the cache's index "
                               "is corrupted: run `torchcache verify`")
    return f"{rel}.{digest}"


def _marker(path: str, st: os.stat_result) -> str:
    return f"{path}{_OK}{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{st.st_ctime_ns}"


def _create_empty(path: str) -> None:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    os.utime(path)


def mark_verified(fd: int, path: str) -> None:
    """Record that the open copy at ``path`` holds the bytes it is named after, as it is now."""
    _create_empty(_marker(path, os.fstat(fd)))


def trusted_copy(fd: int, path: str, checksum: str) -> bool:
    """Whether the open copy at ``path`` holds the bytes of ``checksum``.

    O(1) when its marker names its current inode, size, mtime and ctime and was made after its
    last change (a write changes its times; a marker made in the same clock tick as the change
    could miss a second write in that tick, so it is not trusted); else the copy is hashed once
    and marked again. So a copy damaged after its download is noticed at its next open.
    """
    st = os.fstat(fd)
    marker = _marker(path, st)
    try:
        if os.stat(marker).st_mtime_ns > st.st_ctime_ns:
            return True
    except FileNotFoundError:
        pass
    if fmt.fd_checksum(fd) != checksum:
        return False
    _create_empty(marker)
    return True


def discard_copy(path: str) -> None:
    """Delete a damaged copy and its markers (other processes that have it open keep reading
    what they verified; new opens download it again)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    _remove_markers(path)


def _remove_markers(path: str) -> None:
    folder, name = os.path.split(path)
    with contextlib.suppress(FileNotFoundError):
        for other in os.listdir(folder):
            if other.startswith(name + _OK):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, other))


# ---------------------------------------------------------------- the counters

STAT_FIELDS = ("bytes_downloaded", "whole_block_downloads", "whole_block_bytes", "ranged_reads",
               "ranged_bytes", "other_bytes", "hits", "misses", "prefetched", "evictions",
               "evicted_bytes", "refused_copies", "verified_bytes", "wasted_bytes")
_STATS_FORMAT = struct.Struct(f"<{len(STAT_FIELDS)}q")


STATS_DIR = ".stats"  # where a copy directory keeps its reading sessions' counters
_OWNER_LOCK = "owner.lock"  # held (flock) by a session's first process while the session lives


def _remove_session(path: str, owner: int, lock_fd: int) -> None:
    if os.getpid() == owner:  # never from a forked DataLoader worker
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(lock_fd)


def _remove_ended_sessions(folder: str) -> None:
    """Delete the sessions under ``folder`` whose first process is gone (killed before it could
    remove them): their owner lock is free."""
    try:
        sessions = os.listdir(folder)
    except OSError:
        return
    for session in sessions:
        path = os.path.join(folder, session)
        try:
            fd = os.open(os.path.join(path, _OWNER_LOCK), os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no lock yet (being made) or not a session: leave it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # alive
            continue
        else:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)


class SessionStats:
    """Counters of one reading session: a TokenCache and its copies in DataLoader workers.

    Each process adds to its own counters and writes them (one ``pwrite``) to its own small file
    under ``folder/<session>/`` (a remote cache's copy directory: ``.stats``, never ``$TMPDIR``);
    :meth:`totals` sums the files, so the numbers include what worker processes did, even after
    they exited. The process that created the session removes its files when the session object
    is collected, and deletes the sessions of processes that died without doing so. With
    ``folder=None`` (or a folder that cannot be written) the counters stay in memory: this
    process's only. Safe to use from threads.

    >>> stats = SessionStats(None)
    >>> stats.add("hits", 3); stats.add_many({"hits": 1, "misses": 2})
    >>> stats.totals()["hits"], stats.totals()["misses"]
    (4, 2)
    """

    def __init__(self, folder: str | None, session: str | None = None):
        self.parent = folder
        self.session = session or uuid.uuid4().hex
        self.folder = None if folder is None else os.path.join(folder, self.session)
        if session is None and self.folder is not None:
            self._start_session()
        self._lock = threading.Lock()
        self._pid = -1
        self._fd = -1
        self._counts = [0] * len(STAT_FIELDS)
        self._index = {name: i for i, name in enumerate(STAT_FIELDS)}

    def _start_session(self) -> None:
        """Make the session's folder, holding its owner lock; clear ended sessions."""
        try:
            _remove_ended_sessions(self.parent)
            os.makedirs(self.folder)
            making = os.path.join(self.folder, _OWNER_LOCK + ".new")
            fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)  # locked before the name others look for exists
            os.rename(making, os.path.join(self.folder, _OWNER_LOCK))
        except OSError:  # a folder we cannot write: counters in memory only
            self.folder = None
            return
        weakref.finalize(self, _remove_session, self.folder, os.getpid(), fd)

    def __getstate__(self) -> dict[str, Any]:
        return {"parent": self.parent, "session": self.session}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["parent"], state["session"])

    def _check_process(self) -> None:
        if self._pid != os.getpid():  # a new process (fork): its own counters, its own file
            self._pid, self._fd = os.getpid(), -1
            self._counts = [0] * len(STAT_FIELDS)

    def add(self, field: str, n: int = 1) -> None:
        """Add ``n`` to counter ``field`` of this process."""
        with self._lock:
            self._check_process()
            self._counts[self._index[field]] += n

    def add_many(self, values: dict[str, int]) -> None:
        with self._lock:
            self._check_process()
            for field, n in values.items():
                if n:
                    self._counts[self._index[field]] += n

    def flush(self) -> None:
        """Write this process's counters to its file (cheap: one pwrite)."""
        with self._lock:
            self._check_process()
            if self._fd < 0 and self.folder is not None:
                try:
                    os.makedirs(self.folder, exist_ok=True)
                    self._fd = os.open(os.path.join(self.folder, f"{self._pid}.bin"),
                                       os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                except OSError:
                    return  # counters stay in memory; totals() still sees this process's
            if self._fd < 0:
                return
            try:
                os.pwrite(self._fd, _STATS_FORMAT.pack(*self._counts), 0)
            except OSError:
                pass

    def totals(self) -> dict[str, int]:
        """The counters summed over every process of the session."""
        self.flush()
        total = [0] * len(STAT_FIELDS)
        mine = f"{os.getpid()}.bin"
        seen_mine = False
        try:
            names = os.listdir(self.folder) if self.folder is not None else []
        except FileNotFoundError:
            names = []
        for name in names:
            if not name.endswith(".bin"):
                continue
            path = os.path.join(self.folder, name)
            seen_mine |= name == mine
            try:
                with open(path, "rb") as f:
                    data = f.read(_STATS_FORMAT.size)
            except OSError:
                continue
            if len(data) == _STATS_FORMAT.size:
                total = [a + b for a, b in zip(total, _STATS_FORMAT.unpack(data))]
        if not seen_mine:
            with self._lock:
                total = [a + b for a, b in zip(total, self._counts)]
        return dict(zip(STAT_FIELDS, total))


# ---------------------------------------------------------------- the directory

@dataclass
class Resident:
    """A complete block copy in the directory, as the last scan saw it."""
    rel: str
    path: str
    size: int
    mtime: float


#: What a reservation asks of the eviction policy: given the residents, the victims it may
#: evict in preference order, each with the value lost by evicting it, and the most value it
#: may lose in all (None: any).
Policy = Callable[[list[Resident]], tuple[list[tuple[Resident, float]], float | None]]

EXISTS, BUSY, REFUSED = "exists", "busy", "refused"


def _last_use(path: str, st: os.stat_result) -> float:
    """When a copy was last used: its marker's mtime (touched at each use), else its own."""
    try:
        return os.stat(_marker(path, st)).st_mtime
    except FileNotFoundError:
        return st.st_mtime


class Reservation:
    """Room for one copy, held as a locked file of the copy's full size; fill it with
    :meth:`commit` or give it back with :meth:`abort`."""

    def __init__(self, copies: "LocalCopies", path: str, tmp: str, fd: int, size: int,
                 evicted: list[Resident]):
        self.copies, self.path, self.tmp, self.fd, self.size = copies, path, tmp, fd, size
        self.evicted = evicted

    def commit(self, data: bytes) -> None:
        """Write the verified bytes, make them durable, rename the copy into place (under the
        directory lock, so no scan sees it twice or not at all) and release the reservation."""
        try:
            if len(data) != self.size:
                raise CacheFormatError(f"{self.path}: the remote file has {len(data):,} bytes, the "
                                       f"manifest says {self.size:,}; run `torchcache verify` on it")
            view, done = memoryview(data), 0
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], done)
            os.fsync(self.fd)
            with self.copies.locked():
                os.replace(self.tmp, self.path)
                mark_verified(self.fd, self.path)  # after the rename, which changes its ctime
        except BaseException:
            self.abort()
            raise
        os.close(self.fd)  # releases our lock: readers may use the copy now
        self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            os.close(self.fd)
            self.fd = -1


class LocalCopies:
    """The copy directory of one remote cache on this machine, kept under ``limit`` bytes.

    >>> copies = LocalCopies(root, limit=10**9)  # doctest: +SKIP
    >>> found = copies.open_copy("blocks/000000-000000.safetensors", size)  # doctest: +SKIP
    """

    def __init__(self, root: str, limit: int):
        self.root, self.limit = root, limit
        self.dir = fmt.CacheDir(root)
        self._serial = itertools.count()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The directory lock: held for scans, reservations, evictions and renames."""
        os.makedirs(os.path.join(self.root, BLOCK_DIR), exist_ok=True)
        fd = os.open(os.path.join(self.root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    # -- readers
    def open_copy(self, rel: str, checksum: str, touch: bool = False) -> tuple[str, int] | None:
        """(path, descriptor) of a complete copy that holds the bytes of ``checksum`` (see
        :func:`trusted_copy`), now locked shared (released when the descriptor is closed), or
        None when there is none, it is being evicted, or it was damaged (then it is deleted, so
        it is downloaded again). ``touch`` marks it used now (recency, for eviction without a
        read plan: its marker's mtime, never the copy's own times)."""
        path = self.dir.path(rel)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CacheFormatError(f"{path}: not a regular file; delete it (it is a local copy "
                                       "of a remote block)")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # an evictor holds it, about to delete it
                os.close(fd)
                return None
            if os.fstat(fd).st_nlink == 0:  # evicted between our open and our lock
                os.close(fd)
                return None
            if not trusted_copy(fd, path, checksum):
                os.close(fd)
                self._discard(path)
                return None
            if touch:
                with contextlib.suppress(OSError):
                    os.utime(_marker(path, os.fstat(fd)))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        return path, fd

    def _discard(self, path: str) -> None:
        """Delete a damaged copy unless a reader holds it (it is then deleted by eviction, or
        at the next open that finds it free)."""
        with self.locked():
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except FileNotFoundError:
                return
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                discard_copy(path)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)

    # -- accounting
    def usage(self) -> int:
        """Apparent bytes of every file in the directory now (copies and reservations)."""
        return sum(size for size, _ in self._files())

    def _files(self) -> list[tuple[int, os.DirEntry]]:
        found = []
        for folder in (self.root, os.path.join(self.root, BLOCK_DIR)):
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_size, entry))
        return found

    def _scan(self, busy_prefix: str | None = None) -> tuple[int, list[Resident], bool]:
        """(bytes used, complete copies, whether a live reservation starts with busy_prefix);
        deletes reservations whose writer died. Directory lock held."""
        used, residents, busy = 0, [], False
        blocks = os.path.join(self.root, BLOCK_DIR)
        files = self._files()
        names = {entry.name for _, entry in files}
        for size, entry in files:
            name = entry.name
            if TMP_MARK in name:
                if _RESERVATION.search(name) and self._stale(entry.path):
                    continue
                busy |= busy_prefix is not None and entry.path.startswith(busy_prefix)
            elif os.path.dirname(entry.path) == blocks and _BLOCK_COPY.fullmatch(name):
                residents.append(Resident(f"{BLOCK_DIR}/{name}", entry.path, size,
                                          _last_use(entry.path, entry.stat(follow_symlinks=False))))
            elif _OK in name and name.partition(_OK)[0] not in names:  # its copy is gone
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            used += size
        return used, residents, busy

    @staticmethod
    def _stale(path: str) -> bool:
        """True (and the file deleted) if nobody holds this reservation's lock: its writer died."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return True
        finally:
            os.close(fd)

    # -- writers
    def reserve(self, rel: str, size: int, policy: Policy) -> tuple[str, Reservation | None, int]:
        """Room for a copy of ``rel`` (``size`` bytes), making it by evicting what ``policy``
        allows. Returns (status, reservation, bytes used after it): status "reserved", or
        EXISTS (a copy is there), BUSY (another process is downloading it) or REFUSED (no room
        the policy would make: read by range instead)."""
        path = self.dir.path(rel)
        with self.locked():
            if os.path.exists(path):
                return EXISTS, None, -1
            used, residents, busy = self._scan(path + TMP_MARK)
            if busy:
                return BUSY, None, used
            evicted: list[Resident] = []
            if used + size > self.limit:
                made = self._make_room(used + size - self.limit, residents, policy)
                if made is None:
                    return REFUSED, None, used
                evicted = made
                used -= sum(r.size for r in evicted)
            tmp = f"{path}{TMP_MARK}{os.getpid()}-r{next(self._serial)}"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.ftruncate(fd, size)  # accounted at its full size from now on
            except BaseException:
                os.unlink(tmp)
                os.close(fd)
                raise
            return "reserved", Reservation(self, path, tmp, fd, size, evicted), used + size

    def wait_for(self, rel: str) -> bool:
        """Wait until another process's download of ``rel`` ends (its reservation's lock is
        released); True if the copy is there then. Waits on the lock, never on a timer."""
        path = self.dir.path(rel)
        folder, name = os.path.split(path)
        try:
            names = [n for n in os.listdir(folder) if n.startswith(name + TMP_MARK)]
        except FileNotFoundError:
            names = []
        for tmp in names:
            try:
                fd = os.open(os.path.join(folder, tmp), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # granted when the writer commits or dies
            finally:
                os.close(fd)
        return os.path.exists(path)

    def evict(self, keep_bytes: int, policy: Policy) -> list[Resident]:
        """Evict copies not in use, in ``policy``'s order, until at most ``keep_bytes`` are used
        (or nothing more can go); the evicted copies."""
        with self.locked():
            used, residents, _ = self._scan()
            if used <= keep_bytes:
                return []
            return self._make_room(used - keep_bytes, residents, policy, partial=True) or []

    def _make_room(self, need: int, residents: list[Resident], policy: Policy,
                   partial: bool = False) -> list[Resident] | None:
        """Evict victims worth at most the policy's budget that free ``need`` bytes, or none at
        all (None) if that is impossible. Directory lock held."""
        candidates, budget = policy(residents)
        held: list[tuple[Resident, int]] = []
        freed, lost = 0, 0.0
        try:
            for resident, value in candidates:
                if freed >= need:
                    break
                if budget is not None and lost + value > budget:
                    continue
                try:
                    fd = os.open(resident.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # in use by a reader: never deleted under it
                    os.close(fd)
                    continue
                if os.fstat(fd).st_nlink == 0:
                    os.close(fd)
                    continue
                held.append((resident, fd))
                freed += resident.size
                lost += value
            if freed < need and not partial:
                return None
            for resident, fd in held:
                marker = _marker(resident.path, os.fstat(fd))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(resident.path)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(marker)
            return [resident for resident, _ in held]
        finally:
            for _, fd in held:
                os.close(fd)
