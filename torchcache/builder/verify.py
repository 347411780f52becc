"""Check a whole cache: the manifest, the stream order, and every file against its checksum.

``torchcache verify`` and :func:`torchcache.repair_cache` use :func:`check_cache`. It reads the
files directly (through :mod:`torchcache.read.cache_files`), not through a TokenCache, so that it also
sees the pending blocks of an unfinished build and can report every problem, not just the first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..format import blocks as fmt
from ..format.arrays import arrays_name, read_arrays_file
from ..format.documents import docs_max_size, has_arrays, has_documents, read_docs_file
from ..read.cache_files import (CacheFiles, check_block_file, load_keys, load_offsets, load_record_runs,
                                locate_cache, offsets_max_size)
from ..format.provenance import last_record, past_the_input
from ..errors import CacheFormatError
from ..format.ledger import HEAD_NAME, INDEX_DIR, BlockTable, lost_head, read_manifest, stored_index
from ..format.tokenizer import check_cache_tokenizer
from ..format.tokenizer_backends import check_backend_files, stored_file_names

__all__ = ["Problem", "check_cache", "verify_cache"]


@dataclass(frozen=True)
class Problem:
    """One problem found by :func:`check_cache`.

    `entry` is the index of the damaged block entry in ``manifest["blocks"] +
    manifest.get("pending", [])`` (None for a cache-wide problem: the manifest itself, the stream
    order); `file` is the damaged file's path relative to the cache directory (see the example
    of :func:`check_cache`).
    """

    message: str
    entry: int | None = None
    file: str | None = None


def check_cache(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                local_dir: str | None = None) -> list[Problem]:
    """Check a whole cache: the manifest, the stream order, every file's checksum, and for intact
    files their headers, offsets, keys and (format v3) documents sidecars against the manifest and
    their block: record numbers, mask runs and kept fields. An empty list means all is well.

    For a remote cache, files are checked as they are copied locally (a bad one is reported).
    A directory without a manifest raises FileNotFoundError (it is not a cache).

    Example (a cache, then one of its block files damaged):

    >>> import os, tempfile, tokenizers
    >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(  # a toy: one word, one id
    ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
    >>> tmp = tempfile.TemporaryDirectory()
    >>> out = os.path.join(tmp.name, "cache")
    >>> _ = tc.build_cache(iter(["hello", "world"]), out, tokenizer, progress=False)
    >>> tc.check_cache(out)
    []
    >>> block = os.path.join(out, "blocks", "000000-000000.safetensors")
    >>> with open(block, "r+b") as f:
    ...     _ = f.seek(-1, os.SEEK_END); _ = f.write(b"\\xff")
    >>> [(p.entry, p.file) for p in tc.check_cache(out)]
    [(0, 'blocks/000000-000000.safetensors')]
    >>> tc.verify_cache(out)   # the same, as messages
    ['.../blocks/000000-000000.safetensors: checksum mismatch (the file is corrupted); repair it with `torchcache verify --repair`']
    >>> tmp.cleanup()
    """
    url = os.fspath(path)
    try:
        source = locate_cache(url, storage_options, local_dir)
        lost = lost_head(source.metadata)
        if lost is not None:
            return _check_without_head(source, lost)
        manifest = read_manifest(source.metadata, check_order=False)
    except CacheFormatError as e:
        return [Problem(str(e), None, fmt.MANIFEST_NAME)]
    problems = []
    order = fmt.stream_order_problem(manifest)
    if order is not None:
        problems.append(Problem(f"{source.url}/{fmt.MANIFEST_NAME}: {order}; the manifest was edited "
                                "or corrupted (restore it or rebuild the cache)", None, fmt.MANIFEST_NAME))
    table = BlockTable.from_entries(manifest["blocks"] + manifest.get("pending", []),
                                    docs=has_documents(manifest["spec"]))
    counts = [int(p["records"]) for p in manifest["inputs"]]  # records read of each input so far
    return problems + _check_files(source, manifest["spec"], table, counts)


def _check_without_head(source: CacheFiles, lost: str) -> list[Problem]:
    """A cache whose head.json is lost: that, and the files of every block its index holds."""
    problems = [Problem(lost, None, HEAD_NAME)]
    try:
        manifest, records = stored_index(source.metadata)
    except CacheFormatError as e:
        return problems + [Problem(str(e), None, INDEX_DIR)]
    return problems + _check_files(source, manifest["spec"],
                                   BlockTable(records, docs=has_documents(manifest["spec"])))


def _check_files(source: CacheFiles, spec: dict[str, Any], table: BlockTable,
                 counts: list[int] | None = None) -> list[Problem]:
    """The problems of the tokenizer and of every block of `table` (Problem.entry: its row);
    `counts`: each input's records read so far (a block's documents come from records below it),
    None when unknown."""
    problems = _check_tokenizer(source, spec, len(table) > 0)
    dtype = fmt.DTYPES[spec["dtype"]]
    for b in range(len(table)):
        limit = None if counts is None else counts[table.input(b)]
        problems.extend(_check_block(source, spec, table, b, dtype, limit))
    return problems


def _check_tokenizer(source: CacheFiles, spec: dict[str, Any], committed: bool) -> list[Problem]:
    """tokenizer.json must be the tokenizer the spec names (by fingerprint); it may be missing
    only before the first block is committed (the builder writes it before any block)."""
    if spec["tokenizer"] is None:
        return []
    if "kind" in spec["tokenizer"]:  # tiktoken, SentencePiece: each of the backend's own files
        return _check_backend_files(source, spec["tokenizer"], committed)
    rel, expected = fmt.TOKENIZER_NAME, spec["tokenizer"]["fingerprint"]
    where = f"{source.url}/{rel}"
    try:
        check_cache_tokenizer(fmt.read_capped_file(source.metadata, rel, fmt.MAX_TOKENIZER_BYTES),
                              expected, where)
    except FileNotFoundError:
        if not committed:
            return []
        return [Problem(f"{where}: missing; restore the tokenizer.json the cache was built with "
                        f"(fingerprint {expected})", None, rel)]
    except CacheFormatError as e:
        return [Problem(str(e), None, rel)]
    return []


def _check_backend_files(source: CacheFiles, tokenizer: dict[str, Any],
                         committed: bool) -> list[Problem]:
    """A tiktoken or SentencePiece tokenizer's files: each must be the one the spec hashes."""
    try:
        names = stored_file_names(tokenizer)
    except CacheFormatError as e:
        return [Problem(str(e), None, None)]
    files = {}
    for rel in names:
        try:
            files[rel] = fmt.read_capped_file(source.metadata, rel, fmt.MAX_TOKENIZER_BYTES)
        except FileNotFoundError:
            if not committed:
                return []
            return [Problem(f"{source.url}/{rel}: missing; restore the {rel} the cache was built "
                            f"with (sha256 {tokenizer['files'][rel]})", None, rel)]
        except CacheFormatError as e:
            return [Problem(str(e), None, rel)]
    try:
        check_backend_files(tokenizer, files, lambda rel: f"{source.url}/{rel}")
    except CacheFormatError as e:
        rel = next((r for r in names if f"/{r}:" in str(e)), names[0])
        return [Problem(str(e), None, rel)]
    return []


