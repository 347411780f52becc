"""Build inputs: resolving paths and globs through fsspec, and reading documents from them.

Each input yields records in a fixed order, numbered from 1 (the line number for JSON lines), so
a build can resume after record N of an input and a bad record can be named by file and line.
Every record carries a digest of the raw content of the input up to it, so a resumed build can
tell that the records it skips are the ones the interrupted build consumed.

Errors are of three kinds. A bad record (malformed JSON, invalid UTF-8, ...) or a damaged file
(truncated or corrupted) is an InputError, which on_error="skip" skips and counts. An input that
changed since the interrupted build is an InputChangedError, never skipped. An I/O error reading
the input's bytes is transient: the input is reopened and read again from the last record, a few
times, and then the OSError is raised (never skipped: the rest of the input was not read).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import fsspec

from .wds import Sample, decode_tokens, iter_samples, parse_member_spec

ITERABLE_PATH = "<iterable>"
_JSONL = (".jsonl", ".ndjson")
_TEXT = (".txt",)
_TAR = (".tar", ".tar.gz", ".tgz")
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
SUPPORTED = "jsonl, jsonl.gz, jsonl.zst, ndjson, txt, txt.gz, txt.zst, parquet, tar, tar.gz, tgz"
SKIP_REASONS = ("malformed_json", "missing_text", "invalid_utf8", "unreadable", "bad_tokens")
_ATTEMPTS = 3         # reads of an input in a row that fail with an I/O error before giving up
_RETRY_DELAY = 0.5    # seconds before the first re-read; doubles before each next one
_SINCE_BUILD = "since the interrupted build"
_SINCE_READ = "while it was being read"


class InputError(ValueError):
    """A malformed input record: the message names the file and line and what to do."""


class InputChangedError(InputError):
    """An input differs from the one an interrupted build read: resuming would mix two versions
    of it in one cache. Never skipped, whatever on_error says."""


@dataclass(frozen=True)
class InputSource:
    """One input shard: a file (by URL) of a known kind, or the caller's iterable of strings."""

    path: str
    kind: str  # "jsonl", "txt", "parquet" or "wds" (webdataset tar)
    compression: str | None
    size: int | None

    @property
    def process_local(self) -> bool:
        """True for memory:// inputs, which exist only in this process (no workers can read them)."""
        return self.path.startswith("memory://")

    def spec(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size}


@dataclass(frozen=True)
class Record:
    number: int             # 1-based record number within the input (line number for JSON lines)
    text: str | None        # None when the record was skipped (or holds tokens instead)
    problem: str | None     # one of SKIP_REASONS when skipped
    position: int           # raw bytes of the input consumed so far (for progress)
    tokens: Any = None      # already-tokenized document (np.ndarray), for pre-tokenized inputs
    key: str | None = None  # the source sample's key (webdataset __key__), kept in a sidecar
    digest: str | None = None  # sha256 (hex) of the raw content of records 1..number, in order


def _kind_of(path: str) -> tuple[str, str | None]:
    name = path.lower()
    if name.endswith(_TAR):
        return "wds", None  # tarfile detects gzip itself
    if name.endswith(".parquet"):
        return "parquet", None
    compression = None
    for ext, comp in _COMPRESSIONS.items():
        if name.endswith(ext):
            compression, name = comp, name[: -len(ext)]
            break
    if name.endswith(_JSONL):
        return "jsonl", compression
    if name.endswith(_TEXT):
        return "txt", compression
    raise ValueError(f"input {path!r}: unsupported file type; supported: {SUPPORTED}")


