"""Build inputs: resolving paths and globs through fsspec, and reading records from them.

Each kind of file (JSON lines, text, Parquet, webdataset tar) has a reader yielding the records
of `records`, numbered and hashed in order, so a build can resume after record N of an input.

Errors are of three kinds. A bad record (malformed JSON, invalid UTF-8, ...) or a damaged file
(truncated or corrupted) is an InputError, which on_error="skip" skips and counts. An input that
changed since the interrupted build is an InputChangedError, never skipped. An I/O error reading
the input's bytes is transient: the input is reopened and read again from the last record, a few
times, and then the OSError is raised (never skipped: the rest of the input was not read).
"""

from __future__ import annotations

import gzip
import io
import json
import contextlib
import os
import shlex
import subprocess
import tarfile
import time
import zlib
from typing import IO, Any, Callable, Iterable, Iterator

import fsspec

from ..errors import InputError
from .records import (ITERABLE_PATH, SINCE_BUILD, SINCE_READ, BadRecord, CountingReader, InputSource,
                      Record, RecordNumbering, decode_utf8, json_object, json_text, skipped_record,
                      unreadable_record)
from .parquet_rows import BatchRows
from .wds import Sample, decode_tokens, iter_samples, parse_member_spec, sample_record

_JSONL = (".jsonl", ".ndjson")
_TEXT = (".txt",)
_TAR = (".tar", ".tar.gz", ".tgz")
PIPE = "pipe:"  # webdataset's URL scheme for the output of a shell command
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}
AUTO = "auto"  # compression told from the first bytes
SUPPORTED = "jsonl, jsonl.gz, jsonl.zst, ndjson, txt, txt.gz, txt.zst, parquet, tar, tar.gz, tgz"
_ATTEMPTS = 3         # reads of an input in a row that fail with an I/O error before giving up
_RETRY_DELAY = 0.5    # seconds before the first re-read; doubles before each next one


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
    if url.startswith(PIPE):
        return [_pipe_source(url)]
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
        if protocol in ("file", "local"):
            full = os.path.abspath(p)
            st = os.stat(full)
            size, stamp = st.st_size, f"mtime_ns={st.st_mtime_ns},ctime_ns={st.st_ctime_ns}"
        else:
            full = fs.unstrip_protocol(p)
            info = fs.info(p)
            size, stamp = info["size"], _remote_stamp(info)
        sources.append(InputSource(full, kind, compression, int(size), stamp))
    return sources


# what object stores and other file systems report about a version of a file, strongest first
_STAMP_KEYS = ("ETag", "etag", "VersionId", "version_id", "generation", "md5Hash", "LastModified",
               "last_modified", "updated", "mtime", "modified", "created")


def _remote_stamp(info: dict[str, Any]) -> str | None:
    """The file system's identity of this version of a file (ETag, version, modification time),
    or None when it reports none of them."""
    parts = [f"{key}={info[key]}" for key in _STAMP_KEYS if info.get(key) not in (None, "")]
    return ",".join(parts) or None


def _pipe_source(url: str) -> InputSource:
    """A webdataset-style `pipe:COMMAND` input: the bytes the shell command writes to stdout.

    Its kind is that of the last argument that names a supported file (`pipe:curl -s URL.tar`);
    whether its output is gzip or zstd compressed is told from its first bytes.
    """
    try:
        words = shlex.split(url[len(PIPE):])
    except ValueError as e:
        raise ValueError(f"input {url!r}: cannot parse the pipe command ({e})") from None
    for word in reversed(words):
        if _is_supported(word):
            kind, _ = _kind_of(word)
            break
    else:
        raise ValueError(f"input {url!r}: cannot tell the file type of the command's output; "
                         f"name a file of a supported type ({SUPPORTED}) in the command")
    if kind == "parquet":
        raise ValueError(f"input {url!r}: Parquet needs random access and cannot be read from a "
                         "pipe; copy the file, or give its URL")
    return InputSource(url, kind, None if kind == "wds" else AUTO, None, None)