@dataclass(frozen=True)
class _BlockFile:
    """One file of a block: where, its recorded checksum, a size cap, and its content check."""

    rel: str
    checksum: str
    max_size: int
    check: Callable[[int, str], Any]


def _block_files(spec: dict[str, Any], table: BlockTable, b: int, dtype: np.dtype,
                 records: int | None = None, found: dict[str, str] | None = None) -> list[_BlockFile]:
    """Block b's files: tokens, offsets, and its keys file (v1/v2) or documents sidecar (v3, which
    holds the sample keys); `records`: its input's record count, which no stored record number may
    reach; `found` gets the arrays sidecar's checksum the documents sidecar holds (a cache with
    arrays)."""
    record = table.records[b]
    tokens, documents, size = int(record["num_tokens"]), int(record["num_documents"]), int(record["size"])
    input_path = spec["inputs"][table.input(b)]["path"]

    def check_offsets(fd: int, path: str) -> None:
        load_offsets(fd, path, documents, tokens)
        runs = load_record_runs(fd, path, documents)
        if runs is not None:
            past_the_input(path, last_record(runs), records, input_path)
    files = [_BlockFile(table.path(b), table.checksum(b), size,
                        lambda fd, path: check_block_file(fd, path, dtype, tokens, size)),
             _BlockFile(table.offsets_path(b), table.checksum(b, "offsets_checksum"),
                        offsets_max_size(documents), check_offsets)]
    if table.has_keys(b):
        files.append(_BlockFile(table.keys_path(b), table.checksum(b, "keys_checksum"),
                                fmt.MAX_KEYS_BYTES, lambda fd, path: load_keys(fd, path, documents)))
    if table.docs:
        kept = spec["documents"]

        def check_docs(fd: int, path: str) -> None:
            # (checks the sample keys it holds, if any: one UTF-8 JSON string per document)
            docs = read_docs_file(fd, path, documents, tokens, mask=bool(kept["loss_mask"]),
                                  fields=bool(kept["keep_fields"]), arrays=has_arrays(spec))
            if docs.arrays_sha256 is not None and found is not None:
                found["arrays"] = docs.arrays_sha256
            if len(docs.records):
                past_the_input(path, int(docs.records[-1]), records, input_path)
            for d in range(documents if docs.fields is not None else 0):
                docs.fields_of(d)  # each kept-fields object decodes
        files.append(_BlockFile(table.docs_path(b), table.checksum(b, "keys_checksum"),
                                docs_max_size(documents, tokens), check_docs))
    return files


