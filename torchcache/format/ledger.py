"""Format v2: commits are appends to a commit log and a binary block index; head.json says how
much of them is committed.

Layout (docs/format.md has the byte-level spec):

    manifest.json      format, version 2, spec, fingerprint: written once, when the build starts
    head.json          the commit point, replaced atomically by every commit
    index/NNNNNN.bin   the committed stream's blocks, in stream order: one 128-byte RECORD each,
                       CHUNK_RECORDS per chunk file
    log/NNNNNN.jsonl   the builder's commit log: one JSON line per finished block or input, in
                       commit order, CHUNK_RECORDS per chunk file (resume and verify read it)

A commit appends to the last chunk of the log and of the index (locally O(new bytes); an object
store rewrites that one chunk, at most CHUNK_RECORDS records) and then replaces head.json. A
reader reads only the records head.json counts, so bytes a crash left past them are ignored, and
the next commit overwrites them. Opening a cache reads head.json and the index (binary, 128 bytes
per block, no per-entry parsing); following a growing cache reads head.json and the new records.
v1 caches (one manifest.json holding everything) are read as they are; `upgrade` converts one.
"""

from __future__ import annotations

import itertools
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .._util import hooks
from ..errors import CacheFormatError
from . import blocks as fmt
from . import documents
from . import provenance
from .storage import HEAD, LocalStorage, RemoteStorage, Storage, open_storage

HEAD_NAME = HEAD
INDEX_DIR = "index"
LOG_DIR = "log"
# Records per index and log chunk for new caches (each cache's manifest records its own)
CHUNK_RECORDS = 4096
MAX_HEAD_BYTES = 1 << 20
MAX_LOG_CHUNK_BYTES = 256 << 20
PROGRESS_FIELDS = ("records", "skipped", "blocks", "done", "digest")  # an input's, in a final head

RECORD = np.dtype([
    ("num_tokens", "<i8"), ("num_documents", "<i8"), ("size", "<i8"),
    ("input", "<i4"), ("index", "<i4"),
    ("checksum", "u1", (32,)), ("offsets_checksum", "u1", (32,)),
    ("keys_checksum", "u1", (32,)),  # v1/v2: the keys file's, all zero for none; v3: the
                                     # documents sidecar's (see documents.py)
])
assert RECORD.itemsize == 128
_NO_KEYS = bytes(32)


def new_chunk_records() -> int:
    """Records per index and log chunk of a new cache: CHUNK_RECORDS (tests shrink it through
    `hooks.chunk_records` to cross chunk boundaries with a few blocks)."""
    return hooks.chunk_records or CHUNK_RECORDS


def index_chunk_name(chunk: int) -> str:
    return f"{INDEX_DIR}/{chunk:06d}.bin"


def log_chunk_name(chunk: int) -> str:
    return f"{LOG_DIR}/{chunk:06d}.jsonl"


def empty_head(fingerprint: str) -> dict[str, Any]:
    """The head of a cache that has committed nothing yet."""
    return {"format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "fingerprint": fingerprint,
            "blocks": 0, "records": 0, "num_tokens": 0, "num_documents": 0, "complete": False, "skipped": {}}


# ---------------------------------------------------------------- block records

def _digest_bytes(checksum: str) -> bytes:
    return bytes.fromhex(checksum.split(":", 1)[1])


def records_of(entries: Iterable[dict[str, Any]]) -> np.ndarray:
    """Index records of block entries (dicts as the builder and v1 manifests write them)."""
    entries = list(entries)
    records = np.zeros(len(entries), dtype=RECORD)
    for k, e in enumerate(entries):
        keys = _digest_bytes(e["keys_checksum"]) if "keys" in e else \
            _digest_bytes(e["docs_checksum"]) if "docs" in e else _NO_KEYS
        records[k] = (e["num_tokens"], e["num_documents"], e["size"], e["input"], e["index"],
                      np.frombuffer(_digest_bytes(e["checksum"]), np.uint8),
                      np.frombuffer(_digest_bytes(e["offsets_checksum"]), np.uint8),
                      np.frombuffer(keys, np.uint8))
    return records