@contextlib.contextmanager
def _open_input(source: InputSource, options: dict[str, Any]) -> Iterator[IO[bytes]]:
    """The raw bytes of an input: an fsspec file, or the stdout of a `pipe:` command."""
    if not source.path.startswith(PIPE):
        with fsspec.open(source.path, "rb", **options) as raw:
            yield raw
        return
    process = subprocess.Popen(source.path[len(PIPE):], shell=True, stdout=subprocess.PIPE,
                               stdin=subprocess.DEVNULL)
    try:
        yield _PipeReader(source.path, process)
    finally:
        process.stdout.close()
        if process.poll() is None:
            process.kill()  # the reader stopped early (a bad record, or the build was stopped)
        process.wait()


class _PipeReader(io.RawIOBase):
    """A command's stdout; at its end, a command that failed is an OSError (so it is retried
    like any I/O error, never taken for a truncated file)."""

    def __init__(self, url: str, process: subprocess.Popen):
        self.url, self.process = url, process

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.process.stdout.readinto(buffer)
        if not n and len(buffer):
            status = self.process.wait()
            if status != 0:
                raise OSError(f"input {self.url!r}: the command exited with status {status} "
                              "(its messages, if any, are on stderr above)")
        return n


def input_kind(url: str) -> str | None:
    """The kind of input a URL's name says it is ("jsonl", "txt", "parquet", "wds"), a `pipe:`
    command's by the file it names; None where the name does not say (a directory, another
    name). Lets convert_webdataset refuse what is not a tar before a build starts."""
    if url.startswith(PIPE):
        try:
            return _pipe_source(url).kind
        except ValueError:  # (the build names what is wrong with the command)
            return None
    return _kind_of(url)[0] if _is_supported(url) else None


def _is_supported(path: str) -> bool:
    try:
        _kind_of(path)
        return True
    except ValueError:
        return False


def _unreadable(source: InputSource, numbering: RecordNumbering, what: str, error: BaseException,
                counted: CountingReader, on_error: str) -> Record:
    return unreadable_record(source.path, "shard" if source.kind == "wds" else "file", numbering,
                             what, error, counted, on_error)


def _open_text_stream(source: InputSource, raw) -> tuple[io.BufferedReader, CountingReader]:
    counted = CountingReader(raw)
    stream: io.RawIOBase | io.BufferedIOBase = counted
    compression = source.compression
    if compression == AUTO:  # a pipe's output: compressed or not, whatever the command names
        stream = io.BufferedReader(counted, 1 << 20)
        head = stream.peek(4)[:4]
        compression = next((name for name, magic in _MAGIC.items() if head.startswith(magic)), None)
    if compression == "gzip":
        buffered = stream if stream is not counted else io.BufferedReader(counted, 1 << 20)
        stream = gzip.GzipFile(fileobj=buffered, mode="rb")
    elif compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise ImportError(f"input {source.path!r} is zstd-compressed: install the extra "
                              "`pip install torchcache-lm[zstd]` (the zstandard package)") from None
        stream = _ZstdReader(stream, zstandard)
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


# ---------------------------------------------------------------- reading file inputs

def iter_records(source: InputSource, text_key: str | None, start: int, on_error: str,
                 storage_options: dict[str, Any] | None = None, tokens: bool = False,
                 start_digest: str | None = None) -> Iterator[Record]:
    """Records of one file input after record `start`; malformed ones raise or are skipped.
    `text_key` None reads each record whole (`Record.obj`: a JSON lines object, a Parquet row
    as a dict, or a tar's sample as webdataset makes it).

    `start_digest` is the digest of record `start` when it was consumed: the records skipped
    must hash to it, else InputChangedError (None: no check, for caches made before digests).
    An I/O error reading the input is retried from the last record yielded, then raised as an
    OSError. `tokens=True` reads pre-tokenized documents (webdataset inputs only).
    """
    if tokens and source.kind != "wds":
        raise ValueError(f"{source.path}: pre-tokenized documents are read from webdataset tars only")
    read = _READERS[source.kind]
    options = storage_options or {}
    return _with_retries(source.path, lambda numbering: read(source, text_key, on_error, options,
                                                           tokens, numbering), start, start_digest)