def _check_block(source: CacheFiles, spec: dict[str, Any], table: BlockTable, b: int,
                 dtype: np.dtype, records: int | None = None) -> list[Problem]:
    """Problems of block b's files: checksums first, then (if intact) their contents."""
    found: dict[str, str] = {}
    files = _block_files(spec, table, b, dtype, records, found)
    problems, opened = [], []
    try:
        for f in files:
            try:
                opened.append(source.open(f.rel, f.checksum, verify=True, max_size=f.max_size))
            except CacheFormatError as e:
                problems.append(Problem(str(e), b, f.rel))
        if problems:
            return problems
        for f, (path, fd) in zip(files, opened):
            try:
                f.check(fd, path)
            except CacheFormatError as e:
                problems.append(Problem(str(e), b, f.rel))
        if "arrays" in found and not problems:
            problems += _check_arrays(source, spec, table, b, found["arrays"])
        return problems
    finally:
        for _, fd in opened:
            os.close(fd)


def _check_arrays(source: CacheFiles, spec: dict[str, Any], table: BlockTable, b: int,
                  checksum: str) -> list[Problem]:
    """Block b's arrays sidecar against the checksum its documents sidecar holds, then its
    structure."""
    rel = arrays_name(table.path(b))
    try:
        path, fd = source.open(rel, checksum, verify=True)
    except CacheFormatError as e:
        return [Problem(str(e), b, rel)]
    try:
        read_arrays_file(fd, path, int(table.records["num_documents"][b]),
                         sorted(spec["documents"]["arrays"]))
    except CacheFormatError as e:
        return [Problem(str(e), b, rel)]
    finally:
        os.close(fd)
    return []


def verify_cache(path: str | os.PathLike, storage_options: dict[str, Any] | None = None,
                 local_dir: str | None = None) -> list[str]:
    """Recompute every checksum and header check; return one message per problem (empty = ok).

    Each message names the file; :func:`check_cache` gives the same as structured Problems (its
    docstring has an example).
    """
    return [p.message for p in check_cache(path, storage_options, local_dir)]