class BlockTable:
    """The committed stream's blocks as arrays, one index record each: all a reader needs.

    Paths follow from (input, index); checksums are kept as raw bytes. Pickles as a few arrays.
    """

    def __init__(self, records: np.ndarray, docs: bool = False):
        self.docs = docs  # the third checksum is a documents sidecar's (v3), else a keys file's
        self._records = np.array(records, dtype=RECORD)
        self._tokens = np.zeros(len(records) + 1, dtype=np.int64)
        np.cumsum(records["num_tokens"], out=self._tokens[1:])
        self._docs = np.zeros(len(records) + 1, dtype=np.int64)
        np.cumsum(records["num_documents"], out=self._docs[1:])
        self._filled = [len(records)]  # shared by the tables sharing these arrays
        self._set_views(len(records))

    def _set_views(self, n: int) -> None:
        self.n = n
        self.records = self._records[:n]
        self.token_starts = self._tokens[: n + 1]  # global token where each block starts, + total
        self.doc_starts = self._docs[: n + 1]

    def __getstate__(self) -> dict[str, Any]:
        return {"records": self.records, "docs": self.docs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["records"], state["docs"])

    @classmethod
    def from_entries(cls, entries: Iterable[dict[str, Any]], docs: bool = False) -> "BlockTable":
        return cls(records_of(entries), docs)

    def __len__(self) -> int:
        return len(self.records)

    def extended(self, more: np.ndarray) -> "BlockTable":
        """This table with `more` blocks after it, in amortized O(len(more)): the arrays grow
        geometrically and are shared (this table's views of them never change)."""
        n, m = self.n, len(more)
        table = BlockTable.__new__(BlockTable)
        table.docs = self.docs
        if n + m <= len(self._records) and self._filled[0] == n:  # nobody appended past us yet
            table._records, table._tokens, table._docs = self._records, self._tokens, self._docs
            table._filled = self._filled
        else:
            table._filled = [0]
            capacity = max(2 * (n + m), 64)
            table._records = np.zeros(capacity, dtype=RECORD)
            table._records[:n] = self.records
            table._tokens = np.zeros(capacity + 1, dtype=np.int64)
            table._tokens[: n + 1] = self.token_starts
            table._docs = np.zeros(capacity + 1, dtype=np.int64)
            table._docs[: n + 1] = self.doc_starts
        table._records[n: n + m] = more
        table._tokens[n + 1: n + m + 1] = self.token_starts[-1] + np.cumsum(more["num_tokens"])
        table._docs[n + 1: n + m + 1] = self.doc_starts[-1] + np.cumsum(more["num_documents"])
        table._filled[0] = n + m
        table._set_views(n + m)
        return table

    def path(self, b: int) -> str:
        return fmt.block_name(int(self.records["input"][b]), int(self.records["index"][b]))

    def offsets_path(self, b: int) -> str:
        return fmt.offsets_name(self.path(b))

    def keys_path(self, b: int) -> str | None:
        return fmt.keys_name(self.path(b)) if self.has_keys(b) else None

    def has_keys(self, b: int) -> bool:
        return not self.docs and self.records["keys_checksum"][b].any()

    def docs_path(self, b: int) -> str:
        """Block b's documents sidecar (v3 caches only)."""
        return fmt.docs_name(self.path(b))

    def checksum(self, b: int, field: str = "checksum") -> str:
        return "sha256:" + self.records[field][b].tobytes().hex()

    def size(self, b: int) -> int:
        return int(self.records["size"][b])

    def input(self, b: int) -> int:
        return int(self.records["input"][b])

    def entries(self) -> list[dict[str, Any]]:
        """Every block as :meth:`entry` gives it: the build record's (v1-shaped) block list."""
        return [self.entry(b) for b in range(self.n)]

    def entry(self, b: int) -> dict[str, Any]:
        """Block b as the builder writes entries (and v1 manifests hold them)."""
        r = self.records[b]
        path = self.path(b)
        entry = {"path": path, "checksum": self.checksum(b), "size": int(r["size"]),
                 "offsets": fmt.offsets_name(path), "offsets_checksum": self.checksum(b, "offsets_checksum"),
                 "num_tokens": int(r["num_tokens"]), "num_documents": int(r["num_documents"]),
                 "input": int(r["input"]), "index": int(r["index"])}
        if self.has_keys(b):
            entry.update(keys=fmt.keys_name(path), keys_checksum=self.checksum(b, "keys_checksum"))
        if self.docs:
            entry.update(docs=fmt.docs_name(path), docs_checksum=self.checksum(b, "keys_checksum"))
        return entry


# ---------------------------------------------------------------- what a reader opens

@dataclass
class CacheState:
    """A cache as a reader sees it at one commit: identity, committed blocks, status."""

    version: int
    spec: dict[str, Any]
    fingerprint: str
    complete: bool
    skipped: dict[str, int]
    table: BlockTable
    head: dict[str, Any] | None  # v2 only
    chunk_records: int = 0  # v2 only
    per_input: np.ndarray | None = None  # v2: committed blocks of each input (to check new ones)