def resolve_inputs(inputs: Any, storage_options: dict[str, Any] | None = None) -> list[InputSource] | Iterable[str]:
    """Expand paths, globs and directories into an ordered list of input shards.

    A str/PathLike or a list/tuple of them names files; any other iterable is a stream of
    documents (pass `iter(texts)` to build from an in-memory list of strings).
    """
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)):
        if isinstance(inputs, Iterable):
            return inputs
        raise TypeError(f"inputs must be paths/globs or an iterable of strings, not {type(inputs).__name__}")
    if not inputs:
        raise ValueError("inputs is empty: give at least one path, glob or an iterable of strings")
    sources: list[InputSource] = []
    for item in inputs:
        if not isinstance(item, (str, os.PathLike)):
            raise TypeError(f"inputs: {item!r} is not a path; a list of inputs must hold paths or "
                            "globs (to build from strings, pass an iterator, e.g. iter(texts))")
        sources.extend(_expand(os.fspath(item), storage_options or {}))
    seen = set()
    for s in sources:
        if s.path in seen:
            raise ValueError(f"input {s.path!r} is given twice")
        seen.add(s.path)
    return sources


def _expand(url: str, storage_options: dict[str, Any]) -> list[InputSource]:
    fs, path = fsspec.core.url_to_fs(url, **storage_options)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if any(c in path for c in "*?["):
        paths = sorted(fs.glob(path))
        if not paths:
            raise FileNotFoundError(f"input glob {url!r} matches no file")
    elif fs.isdir(path):
        paths = sorted(p for p in fs.find(path) if _is_supported(p))
        if not paths:
            raise FileNotFoundError(f"input directory {url!r} holds no {SUPPORTED} file")
    elif fs.exists(path):
        paths = [path]
    else:
        raise FileNotFoundError(f"input {url!r} does not exist (to build from strings, pass an "
                                "iterator of them, e.g. iter(texts))")
    sources = []
    for p in paths:
        kind, compression = _kind_of(p)
        full = os.path.abspath(p) if protocol in ("file", "local") else fs.unstrip_protocol(p)
        sources.append(InputSource(full, kind, compression, int(fs.size(p))))
    return sources


def _is_supported(path: str) -> bool:
    try:
        _kind_of(path)
        return True
    except ValueError:
        return False


class _Counting(io.RawIOBase):
    """An input's raw bytes as read: counts them (progress, for compressed inputs too) and keeps
    the I/O error of a failed read, so that the decoder above never has it taken for damage."""

    def __init__(self, f):
        self.f, self.count = f, 0
        self.failure: OSError | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.f.seekable()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        try:
            return self.f.seek(offset, whence)
        except OSError as e:
            self.failure = e
            raise

    def tell(self) -> int:
        return self.f.tell()

    def read(self, size: int = -1) -> bytes:
        try:
            data = self.f.read(size)
        except OSError as e:
            self.failure = e
            raise
        self.count += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def _open_text_stream(source: InputSource, raw) -> tuple[io.BufferedReader, _Counting]:
    counted = _Counting(raw)
    if source.compression == "gzip":
        stream = gzip.GzipFile(fileobj=io.BufferedReader(counted, 1 << 20), mode="rb")
    elif source.compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"input {source.path!r} is zstd-compressed: install the extra "
                              "`pip install torchcache-lm[zstd]` (the zstandard package)") from None
        stream = _ZstdReader(counted, zstandard)
    else:
        stream = counted
    return io.BufferedReader(stream, 1 << 20), counted


class _ZstdReader(io.RawIOBase):
    """Decompresses concatenated zstd frames and, unlike zstandard's stream reader, reports a
    stream that ends inside a frame (a truncated file) as an error."""

    def __init__(self, raw, zstandard):
        self.raw, self.zstd = raw, zstandard
        self.decomp = zstandard.ZstdDecompressor().decompressobj()
        self.pending = b""
        self.in_frame = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.pending:
            chunk = self.raw.read(1 << 20)
            if not chunk:
                if self.in_frame:
                    raise EOFError("zstd stream ends inside a frame")
                return 0
            while chunk:
                self.in_frame = True
                self.pending += self.decomp.decompress(chunk)
                chunk = b""
                if self.decomp.eof:
                    chunk = self.decomp.unused_data
                    self.decomp = self.zstd.ZstdDecompressor().decompressobj()
                    self.in_frame = False
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n


def _zstd_error() -> type[BaseException]:
    try:
        import zstandard
        return zstandard.ZstdError
    except ImportError:
        return OSError


