"""Records: what every input reader yields, and the bookkeeping shared by all readers.

Each input yields records in a fixed order, numbered from 1 (the line number for JSON lines), so
a build can resume after record N of an input and a bad record can be named by file and line.
Every record carries a digest of the raw content of the input up to it, so a resumed build can
tell that the records it skips are the ones the interrupted build consumed.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any

from ..errors import InputChangedError, InputError

ITERABLE_PATH = "<iterable>"  # the input path recorded for a build from an iterable of strings
SKIP_REASONS = ("malformed_json", "missing_text", "invalid_utf8", "unreadable", "bad_tokens",
                "no_messages", "empty_conversation", "unknown_role", "bad_content", "role_order",
                "unstable_template", "template_limit", "template_error", "filtered", "map_error",
                "bad_labels", "bad_array")
SINCE_BUILD = "since the interrupted build"
SINCE_READ = "while it was being read"


@dataclass(frozen=True)
class InputSource:
    """One input shard: a file (by URL) of a known kind, or the caller's iterable of strings."""

    path: str
    kind: str  # "jsonl", "txt", "parquet" or "wds" (webdataset tar)
    compression: str | None
    size: int | None
    # what the file system says identifies this version of the file (mtime, ETag, version),
    # opaque; None when it says nothing (a pipe): then only the content can tell a change
    stamp: str | None = None

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
    obj: Any = None         # the whole parsed record, when the build reads more than a text field


class CountingReader(io.RawIOBase):
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


class RecordNumbering:
    """Numbers the records of one read of an input and hashes their raw content, in order.

    A resumed read skips records 1..start; their digest must equal `start_digest`, the one
    stored when they were consumed, or the input changed and resuming would mix two versions.
    """

    def __init__(self, name: str, start: int, start_digest: str | None, since: str = SINCE_BUILD):
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


class BadRecord(Exception):
    """Why a record cannot become a document: a reason from SKIP_REASONS and what is wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        if reason not in SKIP_REASONS:
            raise AssertionError(f"unknown skip reason {reason!r}")
        self.reason, self.detail = reason, detail


def raise_or_count(where: str, bad: BadRecord, on_error: str) -> str:
    """The one place that decides about a bad record: an InputError naming it
    (on_error='raise'), or the reason to count it under (on_error='skip')."""
    if on_error == "raise":
        raise InputError(f"{where}: {bad.detail}. Fix the input, or pass on_error='skip' to skip "
                         "and count such records") from bad.__cause__
    return bad.reason


def skipped_record(where: str, bad: BadRecord, on_error: str, number: int, position: int,
                   key: str | None = None, digest: str | None = None) -> Record:
    """A bad record: an InputError naming it (on_error='raise'), or the record, skipped."""
    return Record(number, None, raise_or_count(where, bad, on_error), position, key=key, digest=digest)


def unreadable_record(path: str, unit: str, numbering: RecordNumbering, what: str,
                      error: BaseException, counted: CountingReader, on_error: str) -> Record:
    """The rest of the input cannot be decoded: an InputError, or a skipped record ending it.

    An I/O error reading the input's bytes is not damage: it is raised again, to be retried.
    """
    if counted.failure is not None:
        raise error
    numbering.check_end(" readable")
    message = " ".join(str(error).split())  # pyarrow's messages span lines
    bad = BadRecord("unreadable", f"{what} ({type(error).__name__}: {message}); the {unit} is "
                                  "truncated or corrupted")
    bad.__cause__ = error
    return skipped_record(path, bad, on_error, numbering.number + 1, counted.count,
                          digest=numbering.digest())


def decode_utf8(data: bytes, unit: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRecord("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the {unit}") from e


def json_object(data: bytes, unit: str) -> Any:
    """The JSON value in `data` (a line or a member: `unit`)."""
    try:
        return json.loads(decode_utf8(data, unit))
    except ValueError as e:
        raise BadRecord("malformed_json", f"malformed JSON ({e})") from e
    except RecursionError as e:  # json's parser recurses once per level of nesting
        raise BadRecord("malformed_json", "malformed JSON (nested too deeply to parse)") from e


def json_text(data: bytes, field: str, unit: str) -> str:
    """The string in field `field` of the JSON object in `data` (a line or a member: `unit`)."""
    obj = json_object(data, unit)
    if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise BadRecord("missing_text", f"no {field!r} field (found {keys}); set text_key to the "
                                        "field that holds the text")
    text = obj[field]
    if not isinstance(text, str):
        raise BadRecord("missing_text", f"field {field!r} is a {type(text).__name__}, not a string")
    if not text.isascii():  # O(1); only non-ASCII text can hold a surrogate
        _check_utf8(text, field)
    return text


def _check_utf8(text: str, field: str) -> None:
    """A JSON `\\ud800` escape gives a lone surrogate, which is not UTF-8: left in, it would fail
    in the tokenizer, far from its file and line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRecord("invalid_utf8", f"field {field!r} is not valid UTF-8 (a lone surrogate "
                                        f"{text[e.start]!r} at character {e.start})") from e