def open_state(storage: Storage, *, check_order: bool = True) -> CacheState:
    """The committed state of the cache in `storage` (v1 or v2), validated."""
    manifest, version, path = fmt.load_manifest(storage)
    if version == 1:
        fmt.check_manifest(manifest, path)
        if check_order:
            _raise_order_problem(manifest, path)
        return CacheState(1, manifest["spec"], manifest["fingerprint"], manifest["complete"],
                          dict(manifest.get("skipped", {})), BlockTable.from_entries(manifest["blocks"]),
                          None)
    spec, chunk = _v2_header(manifest, path)
    head = read_head(storage, manifest["fingerprint"])
    records = read_index(storage, 0, head["blocks"], chunk)
    check_records(records, len(spec["inputs"]), np.zeros(len(spec["inputs"]), np.int64), -1,
                  f"{storage.url}/{INDEX_DIR}")
    table = BlockTable(records, docs=version == documents.DOCS_VERSION)
    _check_totals(head, table, storage)
    per_input = np.bincount(records["input"], minlength=len(spec["inputs"])).astype(np.int64)
    return CacheState(version, spec, manifest["fingerprint"], head["complete"], dict(head["skipped"]),
                      table, head, chunk, per_input)


def _v2_header(manifest: dict[str, Any], path: str) -> tuple[dict[str, Any], int]:
    """The spec and chunk size of a v2 manifest, validated."""
    spec = fmt.check_header(manifest, path)
    chunk = manifest.get("chunk_records")
    if type(chunk) is not int or not 1 <= chunk <= 1 << 20:
        raise CacheFormatError(f"{path}: chunk_records {chunk!r} is not a chunk size; the manifest "
                               "is corrupted (restore it or rebuild the cache)")
    return spec, chunk


def refresh_state(storage: Storage, state: CacheState) -> CacheState:
    """The cache's state now, reading only what was committed since `state` (v2), or the whole
    manifest again (v1). CacheFormatError if the committed stream changed."""
    if state.version == 1:
        return open_state(storage)
    head = read_head(storage, state.fingerprint)
    old = state.head
    if head["blocks"] < old["blocks"] or (old["complete"] and not head["complete"]) or (
            "inputs" not in head and head["records"] < old["records"]):
        raise CacheFormatError(f"{storage.url}: committed blocks changed under the reader; the "
                               "cache was rebuilt while open; reopen it")
    table, per_input = state.table, state.per_input
    if head["blocks"] > old["blocks"]:
        n_inputs = len(state.spec["inputs"])
        more = read_index(storage, old["blocks"], head["blocks"], state.chunk_records)
        last = _stream_key(table.records[-1:], n_inputs)[0] if len(table) else -1
        check_records(more, n_inputs, per_input, last, f"{storage.url}/{INDEX_DIR}",
                      first=old["blocks"])
        table = table.extended(more)
        per_input = per_input + np.bincount(more["input"], minlength=n_inputs)
    _check_totals(head, table, storage)
    return CacheState(state.version, state.spec, state.fingerprint, head["complete"], dict(head["skipped"]),
                      table, head, state.chunk_records, per_input)


def read_manifest(root: "str | os.PathLike | Storage", *, check_order: bool = True) -> dict[str, Any]:
    """The whole build record of a cache, v1 or v2, as a v1-shaped manifest: spec, fingerprint,
    blocks, pending, inputs (with progress), complete, skipped, totals. Validated.

    For the builder's resume, verify and repair (O(blocks)); readers use `open_state`.
    """
    storage = open_storage(root) if isinstance(root, (str, os.PathLike)) else root
    manifest, version, path = fmt.load_manifest(storage)
    if version == 1:
        fmt.check_manifest(manifest, path)
        if check_order:
            _raise_order_problem(manifest, path)
        return manifest
    state = open_state(storage, check_order=check_order)
    if "inputs" in state.head:
        if len(state.head["inputs"]) != len(state.spec["inputs"]):
            raise CacheFormatError(f"{storage.url}/{HEAD_NAME}: inputs has {len(state.head['inputs'])} "
                                   f"entries, the spec {len(state.spec['inputs'])}; the head is corrupted")
        entries = state.table.entries()
        progress = state.head["inputs"]
    else:
        try:
            entries, progress = replay_log(storage, state.spec, state.head["records"],
                                           state.chunk_records)
        except CacheFormatError:  # the build may have finished (and dropped its log) meanwhile
            again = open_state(storage, check_order=check_order)
            if "inputs" not in again.head:
                raise
            return read_manifest(storage, check_order=check_order)
    blocks = state.table.entries()
    visible = {(e["input"], e["index"]) for e in blocks}
    manifest = {
        "format": fmt.FORMAT_NAME, "version": state.version, "spec": state.spec,
        "fingerprint": state.fingerprint, "chunk_records": state.chunk_records,
        "blocks": blocks, "pending": [e for e in entries if (e["input"], e["index"]) not in visible],
        "complete": state.complete, "num_tokens": int(state.table.token_starts[-1]),
        "num_documents": int(state.table.doc_starts[-1]),
        "inputs": [dict(spec_input, **p) for spec_input, p in zip(state.spec["inputs"], progress)],
        "skipped": state.skipped,
    }
    if check_order:
        if blocks != _in_stream_positions(entries, blocks):
            raise CacheFormatError(f"{storage.url}/{INDEX_DIR}: the index disagrees with the commit "
                                   "log; the cache is corrupted (restore it or rebuild the cache)")
        _raise_order_problem(manifest, f"{storage.url}/{LOG_DIR}")
    return manifest