# ---------------------------------------------------------------- numbering, digests, bad records

class _Prefix:
    """Numbers the records of one read of an input and hashes their raw content, in order.

    A resumed read skips records 1..start; their digest must equal `start_digest`, the one
    stored when they were consumed, or the input changed and resuming would mix two versions.
    """

    def __init__(self, name: str, start: int, start_digest: str | None, since: str = _SINCE_BUILD):
        self.name, self.start, self.expected, self.since = name, start, start_digest, since
        self.number = 0
        self._hash = hashlib.sha256()
        # bound once, as they are called for every record: hash raw content; hex digest so far
        self.update, self.digest = self._hash.update, self._hash.hexdigest

    def frame(self, tag: bytes, data: bytes) -> None:
        """Hash `data` after a tag and its length, so consecutive values cannot run together."""
        self._hash.update(b"%s%d:" % (tag, len(data)))
        self._hash.update(data)

    def advance(self) -> bool:
        """Count the record just hashed; True when it comes after the resume point."""
        self.number += 1
        if self.number == self.start and self.expected is not None and self.digest() != self.expected:
            raise self._changed("")
        return self.number > self.start

    def check_end(self, readable: str = "") -> None:
        """The input ends here: one shorter than the resume point changed too."""
        if self.number < self.start and self.expected is not None:
            raise self._changed(f": it now has only {self.number}{readable} records")

    def _changed(self, detail: str) -> InputChangedError:
        return InputChangedError(f"{self.name}: the input changed {self.since} (its first {self.start} "
                                 f"records differ{detail}); restore it, or build into a new output")


class _BadRecord(Exception):
    """Why a record cannot become a document: a reason from SKIP_REASONS and what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _skip_or_raise(where: str, bad: _BadRecord, on_error: str, number: int, position: int,
                   key: str | None = None, digest: str | None = None) -> Record:
    """A bad record: an InputError naming it (on_error='raise'), or the record, skipped."""
    if bad.reason not in SKIP_REASONS:
        raise AssertionError(f"unknown skip reason {bad.reason!r}")
    if on_error == "raise":
        raise InputError(f"{where}: {bad.detail}. Fix the input, or pass on_error='skip' to skip "
                         "and count such records") from bad.__cause__
    return Record(number, None, bad.reason, position, key=key, digest=digest)


def _unreadable(source: InputSource, prefix: _Prefix, what: str, error: BaseException,
                counted: _Counting, on_error: str) -> Record:
    """The rest of the input cannot be decoded: an InputError, or a skipped record ending it.

    An I/O error reading the input's bytes is not damage: it is raised again, to be retried.
    """
    if counted.failure is not None:
        raise error
    prefix.check_end(" readable")
    noun = "shard" if source.kind == "wds" else "file"
    message = " ".join(str(error).split())  # pyarrow's messages span lines
    bad = _BadRecord("unreadable", f"{what} ({type(error).__name__}: {message}); the {noun} is "
                                   "truncated or corrupted")
    bad.__cause__ = error
    return _skip_or_raise(source.path, bad, on_error, prefix.number + 1, counted.count,
                          digest=prefix.digest())


def _decode_utf8(data: bytes, unit: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadRecord("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the {unit}") from e


def _json_text(data: bytes, field: str, unit: str) -> str:
    """The string in field `field` of the JSON object in `data` (a line or a member: `unit`)."""
    try:
        obj = json.loads(_decode_utf8(data, unit))
    except ValueError as e:
        raise _BadRecord("malformed_json", f"malformed JSON ({e})") from e
    except RecursionError as e:  # json's parser recurses once per level of nesting
        raise _BadRecord("malformed_json", "malformed JSON (nested too deeply to parse)") from e
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise _BadRecord("missing_text", f"no {field!r} field (found {keys}); set text_key to the "
                                         "field that holds the text")
    text = obj[field]
    if not isinstance(text, str):
        raise _BadRecord("missing_text", f"field {field!r} is a {type(text).__name__}, not a string")
    if not text.isascii():  # O(1); only non-ASCII text can hold a surrogate
        _check_utf8(text, field)
    return text


def _check_utf8(text: str, field: str) -> None:
    """A JSON `\\ud800` escape gives a lone surrogate, which is not UTF-8: left in, it would fail
    in the tokenizer, far from its file and line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _BadRecord("invalid_utf8", f"field {field!r} is not valid UTF-8 (a lone surrogate "
                                         f"{text[e.start]!r} at character {e.start})") from e