def _with_retries(path: str, read: Callable[[RecordNumbering], Iterator[Record]], start: int,
                  start_digest: str | None) -> Iterator[Record]:
    """Records of `read`; after an I/O error, the input is read again from the last record read
    (skipping the records before it, checked by their digest), until _ATTEMPTS reads in a row
    fail without reading a new record. A missing file or a refused permission is not retried.

    The error raised names the input and keeps the I/O error's type (a PermissionError stays
    one), with the I/O error itself as its cause."""
    since, failures = SINCE_BUILD, 0
    while True:
        numbering = RecordNumbering(path, start, start_digest, since)
        try:
            yield from read(numbering)
            return
        except OSError as e:
            if numbering.number > start:  # progress: every record read was yielded, or is skipped
                start, start_digest, since, failures = numbering.number, numbering.digest(), SINCE_READ, 0
            failures += 1
            if isinstance(e, _PERMANENT):
                raise _same_type(e)(f"{path}: cannot read it ({type(e).__name__}: {e}) at record "
                                    f"{start + 1}; check that it exists and that these credentials "
                                    "may read it, then re-run the build to resume") from e
            if failures >= _ATTEMPTS:
                raise _same_type(e)(f"{path}: reading failed {failures} times ({type(e).__name__}: "
                                    f"{e}) at record {start + 1}; committed blocks are kept, re-run "
                                    "the build to resume") from e
            time.sleep(_RETRY_DELAY * 2 ** (failures - 1))


_PERMANENT = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def _same_type(error: OSError) -> type[OSError]:
    """The built-in OSError class of `error` (PermissionError, ConnectionResetError, ...): a
    library's own subclass may not take a message alone, so it becomes its nearest built-in."""
    for cls in type(error).__mro__:
        if cls.__module__ == "builtins" and issubclass(cls, OSError):
            return cls
    return OSError


def _read_text(source: InputSource, text_key: str, on_error: str, options: dict[str, Any],
               tokens: bool, numbering: RecordNumbering) -> Iterator[Record]:
    """Records of a JSON lines or text file (plain, gzip or zstd)."""
    with _open_input(source, options) as raw:
        stream, counted = _open_text_stream(source, raw)
        try:
            if source.kind == "txt":
                yield from _txt_records(source, stream, counted, on_error, numbering)
            else:
                yield from _jsonl_records(source, stream, counted, text_key, on_error, numbering)
        except (OSError, EOFError, zlib.error, _zstd_error()) as e:
            yield _unreadable(source, numbering, f"cannot read the {source.compression or 'file'} "
                                              f"stream{_where(source, numbering)}", e, counted, on_error)


def _where(source: InputSource, numbering: RecordNumbering) -> str:
    """Where in a text input reading stopped, for messages."""
    if source.kind == "txt":
        return ""
    return f" after line {numbering.number}" if numbering.number else " before its first line"


def _jsonl_records(source: InputSource, stream: io.BufferedReader, counted: CountingReader,
                   text_key: str, on_error: str, numbering: RecordNumbering) -> Iterator[Record]:
    """One record per line (blank lines are numbered and hashed, but yield nothing)."""
    for line in stream:
        numbering.update(line)
        if numbering.advance() and not line.isspace():
            yield _json_record(source, numbering.number, line, text_key, counted.count, on_error,
                               numbering.digest())
    numbering.check_end()


