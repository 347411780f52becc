"""Build inputs: resolving paths and globs through fsspec, and reading documents from them.

Each input yields records in a fixed order, numbered from 1 (the line number for JSON lines), so
a build can resume after record N of an input and a bad record can be named by file and line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import fsspec

ITERABLE_PATH = "<iterable>"
_JSONL = (".jsonl", ".ndjson")
_TEXT = (".txt",)
_TAR = (".tar", ".tar.gz", ".tgz")
_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
SUPPORTED = "jsonl, jsonl.gz, jsonl.zst, ndjson, txt, txt.gz, txt.zst, parquet, tar, tar.gz, tgz"
SKIP_REASONS = ("malformed_json", "missing_text", "invalid_utf8", "unreadable", "bad_tokens")


class InputError(ValueError):
    """A malformed input record: the message names the file and line and what to do."""


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
    """Counts raw bytes read, so progress can be reported for compressed inputs too."""

    def __init__(self, f):
        self.f, self.count = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.f.read(len(buffer))
        buffer[: len(data)] = data
        self.count += len(data)
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


def iter_records(source: InputSource, text_key: str, start: int, on_error: str,
                 storage_options: dict[str, Any] | None = None, tokens: bool = False) -> Iterator[Record]:
    """Records of one file input after record `start`; malformed ones raise or are skipped.

    `tokens=True` reads pre-tokenized documents (webdataset inputs only).
    """
    if source.kind == "wds":
        from .convert import iter_tar_records
        yield from iter_tar_records(source, text_key, start, on_error, storage_options, tokens)
        return
    if tokens:
        raise ValueError(f"{source.path}: pre-tokenized documents are read from webdataset tars only")
    if source.kind == "parquet":
        yield from _iter_parquet(source, text_key, start, on_error, storage_options)
        return
    with fsspec.open(source.path, "rb", **(storage_options or {})) as raw:
        stream, counted = _open_text_stream(source, raw)
        number = 0
        try:
            if source.kind == "txt":
                if start < 1:
                    data = stream.read()
                    yield _text_record(source, 1, data, counted.count, on_error)
                return
            for line in stream:
                number += 1
                if number <= start or not line.strip():
                    continue
                yield _json_record(source, number, line, text_key, counted.count, on_error)
        except (EOFError, OSError, zlib.error, _zstd_error()) as e:
            where = f"after line {number}" if source.kind == "jsonl" else ""
            message = (f"{source.path}: cannot read the {source.compression or 'file'} stream "
                       f"{where} ({type(e).__name__}: {e}); the file is truncated or corrupted")
            if on_error == "raise":
                raise InputError(message + "; fix or remove it, or pass on_error='skip'") from None
            yield Record(number + 1, None, "unreadable", counted.count)


def _iter_parquet(source: InputSource, text_key: str, start: int, on_error: str,
                  storage_options: dict[str, Any] | None) -> Iterator[Record]:
    """Rows of a Parquet file, read one row group at a time (never the whole file)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"input {source.path!r} is Parquet: install the extra "
                          "`pip install torchcache-lm[parquet]` (the pyarrow package)") from None
    with fsspec.open(source.path, "rb", **(storage_options or {})) as raw:
        try:
            pf = pq.ParquetFile(raw)
        except Exception as e:
            message = f"{source.path}: not a readable Parquet file ({e})"
            if on_error == "raise":
                raise InputError(message + "; fix or remove it, or pass on_error='skip'") from None
            yield Record(start + 1, None, "unreadable", 0)
            return
        if text_key not in pf.schema_arrow.names:
            raise InputError(f"{source.path}: no column {text_key!r} (columns: "
                             f"{pf.schema_arrow.names[:8]}); set text_key to the text column")
        number = 0
        for group in range(pf.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            if number + rows <= start:
                number += rows
                continue
            try:
                column = pf.read_row_group(group, columns=[text_key]).column(0).to_pylist()
            except Exception as e:
                message = (f"{source.path}: cannot read row group {group} ({type(e).__name__}: {e}); "
                           "the file is truncated or corrupted")
                if on_error == "raise":
                    raise InputError(message + "; fix or remove it, or pass on_error='skip'") from None
                yield Record(number + 1, None, "unreadable", 0)
                return
            position = int(source.size * (group + 1) / max(pf.num_row_groups, 1)) if source.size else 0
            for text in column:
                number += 1
                if number <= start:
                    continue
                if isinstance(text, str):
                    yield Record(number, text, None, position)
                else:
                    yield _problem(source, number, "missing_text",
                                   f"row {number}: column {text_key!r} is {type(text).__name__}, "
                                   "not a string", position, on_error)


def _zstd_error() -> type[BaseException]:
    try:
        import zstandard
        return zstandard.ZstdError
    except ImportError:
        return OSError


def _text_record(source: InputSource, number: int, data: bytes, position: int, on_error: str) -> Record:
    try:
        return Record(number, data.decode("utf-8"), None, position)
    except UnicodeDecodeError as e:
        return _problem(source, number, "invalid_utf8",
                        f"invalid UTF-8 at byte {e.start}", position, on_error)


def _json_record(source: InputSource, number: int, line: bytes, text_key: str, position: int,
                 on_error: str) -> Record:
    try:
        text_line = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return _problem(source, number, "invalid_utf8", f"invalid UTF-8 at byte {e.start} of the line",
                        position, on_error)
    try:
        obj = json.loads(text_line)
    except ValueError as e:
        return _problem(source, number, "malformed_json", f"malformed JSON ({e})", position, on_error)
    if not isinstance(obj, dict) or text_key not in obj:
        keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        return _problem(source, number, "missing_text",
                        f"no {text_key!r} field (found {keys}); set text_key to the field that "
                        "holds the text", position, on_error)
    text = obj[text_key]
    if not isinstance(text, str):
        return _problem(source, number, "missing_text",
                        f"field {text_key!r} is a {type(text).__name__}, not a string", position, on_error)
    return Record(number, text, None, position)


def _problem(source: InputSource, number: int, reason: str, detail: str, position: int,
             on_error: str) -> Record:
    if on_error == "raise":
        raise InputError(f"{source.path}:{number}: {detail}. Fix the input, or pass on_error='skip' "
                         "to skip and count such records")
    return Record(number, None, reason, position)


def iter_strings(items: Iterable[Any], start: int, on_error: str) -> Iterator[Record]:
    """Records of an iterable of strings (the item index is the record number)."""
    for number, item in enumerate(items, 1):
        if number <= start:
            continue
        if isinstance(item, str):
            yield Record(number, item, None, 0)
        elif on_error == "raise":
            raise InputError(f"inputs item {number} is a {type(item).__name__}, not a string")
        else:
            yield Record(number, None, "missing_text", 0)