# ---------------------------------------------------------------- reading file inputs

def iter_records(source: InputSource, text_key: str, start: int, on_error: str,
                 storage_options: dict[str, Any] | None = None, tokens: bool = False,
                 start_digest: str | None = None) -> Iterator[Record]:
    """Records of one file input after record `start`; malformed ones raise or are skipped.

    `start_digest` is the digest of record `start` when it was consumed: the records skipped
    must hash to it, else InputChangedError (None: no check, for caches made before digests).
    An I/O error reading the input is retried from the last record yielded, then raised as an
    OSError. `tokens=True` reads pre-tokenized documents (webdataset inputs only).
    """
    if tokens and source.kind != "wds":
        raise ValueError(f"{source.path}: pre-tokenized documents are read from webdataset tars only")
    read = _READERS[source.kind]
    options = storage_options or {}
    return _with_retries(source.path, lambda prefix: read(source, text_key, on_error, options,
                                                           tokens, prefix), start, start_digest)


def _with_retries(path: str, read: Callable[[_Prefix], Iterator[Record]], start: int,
                  start_digest: str | None) -> Iterator[Record]:
    """Records of `read`; after an I/O error, the input is read again from the last record read
    (skipping the records before it, checked by their digest), until _ATTEMPTS reads in a row
    fail without reading a new record."""
    since, failures = _SINCE_BUILD, 0
    while True:
        prefix = _Prefix(path, start, start_digest, since)
        try:
            yield from read(prefix)
            return
        except OSError as e:
            if prefix.number > start:  # progress: every record read was yielded, or is skipped
                start, start_digest, since, failures = prefix.number, prefix.digest(), _SINCE_READ, 0
            failures += 1
            if failures >= _ATTEMPTS:
                raise OSError(f"{path}: reading failed {failures} times ({type(e).__name__}: {e}) at "
                              f"record {start + 1}; committed blocks are kept, re-run the build to "
                              "resume") from e
            time.sleep(_RETRY_DELAY * 2 ** (failures - 1))


def _read_text(source: InputSource, text_key: str, on_error: str, options: dict[str, Any],
               tokens: bool, prefix: _Prefix) -> Iterator[Record]:
    """Records of a JSON lines or text file (plain, gzip or zstd)."""
    with fsspec.open(source.path, "rb", **options) as raw:
        stream, counted = _open_text_stream(source, raw)
        try:
            if source.kind == "txt":
                yield from _txt_records(source, stream, counted, on_error, prefix)
            else:
                yield from _jsonl_records(source, stream, counted, text_key, on_error, prefix)
        except (OSError, EOFError, zlib.error, _zstd_error()) as e:
            yield _unreadable(source, prefix, f"cannot read the {source.compression or 'file'} "
                                              f"stream{_where(source, prefix)}", e, counted, on_error)


def _where(source: InputSource, prefix: _Prefix) -> str:
    """Where in a text input reading stopped, for messages."""
    if source.kind == "txt":
        return ""
    return f" after line {prefix.number}" if prefix.number else " before its first line"


def _jsonl_records(source: InputSource, stream: io.BufferedReader, counted: _Counting,
                   text_key: str, on_error: str, prefix: _Prefix) -> Iterator[Record]:
    """One record per line (blank lines are numbered and hashed, but yield nothing)."""
    for line in stream:
        prefix.update(line)
        if prefix.advance() and not line.isspace():
            yield _json_record(source, prefix.number, line, text_key, counted.count, on_error,
                               prefix.digest())
    prefix.check_end()