def _json_record(source: InputSource, number: int, line: bytes, text_key: str | None, position: int,
                 on_error: str, digest: str) -> Record:
    """The line's text field, or (text_key None) its whole object."""
    try:
        if text_key is None:
            return Record(number, None, None, position, digest=digest, obj=json_object(line, "line"))
        text = json_text(line, text_key, "line")
    except BadRecord as bad:
        return skipped_record(f"{source.path}:{number}", bad, on_error, number, position, digest=digest)
    return Record(number, text, None, position, digest=digest)


def _txt_records(source: InputSource, stream: io.BufferedReader, counted: CountingReader, on_error: str,
                 numbering: RecordNumbering) -> Iterator[Record]:
    """A text file is one record: the whole file."""
    data = stream.read()
    numbering.update(data)
    if numbering.advance():
        try:
            text = decode_utf8(data, "file")
        except BadRecord as bad:
            yield skipped_record(f"{source.path}:1", bad, on_error, 1, counted.count,
                                 digest=numbering.digest())
        else:
            yield Record(1, text, None, counted.count, digest=numbering.digest())
    numbering.check_end()


def _read_parquet(source: InputSource, text_key: str | None, on_error: str, options: dict[str, Any],
                  tokens: bool, numbering: RecordNumbering) -> Iterator[Record]:
    """Rows of a Parquet file, read one row group at a time (never the whole file); with
    `text_key` None, whole (see _parquet_rows)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"input {source.path!r} is Parquet: install the extra "
                          "`pip install torchcache-lm[parquet]` (the pyarrow package)") from None
    damage = (OSError, pa.ArrowException)  # pyarrow reports damage as OSError too; see _unreadable
    with _open_input(source, options) as raw:
        counted = CountingReader(raw)
        try:
            pf = pq.ParquetFile(counted)
        except damage as e:
            yield _unreadable(source, numbering, "not a readable Parquet file", e, counted, on_error)
            return
        if text_key is None:
            yield from _parquet_rows(pa, pf, source, counted, on_error, numbering)
            return
        if text_key not in pf.schema_arrow.names:
            raise InputError(f"{source.path}: no column {text_key!r} (columns: "
                             f"{pf.schema_arrow.names[:8]}); set text_key to the text column")
        for group in range(pf.num_row_groups):
            try:
                values, is_text = _parquet_column(pa, pf, group, text_key)
            except damage as e:
                yield _unreadable(source, numbering, f"cannot read row group {group}", e, counted, on_error)
                return
            position = int(source.size * (group + 1) / max(pf.num_row_groups, 1)) if source.size else 0
            for value in values:
                if is_text and value is not None:
                    numbering.frame(b"s", value)
                else:
                    numbering.frame(b"x", type(value).__name__.encode())
                if numbering.advance():
                    yield _parquet_record(source, numbering.number, value, is_text, text_key, position,
                                          on_error, numbering.digest())
        numbering.check_end()


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
            raise BadRecord("missing_text", f"row {number}: column {text_key!r} is "
                                             f"{type(value).__name__}, not a string")
        text = decode_utf8(value, "row")
    except BadRecord as bad:
        return skipped_record(f"{source.path}:{number}", bad, on_error, number, position, digest=digest)
    return Record(number, text, None, position, digest=digest)


_ROW_BATCH_BYTES = 8 << 20  # Arrow bytes of the rows read whole at a time (per the row group's size)
_ROW_BATCH_ROWS = 4096


def _parquet_rows(pa, pf, source: InputSource, counted: CountingReader, on_error: str,
                  numbering: RecordNumbering) -> Iterator[Record]:
    """Each row of a Parquet file as a dict of column -> Python value (list columns as lists),
    read in record batches of about _ROW_BATCH_BYTES (never a whole row group of large rows);
    rows before the resume point are hashed, not made into Python values."""
    damage = (OSError, pa.ArrowException)
    total, done = max(pf.metadata.num_rows, 1), 0
    for group in range(pf.num_row_groups):
        meta = pf.metadata.row_group(group)
        size = max(1, min(_ROW_BATCH_ROWS, _ROW_BATCH_BYTES * meta.num_rows // max(meta.total_byte_size, 1)))
        batches = pf.iter_batches(batch_size=size, row_groups=[group], use_threads=False)
        while True:
            try:
                batch = next(batches, None)
            except damage as e:
                yield _unreadable(source, numbering, f"cannot read row group {group}", e, counted, on_error)
                return
            if batch is None:
                break
            rows = BatchRows(pa, batch)
            done += batch.num_rows
            position = int(source.size * done / total) if source.size else 0
            for i in range(batch.num_rows):
                for tag, data in rows.frames(i):
                    numbering.frame(tag, data)
                if numbering.advance():
                    yield _parquet_row(source, numbering, rows.row(i), position, on_error)
    numbering.check_end()


def _parquet_row(source: InputSource, numbering: RecordNumbering, row: dict[str, Any] | BadRecord,
                 position: int, on_error: str) -> Record:
    number = numbering.number
    if isinstance(row, BadRecord):
        bad = BadRecord(row.reason, f"row {number}: {row.detail}")
        bad.__cause__ = row.__cause__
        return skipped_record(f"{source.path}:{number}", bad, on_error, number, position,
                              digest=numbering.digest())
    return Record(number, None, None, position, digest=numbering.digest(), obj=row)


def _read_tar(source: InputSource, text_key: str | None, on_error: str, options: dict[str, Any],
              tokens: bool, numbering: RecordNumbering) -> Iterator[Record]:
    """Samples of one webdataset shard, as text or token records, or (text_key None) whole, as
    webdataset's reader makes them (see wds.sample_record)."""
    ext, field = parse_member_spec(text_key) if text_key is not None else ("", None)
    last = ""
    with _open_input(source, options) as raw:
        counted = CountingReader(raw)
        try:
            for sample in iter_samples(io.BufferedReader(counted, 1 << 20), bare=text_key is not None):
                _hash_sample(numbering, sample)
                last = sample.last_name
                if not numbering.advance():
                    continue
                if text_key is None:
                    yield _whole_sample(source, numbering.number, sample, counted.count, on_error,
                                        numbering.digest())
                else:
                    yield _sample_record(source, numbering.number, sample, ext, field, tokens,
                                         counted.count, on_error, numbering.digest())
            numbering.check_end()
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            where = f"after member {last!r}" if last else "at its start"
            yield _unreadable(source, numbering, f"cannot read the tar {where}", e, counted, on_error)