def _in_stream_positions(entries: list[dict], blocks: list[dict]) -> list[dict]:
    """The log's entries for the index's (input, index) pairs, in the index's order."""
    by_key = {(e["input"], e["index"]): e for e in entries}
    return [by_key.get((b["input"], b["index"])) for b in blocks]


def _raise_order_problem(manifest: dict[str, Any], path: str) -> None:
    problem = fmt.stream_order_problem(manifest)
    if problem is not None:
        raise CacheFormatError(f"{path}: {problem}")


def _check_totals(head: dict[str, Any], table: BlockTable, storage: Storage) -> None:
    for total, starts in (("num_tokens", table.token_starts), ("num_documents", table.doc_starts)):
        if head[total] != int(starts[-1]):
            raise CacheFormatError(f"{storage.url}/{HEAD_NAME}: {total} is {head[total]}, the index "
                                   f"adds up to {int(starts[-1])}; the cache is corrupted")


# ---------------------------------------------------------------- reading v2 files

def read_head(storage: Storage, fingerprint: str) -> dict[str, Any]:
    """head.json, validated; an empty head if the build has not committed yet."""
    path = f"{storage.url}/{HEAD_NAME}"
    try:
        data = fmt.read_capped_file(storage, HEAD_NAME, MAX_HEAD_BYTES)
    except FileNotFoundError:
        problem = missing_head(storage)
        if problem is not None:
            raise CacheFormatError(problem) from None
        return empty_head(fingerprint)
    head = fmt.decode_json(data, path, "head")

    def bad(what: str) -> CacheFormatError:
        return CacheFormatError(f"{path}: {what}; the cache's head is corrupted (restore it or "
                                "rebuild the cache)")

    if not isinstance(head, dict) or head.get("format") != fmt.FORMAT_NAME or head.get("version") != 2:
        raise bad("not a torchcache v2 head")
    if head.get("fingerprint") != fingerprint:
        raise bad("its fingerprint is not the manifest's (a head of another cache)")
    for key in ("blocks", "records", "num_tokens", "num_documents"):
        if type(head.get(key)) is not int or not 0 <= head[key] <= 1 << 62:
            raise bad(f"{key} must be a count, not {head.get(key)!r}")
    if not isinstance(head.get("complete"), bool):
        raise bad("complete must be true or false")
    if "inputs" in head:  # a complete cache's final head: each input's progress, no log
        if not head["complete"] or head["records"] != 0 or not isinstance(head["inputs"], list):
            raise bad("inputs belong only in a complete cache's head")
        for k, progress in enumerate(head["inputs"]):
            fmt.check_input_progress(progress, f"inputs[{k}]", path)
            if progress.get("done") is not True:
                raise bad(f"inputs[{k}] is not done in a complete cache")
    elif head["blocks"] > head["records"]:
        raise bad("more blocks than log records")
    skipped = head.get("skipped")
    if not isinstance(skipped, dict) or not all(type(v) is int and v >= 0 for v in skipped.values()):
        raise bad("skipped must map reasons to counts")
    if head.get(provenance.HEAD_KEY, True) is not True:
        raise bad(f"{provenance.HEAD_KEY} may only be true")
    return head


_CHUNK_FILE = re.compile(r"\d{6}\.(bin|jsonl)")
_BLOCK_FILE = re.compile(r"\d{6}-\d{6}\.safetensors")


def missing_head(storage: Storage) -> str | None:
    """What is wrong when a v2 cache has no head.json but holds what only commits make (index
    records, log records, block files: the builder's first commit writes head.json before any
    of them), or None when it has a head.json, or nothing committed yet (a new cache)."""
    if storage.exists(HEAD_NAME):
        return None
    found = [f"{d}/{n}" for d in (INDEX_DIR, LOG_DIR) for n in storage.listdir(d) if _CHUNK_FILE.fullmatch(n)]
    if not found:
        found = [f"{fmt.BLOCK_DIR}/{n}" for n in storage.listdir(fmt.BLOCK_DIR) if _BLOCK_FILE.fullmatch(n)]
    if not found:
        return None
    return (f"{storage.url}/{HEAD_NAME}: missing, but the cache holds committed data ({found[0]} "
            "and more): its commit point was deleted or lost, so none of it can be read. Run "
            f"`torchcache verify --repair {storage.url}` to restore head.json from the index and "
            "the commit log")