def _json_record(source: InputSource, number: int, line: bytes, text_key: str, position: int,
                 on_error: str, digest: str) -> Record:
    try:
        text = _json_text(line, text_key, "line")
    except _BadRecord as bad:
        return _skip_or_raise(f"{source.path}:{number}", bad, on_error, number, position, digest=digest)
    return Record(number, text, None, position, digest=digest)


def _txt_records(source: InputSource, stream: io.BufferedReader, counted: _Counting, on_error: str,
                 prefix: _Prefix) -> Iterator[Record]:
    """A text file is one record: the whole file."""
    data = stream.read()
    prefix.update(data)
    if prefix.advance():
        try:
            text = _decode_utf8(data, "file")
        except _BadRecord as bad:
            yield _skip_or_raise(f"{source.path}:1", bad, on_error, 1, counted.count,
                                 digest=prefix.digest())
        else:
            yield Record(1, text, None, counted.count, digest=prefix.digest())
    prefix.check_end()


def _read_parquet(source: InputSource, text_key: str, on_error: str, options: dict[str, Any],
                  tokens: bool, prefix: _Prefix) -> Iterator[Record]:
    """Rows of a Parquet file, read one row group at a time (never the whole file)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"input {source.path!r} is Parquet: install the extra "
                          "`pip install torchcache-lm[parquet]` (the pyarrow package)") from None
    damage = (OSError, pa.ArrowException)  # pyarrow reports damage as OSError too; see _unreadable
    with fsspec.open(source.path, "rb", **options) as raw:
        counted = _Counting(raw)
        try:
            pf = pq.ParquetFile(counted)
        except damage as e:
            yield _unreadable(source, prefix, "not a readable Parquet file", e, counted, on_error)
            return
        if text_key not in pf.schema_arrow.names:
            raise InputError(f"{source.path}: no column {text_key!r} (columns: "
                             f"{pf.schema_arrow.names[:8]}); set text_key to the text column")
        for group in range(pf.num_row_groups):
            try:
                values, is_text = _parquet_column(pa, pf, group, text_key)
            except damage as e:
                yield _unreadable(source, prefix, f"cannot read row group {group}", e, counted, on_error)
                return
            position = int(source.size * (group + 1) / max(pf.num_row_groups, 1)) if source.size else 0
            for value in values:
                if is_text and value is not None:
                    prefix.frame(b"s", value)
                else:
                    prefix.frame(b"x", type(value).__name__.encode())
                if prefix.advance():
                    yield _parquet_record(source, prefix.number, value, is_text, text_key, position,
                                          on_error, prefix.digest())
        prefix.check_end()


def _parquet_column(pa, pf, group: int, text_key: str) -> tuple[list, bool]:
    """The text column of one row group, and whether it is a string column: its values are then
    the UTF-8 bytes, decoded row by row so that one bad row is named, not the whole group."""
    column = pf.read_row_group(group, columns=[text_key]).column(0)
    if pa.types.is_string(column.type):
        return column.cast(pa.binary()).to_pylist(), True
    if pa.types.is_large_string(column.type):
        return column.cast(pa.large_binary()).to_pylist(), True
    return column.to_pylist(), False


def _parquet_record(source: InputSource, number: int, value: Any, is_text: bool, text_key: str,
                    position: int, on_error: str, digest: str) -> Record:
    try:
        if not is_text or value is None:
            raise _BadRecord("missing_text", f"row {number}: column {text_key!r} is "
                                             f"{type(value).__name__}, not a string")
        text = _decode_utf8(value, "row")
    except _BadRecord as bad:
        return _skip_or_raise(f"{source.path}:{number}", bad, on_error, number, position, digest=digest)
    return Record(number, text, None, position, digest=digest)


def _read_tar(source: InputSource, text_key: str, on_error: str, options: dict[str, Any],
              tokens: bool, prefix: _Prefix) -> Iterator[Record]:
    """Samples of one webdataset shard, as text or token records."""
    ext, field = parse_member_spec(text_key)
    last = ""
    with fsspec.open(source.path, "rb", **options) as raw:
        counted = _Counting(raw)
        try:
            for sample in iter_samples(io.BufferedReader(counted, 1 << 20)):
                _hash_sample(prefix, sample)
                last = sample.last_name
                if prefix.advance():
                    yield _sample_record(source, prefix.number, sample, ext, field, tokens,
                                         counted.count, on_error, prefix.digest())
            prefix.check_end()
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            where = f"after member {last!r}" if last else "at its start"
            yield _unreadable(source, prefix, f"cannot read the tar {where}", e, counted, on_error)


def _hash_sample(prefix: _Prefix, sample: Sample) -> None:
    prefix.frame(b"k", sample.key.encode("utf-8", "surrogateescape"))
    for name, data in sample.files:
        prefix.frame(b"n", name.encode("utf-8", "surrogateescape"))
        prefix.frame(b"d", data)


def _sample_record(source: InputSource, number: int, sample: Sample, ext: str, field: str | None,
                   tokens: bool, position: int, on_error: str, digest: str) -> Record:
    try:
        content = _member(sample, ext)
        if tokens:
            try:
                ids = decode_tokens(content, ext, field)
            except ValueError as e:
                raise _BadRecord("bad_tokens", str(e)) from e
            return Record(number, None, None, position, tokens=ids, key=sample.key, digest=digest)
        if field is None:
            text = _decode_utf8(content, "member")
        else:
            text = _json_text(content, field, "member")
    except _BadRecord as bad:
        return _skip_or_raise(f"{source.path}: sample {sample.key!r} (member {sample.key}.{ext})", bad,
                              on_error, number, position, key=sample.key, digest=digest)
    return Record(number, text, None, position, key=sample.key, digest=digest)


def _member(sample: Sample, ext: str) -> bytes:
    """The bytes of the sample's member with extension `ext` (gunzipped for `.gz`)."""
    members = sample.members()
    if ext not in members:
        raise _BadRecord("missing_text", f"no {ext!r} member (the sample has "
                                         f"{sorted(members) or 'no members'}); set text_key")
    data = members[ext]
    if ext.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:  # in memory: damage, never an I/O error
            raise _BadRecord("unreadable", f"cannot decompress ({e})") from e
    return data