def _hash_sample(numbering: RecordNumbering, sample: Sample) -> None:
    numbering.frame(b"k", sample.key.encode("utf-8", "surrogateescape"))
    for name, data in sample.files:
        numbering.frame(b"n", name.encode("utf-8", "surrogateescape"))
        numbering.frame(b"d", data)


def _whole_sample(source: InputSource, number: int, sample: Sample, position: int, on_error: str,
                  digest: str) -> Record:
    """A sample as a record of a pipeline: its members' bytes by extension, "__key__", "__url__"."""
    try:
        obj = sample_record(sample, source.path)
    except ValueError as e:
        bad = BadRecord("bad_content", str(e))
        return skipped_record(f"{source.path}: sample {sample.key!r}", bad, on_error, number,
                              position, key=sample.key, digest=digest)
    return Record(number, None, None, position, key=sample.key, digest=digest, obj=obj)


def _sample_record(source: InputSource, number: int, sample: Sample, ext: str, field: str | None,
                   tokens: bool, position: int, on_error: str, digest: str) -> Record:
    try:
        content = _member(sample, ext)
        if tokens:
            try:
                ids = decode_tokens(content, ext, field)
            except ValueError as e:
                raise BadRecord("bad_tokens", str(e)) from e
            return Record(number, None, None, position, tokens=ids, key=sample.key, digest=digest)
        if field is None:
            text = decode_utf8(content, "member")
        else:
            text = json_text(content, field, "member")
    except BadRecord as bad:
        return skipped_record(f"{source.path}: sample {sample.key!r} (member {sample.key}.{ext})", bad,
                              on_error, number, position, key=sample.key, digest=digest)
    return Record(number, text, None, position, key=sample.key, digest=digest)