def lost_head(storage: Storage) -> str | None:
    """`missing_head` for a cache of format v2 (a v1 cache has no head.json); None for v1."""
    _, version, _ = fmt.load_manifest(storage)
    return missing_head(storage) if version >= 2 else None


def _chunks(start: int, stop: int, size: int) -> Iterable[tuple[int, int, int]]:
    """(chunk, first, end) record ranges, within each chunk of `size` records, covering
    [start, stop)."""
    k = start
    while k < stop:
        chunk = k // size
        end = min(stop, (chunk + 1) * size)
        yield chunk, k - chunk * size, end - chunk * size
        k = end


def read_index(storage: Storage, start: int, stop: int, chunk_records: int) -> np.ndarray:
    """Index records [start, stop) of the committed stream."""
    parts = []
    for chunk, first, end in _chunks(start, stop, chunk_records):
        rel = index_chunk_name(chunk)
        data = _read_range(storage, rel, first * RECORD.itemsize, end * RECORD.itemsize)
        parts.append(np.frombuffer(data, dtype=RECORD))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=RECORD)


def _read_range(storage: Storage, rel: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of a cache file; CacheFormatError if it is shorter or missing."""
    where = f"{storage.url}/{rel}"
    try:
        if isinstance(storage, LocalStorage):
            path, fd = fmt.CacheDir(storage.root).open(rel)
            try:
                size = os.fstat(fd).st_size
                data = fmt.read_exact(fd, start, stop - start, path) if size >= stop else b""
            finally:
                os.close(fd)
        else:
            assert isinstance(storage, RemoteStorage)
            data = storage.read_range(rel, start, stop)
    except FileNotFoundError:
        raise CacheFormatError(f"{where}: missing, but head.json counts records in it; the cache is "
                               "damaged (restore it or rebuild the cache)") from None
    if len(data) != stop - start:
        raise CacheFormatError(f"{where}: shorter than head.json says (truncated); the cache is "
                               "damaged (restore it or rebuild the cache)")
    return data


def _stream_key(records: np.ndarray, n_inputs: int) -> np.ndarray:
    """Round robin puts block (input i, index r) before (i', r') iff (r, i) < (r', i')."""
    return records["index"].astype(np.int64) * max(n_inputs, 1) + records["input"]


def check_records(records: np.ndarray, n_inputs: int, counts: np.ndarray, last_key: int,
                  where: str, first: int = 0) -> None:
    """Validate index records that follow `counts` blocks per input and the stream key
    `last_key`: fields in range, each input's blocks numbered on from its count, the stream in
    round-robin order. Vectorized: O(new records)."""
    if not len(records):
        return

    def bad(k: int, what: str) -> CacheFormatError:
        return CacheFormatError(f"{where}: block {first + k} {what}; the index is corrupted "
                                "(restore it or rebuild the cache)")

    checks = (
        ((records["input"] < 0) | (records["input"] >= n_inputs), "names an input the spec lacks"),
        ((records["index"] < 0) | (records["index"] >= fmt.MAX_BLOCK_INDEX), "has an invalid index"),
        ((records["num_tokens"] < 0) | (records["num_tokens"] > fmt.MAX_BLOCK_TOKENS), "has an invalid token count"),
        ((records["num_documents"] < 0) | (records["num_documents"] > fmt.MAX_BLOCK_DOCUMENTS),
         "has an invalid document count"),
        ((records["num_documents"] == 0) & (records["num_tokens"] > 0), "has tokens in no document"),
        (records["size"] < 8, "has an invalid file size"),
    )
    for wrong, what in checks:
        if wrong.any():
            raise bad(int(np.argmax(wrong)), what)
    keys = _stream_key(records, n_inputs)
    increasing = np.diff(np.concatenate([[last_key], keys])) > 0
    if not increasing.all():
        raise bad(int(np.argmin(increasing)), "is out of stream order (round robin over the inputs)")
    order = np.argsort(records["input"], kind="stable")
    inputs = records["input"][order]
    group_start = np.r_[0, np.flatnonzero(np.diff(inputs)) + 1]
    rank = np.arange(len(order)) - np.repeat(group_start, np.diff(np.r_[group_start, len(order)]))
    expected = counts[inputs] + rank
    wrong = records["index"][order] != expected
    if wrong.any():
        raise bad(int(order[np.argmax(wrong)]), "does not follow its input's previous block")


def read_log(storage: Storage, count: int, chunk_records: int) -> list[dict[str, Any]]:
    """The first `count` commit log records, decoded (each checked by `replay_log`)."""
    out: list[dict[str, Any]] = []
    for chunk, first, end in _chunks(0, count, chunk_records):
        rel = log_chunk_name(chunk)
        try:
            data = fmt.read_capped_file(storage, rel, MAX_LOG_CHUNK_BYTES)
        except FileNotFoundError:
            raise CacheFormatError(f"{storage.url}/{rel}: missing, but head.json counts records in "
                                   "it; the cache is damaged (restore it or rebuild the cache)") from None
        lines = data.split(b"\n")
        if len(lines) - 1 < end:  # the last element is what follows the last newline
            raise CacheFormatError(f"{storage.url}/{rel}: holds {len(lines) - 1} records, head.json "
                                   f"counts {end}; the log is truncated")
        for k in range(first, end):
            out.append(fmt.decode_json(lines[k], f"{storage.url}/{rel} line {k + 1}", "a log record"))
    return out


def replay_log(storage: Storage, spec: dict[str, Any], count: int,
               chunk_records: int) -> tuple[list[dict], list[dict]]:
    """The finished block entries (commit order) and each input's progress, from the log."""
    n = len(spec["inputs"])
    progress = [{"records": 0, "skipped": {}, "blocks": 0, "done": False} for _ in range(n)]
    entries: list[dict] = []
    where = f"{storage.url}/{LOG_DIR}"
    for k, record in enumerate(read_log(storage, count, chunk_records)):
        at = f"record {k}"
        if not isinstance(record, dict) or type(record.get("input")) is not int \
                or not 0 <= record["input"] < n:
            raise CacheFormatError(f"{where}: {at} is not a block or input record; the log is corrupted")
        i = record["input"]
        if "progress" in record or "entry" not in record:
            fmt.check_input_progress(record.get("progress"), f"{at}.progress", where)
        if "entry" in record:
            fmt.check_block_entry(record["entry"], f"{at}.entry", n, where)
            if record["entry"]["input"] != i or record["entry"]["index"] != progress[i]["blocks"]:
                raise CacheFormatError(f"{where}: {at} is not input {i}'s next block; the log is "
                                       "corrupted")
            entries.append(record["entry"])
        elif record.get("done") is not True:
            raise CacheFormatError(f"{where}: {at} is neither a block nor a finished input")
        if "progress" in record:
            progress[i] = dict(record["progress"], done=bool(record.get("done")) or progress[i]["done"])
        else:  # a block upgraded from v1, which kept only each input's last progress
            progress[i]["blocks"] = record["entry"]["index"] + 1
    return entries, progress


# ---------------------------------------------------------------- restoring a lost head.json

def stored_index(storage: Storage) -> tuple[dict[str, Any], np.ndarray]:
    """The v2 manifest, and every whole record the index chunks hold (committed or not), checked
    for ranges and stream order: what a lost head.json counted, and possibly more."""
    manifest, version, path = fmt.load_manifest(storage)
    if version < 2:
        raise CacheFormatError(f"{path}: a format v1 cache has no head.json")
    spec, chunk = _v2_header(manifest, path)
    parts = []
    for c in itertools.count():
        try:
            data = fmt.read_capped_file(storage, index_chunk_name(c), chunk * RECORD.itemsize)
        except FileNotFoundError:
            break
        whole = len(data) // RECORD.itemsize
        parts.append(np.frombuffer(data[: whole * RECORD.itemsize], dtype=RECORD))
        if whole < chunk:
            break
    records = np.concatenate(parts) if parts else np.zeros(0, dtype=RECORD)
    n = len(spec["inputs"])
    check_records(records, n, np.zeros(n, np.int64), -1, f"{storage.url}/{INDEX_DIR}")
    return manifest, records


def _log_lines(storage: Storage, chunk_records: int) -> int:
    """How many whole records the commit log chunks hold (a crash may have torn the last)."""
    count = 0
    for c in itertools.count():
        try:
            data = fmt.read_capped_file(storage, log_chunk_name(c), MAX_LOG_CHUNK_BYTES)
        except FileNotFoundError:
            break
        lines = min(data.count(b"\n"), chunk_records)
        count += lines
        if lines < chunk_records:
            break
    return count


def has_log(storage: Storage) -> bool:
    """Whether the cache keeps a commit log (an unfinished build's; a complete cache has none)."""
    return any(_CHUNK_FILE.fullmatch(n) for n in storage.listdir(LOG_DIR))


def head_from_log(storage: Storage) -> dict[str, Any]:
    """The head of an unfinished build, recomputed from its commit log and index: every whole
    log record (each was written after its block files were durable), the stream prefix they
    make, which the index must hold. CacheFormatError if the log and the index disagree."""
    manifest, records = stored_index(storage)
    spec, chunk = manifest["spec"], manifest["chunk_records"]
    count = _log_lines(storage, chunk)
    entries, progress = replay_log(storage, spec, count, chunk)
    per_input: list[list[dict]] = [[] for _ in spec["inputs"]]
    for e in entries:
        per_input[e["input"]].append(e)
    order, complete = fmt.stream_order([len(b) for b in per_input], [p["done"] for p in progress])
    stream = [per_input[i][k] for i, k in order]
    if len(records) < len(stream) or records[: len(stream)].tobytes() != records_of(stream).tobytes():
        raise CacheFormatError(f"{storage.url}/{INDEX_DIR}: holds {len(records)} block records that "
                               f"do not match the {len(stream)} blocks the commit log makes visible; "
                               "head.json cannot be restored. Rebuild the cache into a new directory")
    head = _head_of(manifest["fingerprint"], records_of(stream), progress)
    # a builder that keeps record runs counts each input's documents in its blocks' progress
    counted = [r.get("progress", {}) for r in read_log(storage, count, chunk) if "entry" in r]
    if counted and all("documents" in p for p in counted) and (not complete or any(
            p["records"] != sum(e["num_documents"] for e in blocks)
            for p, blocks in zip(progress, per_input))):
        head[provenance.HEAD_KEY] = True
    if complete:
        return dict(head, records=0, inputs=[dict(p, done=True) for p in progress])
    return dict(head, complete=False, records=count)


def final_head(storage: Storage, progress: list[dict[str, Any]]) -> dict[str, Any]:
    """The head of a complete cache (whose log is gone), from its index and each input's final
    progress (`records`, `skipped`, `blocks`, `digest`..., as a rebuild of the input reports)."""
    manifest, records = stored_index(storage)
    counts = np.bincount(records["input"], minlength=len(progress))
    for i, p in enumerate(progress):
        if counts[i] != p["blocks"]:
            raise CacheFormatError(f"{storage.url}/{INDEX_DIR}: holds {int(counts[i])} blocks of input "
                                   f"{i}, which makes {p['blocks']}; head.json cannot be restored. "
                                   "Rebuild the cache into a new directory")
    head = _head_of(manifest["fingerprint"], records, progress)
    return dict(head, records=0, inputs=[dict(p, done=True) for p in progress])


def _head_of(fingerprint: str, records: np.ndarray, progress: list[dict[str, Any]]) -> dict[str, Any]:
    skipped: dict[str, int] = {}
    for p in progress:
        for reason, count in p["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
    return dict(empty_head(fingerprint), blocks=len(records), complete=True,
                num_tokens=int(records["num_tokens"].sum()),
                num_documents=int(records["num_documents"].sum()),
                skipped={k: v for k, v in skipped.items() if v})


# ---------------------------------------------------------------- writing v2 (the builder)

class _ChunkedFile:
    """The last chunk of the log or the index, kept in memory so that an object store can be
    sent it whole, and written from where the last commit ended."""

    def __init__(self, storage: Storage, name, count: int, tail: bytes, tail_records: int,
                 chunk_records: int):
        self.storage, self.name, self.size = storage, name, chunk_records
        self.chunk, self.data, self.records = count // chunk_records, tail, tail_records
        self.written = len(tail)  # bytes of this chunk already durable

    def append(self, items: list[bytes]) -> None:
        """Append records and write them; a filled chunk is finished before the next starts."""
        pending = list(items)
        while pending:
            room = self.size - self.records
            take, pending = pending[:room], pending[room:]
            created = self.written == 0
            self.data += b"".join(take)
            self.records += len(take)
            self.storage.extend(self.name(self.chunk), self.written, self.data)
            if created:
                self.storage.sync_dir(self.name(self.chunk).rpartition("/")[0])
            self.written = len(self.data)
            if self.records == self.size:
                self.chunk, self.data, self.records, self.written = self.chunk + 1, b"", 0, 0


class LedgerWriter:
    """Appends commits to a v2 cache (the builder's side: it holds the cache's lock)."""

    def __init__(self, storage: Storage, head: dict[str, Any], chunk_records: int):
        self.storage, self.head, self.chunk_records = storage, dict(head), chunk_records
        self._log = _ChunkedFile(storage, log_chunk_name, head["records"],
                                 *self._log_tail(head["records"]), chunk_records)
        blocks = head["blocks"]
        start = blocks - blocks % chunk_records
        tail = read_index(storage, start, blocks, chunk_records).tobytes()
        self._index = _ChunkedFile(storage, index_chunk_name, blocks, tail, blocks - start,
                                   chunk_records)

    def _log_tail(self, count: int) -> tuple[bytes, int]:
        first = count - count % self.chunk_records
        if first == count:
            return b"", 0
        data = fmt.read_capped_file(self.storage, log_chunk_name(first // self.chunk_records),
                                    MAX_LOG_CHUNK_BYTES)
        lines = data.split(b"\n")[: count - first]
        return b"".join(line + b"\n" for line in lines), count - first

    def commit(self, log_records: list[dict[str, Any]], visible: list[dict[str, Any]],
               head: dict[str, Any]) -> None:
        """Append `log_records` and the newly `visible` block entries, then make them committed
        by replacing head.json (whose counts must include them)."""
        if log_records:
            self._log.append([json.dumps(r, sort_keys=True, separators=(",", ":")).encode() + b"\n"
                              for r in log_records])
        if visible:
            self._index.append([r.tobytes() for r in records_of(visible)])
        self.storage.write_json(HEAD_NAME, head)
        self.head = dict(head)

    def finish(self, visible: list[dict[str, Any]], head: dict[str, Any]) -> None:
        """The last commit: the head holds every input's final progress, so the commit log, a
        record of the build's timing, is deleted (a complete cache is a pure function of its
        inputs, byte for byte, however many workers built it)."""
        self.commit([], visible, head)
        delete_log(self.storage)


def record_stamps(storage: Storage, fingerprint: str, stamps: dict[int, str]) -> None:
    """Record new `stamps` (input -> stamp) in a complete cache's head.json: those inputs were
    read again and found unchanged, so that the next re-run's no-op check is cheap again. Only
    head.json changes (one atomic replace); nothing a reader uses moves."""
    head = read_head(storage, fingerprint)
    if not head["complete"] or "inputs" not in head:
        raise ValueError(f"{storage.url}: only a complete cache's inputs have recorded stamps")
    for i, stamp in stamps.items():
        head["inputs"][i]["stamp"] = stamp
    storage.write_json(HEAD_NAME, head)


def delete_log(storage: Storage) -> None:
    """Delete the commit log's chunk files (a complete cache does not need them)."""
    for name in storage.listdir(LOG_DIR):
        if name.endswith(".jsonl") and name[:-6].isdigit():
            storage.delete(f"{LOG_DIR}/{name}")


def header(spec: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    """A v2 (v3 with documents) manifest: the cache's identity, and the chunk size of its index
    and log."""
    return {"format": fmt.FORMAT_NAME, "version": documents.layout_version(spec), "spec": spec,
            "fingerprint": fingerprint, "chunk_records": new_chunk_records()}


def write_header(storage: Storage, spec: dict[str, Any]) -> None:
    """A new v2 cache's manifest.json, written once, before anything else."""
    storage.write_json(fmt.MANIFEST_NAME, header(spec, fmt.spec_fingerprint(spec)))


def upgrade(storage: Storage) -> bool:
    """Convert the v1 cache in `storage` to v2 in place; False if it is v2 already.

    Crash-safe: the log, index and head are written first, and the v1 manifest stays the cache's
    record until the v2 manifest replaces it, last, in one atomic write; an interrupted upgrade
    is simply run again. The caller holds the cache's lock. Block files are not touched, and the
    fingerprint (so saved training states) stays the same.
    """
    fmt.remove_dead_temp_files(storage, "", fmt.TOP_FILES)  # of an upgrade that was killed
    manifest, version, path = fmt.load_manifest(storage)
    if version >= 2:
        return False
    fmt.check_manifest(manifest, path)
    _raise_order_problem(manifest, path)
    progress = [{k: p[k] for k in ("records", "skipped", "blocks") if k in p} |
                {k: p[k] for k in ("digest", "stamp") if p.get(k) is not None}
                for p in manifest["inputs"]]
    pending = sorted(manifest.get("pending", []), key=lambda e: (e["input"], e["index"]))
    entries = manifest["blocks"] + pending
    last = {e["input"]: k for k, e in enumerate(entries)}  # each input's last finished block
    done = [p["done"] for p in manifest["inputs"]]
    log = []
    for k, e in enumerate(entries):
        record: dict[str, Any] = {"input": e["input"], "entry": e}
        if last[e["input"]] == k and not done[e["input"]]:
            record["progress"] = progress[e["input"]]  # v1 kept only the latest resume point
        log.append(record)
    log += [{"input": i, "done": True, "progress": progress[i]} for i in range(len(done)) if done[i]]
    head = dict(empty_head(manifest["fingerprint"]), blocks=len(manifest["blocks"]), records=len(log),
                num_tokens=sum(e["num_tokens"] for e in manifest["blocks"]),
                num_documents=sum(e["num_documents"] for e in manifest["blocks"]),
                complete=manifest["complete"], skipped=dict(manifest.get("skipped", {})))
    writer = LedgerWriter(storage, empty_head(manifest["fingerprint"]), new_chunk_records())
    if manifest["complete"]:
        head.update(records=0, inputs=[dict(p, done=True) for p in progress])
        writer.finish(manifest["blocks"], head)
    else:
        writer.commit(log, manifest["blocks"], head)
    storage.write_json(fmt.MANIFEST_NAME, header(manifest["spec"], manifest["fingerprint"]))
    return True