_READERS: dict[str, Callable[..., Iterator[Record]]] = {
    "jsonl": _read_text, "txt": _read_text, "parquet": _read_parquet, "wds": _read_tar,
}


# ---------------------------------------------------------------- an iterable of strings

def iter_strings(items: Iterable[Any], start: int, on_error: str,
                 start_digest: str | None = None) -> Iterator[Record]:
    """Records of an iterable of strings (the item index is the record number).

    `start_digest` is checked as in iter_records. An iterable cannot be reopened, so an error
    of the iterable itself propagates as it is.
    """
    prefix = _Prefix(ITERABLE_PATH, start, start_digest)
    for item in items:
        bad = _hash_item(prefix, item)
        if not prefix.advance():
            continue
        if bad is None:
            yield Record(prefix.number, item, None, 0, digest=prefix.digest())
        else:
            yield _skip_or_raise(f"inputs item {prefix.number}", bad, on_error, prefix.number, 0,
                                 digest=prefix.digest())
    prefix.check_end()


def _hash_item(prefix: _Prefix, item: Any) -> _BadRecord | None:
    """Hash one item (a string as UTF-8, anything else by its type name, since a repr can hold
    an address); return why it cannot be a document, or None."""
    if not isinstance(item, str):
        prefix.frame(b"x", type(item).__qualname__.encode())
        return _BadRecord("missing_text", f"has type {type(item).__name__}, not str")
    try:
        prefix.frame(b"s", item.encode("utf-8"))
        return None
    except UnicodeEncodeError as e:
        prefix.frame(b"s", item.encode("utf-8", "surrogatepass"))
        bad = _BadRecord("invalid_utf8", f"is not valid UTF-8 (a lone surrogate {item[e.start]!r} "
                                         f"at character {e.start})")
        bad.__cause__ = e
        return bad