def _member(sample: Sample, ext: str) -> bytes:
    """The bytes of the sample's member with extension `ext` (gunzipped for `.gz`)."""
    members = sample.members()
    if ext not in members:
        raise BadRecord("missing_text", f"no {ext!r} member (the sample has "
                                         f"{sorted(members) or 'no members'}); set text_key")
    data = members[ext]
    if ext.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:  # in memory: damage, never an I/O error
            raise BadRecord("unreadable", f"cannot decompress ({e})") from e
    return data


_READERS: dict[str, Callable[..., Iterator[Record]]] = {
    "jsonl": _read_text, "txt": _read_text, "parquet": _read_parquet, "wds": _read_tar,
}


# ---------------------------------------------------------------- an iterable of strings

def iter_strings(items: Iterable[Any], start: int, on_error: str,
                 start_digest: str | None = None, output: str | None = None,
                 objects: bool = False) -> Iterator[Record]:
    """Records of an iterable of strings (the item index is the record number), or with
    `objects`, of dicts (records of a chat or instruction build, hashed as canonical JSON).

    `start_digest` is checked as in iter_records (a changed stream is named as the iterable
    given for `output`). An iterable cannot be reopened, so an error of the iterable itself
    propagates as it is.
    """
    name = ITERABLE_PATH if output is None else f"{output}: the iterable of strings given"
    numbering = RecordNumbering(name, start, start_digest)
    for item in items:
        bad = _hash_object(numbering, item) if objects else _hash_item(numbering, item)
        if not numbering.advance():
            continue
        if bad is None and objects:
            yield Record(numbering.number, None, None, 0, digest=numbering.digest(), obj=item)
        elif bad is None:
            yield Record(numbering.number, item, None, 0, digest=numbering.digest())
        else:
            yield skipped_record(f"inputs item {numbering.number}", bad, on_error, numbering.number, 0,
                                 digest=numbering.digest())
    numbering.check_end()


def content_identity(records: Iterable[Record]) -> tuple[int, str | None]:
    """The number and digest of the last record of a whole input read from its start with
    on_error='skip': what a finished build records as that input's final progress."""
    number, digest = 0, None
    for record in records:
        number, digest = record.number, record.digest
    return number, digest


def _hash_object(numbering: RecordNumbering, item: Any) -> BadRecord | None:
    """Hash one record of an iterable of dicts (as canonical JSON); why it cannot be one, or None."""
    if not isinstance(item, dict):
        numbering.frame(b"x", type(item).__qualname__.encode())
        return BadRecord("no_messages", f"has type {type(item).__name__}, not dict")
    try:
        data = json.dumps(item, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        numbering.frame(b"o", data.encode("utf-8"))
        return None
    except (TypeError, ValueError, UnicodeEncodeError) as e:
        numbering.frame(b"x", type(e).__qualname__.encode())
        return BadRecord("bad_content", f"is not plain JSON data ({e})")


def _hash_item(numbering: RecordNumbering, item: Any) -> BadRecord | None:
    """Hash one item (a string as UTF-8, anything else by its type name, since a repr can hold
    an address); return why it cannot be a document, or None."""
    if not isinstance(item, str):
        numbering.frame(b"x", type(item).__qualname__.encode())
        return BadRecord("missing_text", f"has type {type(item).__name__}, not str")
    try:
        numbering.frame(b"s", item.encode("utf-8"))
        return None
    except UnicodeEncodeError as e:
        numbering.frame(b"s", item.encode("utf-8", "surrogatepass"))
        bad = BadRecord("invalid_utf8", f"is not valid UTF-8 (a lone surrogate {item[e.start]!r} "
                                         f"at character {e.start})")
        bad.__cause__ = e
        return bad
