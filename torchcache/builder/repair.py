"""Repair a cache: rebuild exactly its damaged blocks from the inputs, byte for byte.

A build is a pure function of (inputs, tokenizer, options), so a damaged block can be made again
by re-tokenizing its input from the start. Each rebuilt block is compared with the checksums the
manifest recorded before it replaces the damaged files, so a repair can never write different
data: if an input changed since the build, the repair stops and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

from ..format import blocks as fmt
from ..format.arrays import arrays_name
from ..format.documents import has_documents
from .commit import acquire_lock
from ..errors import BuildError, CacheFormatError
from ..format import provenance
from ..format.ledger import (HEAD_NAME, LOG_DIR, BlockTable, final_head, has_log, head_from_log,
                     index_chunk_name, lost_head, read_head, read_manifest, stored_index)
from ..read.cache_files import offsets_max_size
from .inputs import resolve_inputs
from .records import ITERABLE_PATH, InputSource
from ..format.storage import LocalStorage, Storage, open_storage
from ..format.tokenizer import cache_tokenizer, canonical_json
from ..format.tokenizer_backends import stored_file_names
from ..format.tokenizer_kinds import cache_backend
from .verify import check_cache
from .worker import BlockWritten, BuildJob, InputDone, build_input

_FILES = (("path", "checksum"), ("offsets", "offsets_checksum"), ("keys", "keys_checksum"),
          ("docs", "docs_checksum"))


@dataclass
class RepairResult:
    """What a repair did: the block files it rewrote (and head.json, if it restored it), and
    the problems it found first; both empty for a healthy cache (see `repair_cache`)."""

    path: str
    repaired: list[str]
    problems: list[str]


def repair_cache(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 local_dir: str | None = None) -> RepairResult:
    """Find damaged blocks (as `verify_cache` does) and rebuild exactly those from the inputs.

    A lost head.json (the commit point) is restored first: recomputed from the commit log and
    the index of an unfinished build, or, for a complete cache, from the index and each input's
    final progress, found by reading the inputs again (checked block by block against the index).
    Temporary files that killed writers left are removed.

    The inputs must still be at the paths the manifest records, unchanged. Problems that are
    not a damaged block (a manifest in the wrong order, a corrupted manifest, another
    tokenizer.json) cannot be repaired this way and raise BuildError.

    Example (a cache of a JSON-lines file, then one of its block files lost):

        >>> import json, os, tempfile, tokenizers
        >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(  # a toy: one word, one id
        ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> data, out = os.path.join(tmp.name, "docs.jsonl"), os.path.join(tmp.name, "cache")
        >>> with open(data, "w") as f:
        ...     _ = f.writelines(json.dumps({"text": word}) + "\\n" for word in ["hello", "world"])
        >>> _ = tc.build_cache(data, out, tokenizer, num_workers=1, progress=False)
        >>> tc.repair_cache(out).repaired   # a healthy cache: nothing to do
        []
        >>> block = os.path.join(out, "blocks", "000000-000000.safetensors")
        >>> os.remove(block)
        >>> tc.repair_cache(out).repaired   # rebuilt from docs.jsonl, checked byte for byte
        ['blocks/000000-000000.safetensors']
        >>> tc.verify_cache(out)
        []
        >>> tmp.cleanup()
    """
    storage = open_storage(path, storage_options)
    lock = acquire_lock(storage)  # no builder may write while blocks are replaced
    try:
        fmt.remove_dead_temp_files(storage, "", fmt.TOP_FILES)
        fmt.remove_dead_temp_files(storage, fmt.BLOCK_DIR, fmt.BLOCK_FILES)
        lost = lost_head(storage)
        found, repaired = [], []
        if lost is not None:
            _restore_head(storage, storage_options)
            found, repaired = [lost], [HEAD_NAME]
        problems = check_cache(path, storage_options=storage_options, local_dir=local_dir)
        found += [p.message for p in problems]
        if not problems:
            return RepairResult(storage.url, repaired, found)
        unfixable = [p.message for p in problems if p.entry is None]
        if unfixable:
            raise BuildError(f"{storage.url}: cannot repair this by rebuilding blocks: "
                             f"{'; '.join(unfixable[:3])}. Rebuild the cache into a new directory")
        manifest = read_manifest(storage)
        entries = manifest["blocks"] + manifest.get("pending", [])
        damaged: dict[int, dict[int, set[str]]] = {}
        for p in problems:
            entry = entries[p.entry]
            damaged.setdefault(entry["input"], {}).setdefault(entry["index"], set()).add(p.file)
        job = _job_for(storage, manifest, storage_options)
        start = _start(storage, manifest, entries)
        for input_index in sorted(damaged):
            wanted = {e["index"]: _Damaged(e, damaged[input_index][e["index"]],
                                           _record_of(manifest, k))
                      for k, e in enumerate(entries)
                      if e["input"] == input_index and e["index"] in damaged[input_index]}
            repaired += _rebuild_input(storage, job, manifest, input_index, wanted, storage_options,
                                       start)
        return RepairResult(storage.url, repaired, found)
    finally:
        lock.release()


@dataclass
class _Damaged:
    """A block with damaged files: its recorded entry, the files to put back, and where its
    record lies (a file and a description, for messages)."""

    entry: dict[str, Any]
    files: set[str]
    record: tuple[str, str]


def _record_of(manifest: dict[str, Any], k: int) -> tuple[str, str]:
    """(file, what) holding the record of entry k of `blocks + pending`."""
    if manifest["version"] == 1:
        return fmt.MANIFEST_NAME, f"the entry of block {k}"
    if k < len(manifest["blocks"]):
        return index_chunk_name(k // manifest["chunk_records"]), f"the record of block {k}"
    return LOG_DIR, "the commit log's record of a finished block"


def _restore_head(storage: Storage, storage_options: dict[str, Any] | None) -> None:
    """Write head.json again: from the commit log and the index of an unfinished build, or, for
    a complete cache (no log), from the index and each input's final progress, found by reading
    it again. Only what the cache committed is counted; nothing is made up."""
    if has_log(storage):
        storage.write_json(HEAD_NAME, head_from_log(storage))
        return
    manifest, records = stored_index(storage)
    table = BlockTable(records, docs=has_documents(manifest["spec"]))
    job = _job_for(storage, manifest, storage_options)
    keep = _some_block_keeps_runs(storage, table)
    progress, gaps = [], False
    for i, spec_input in enumerate(manifest["spec"]["inputs"]):
        recorded = [table.entry(b) for b in range(len(table)) if table.input(b) == i]
        progress.append(_final_progress(storage, job, i, _input_source(spec_input, storage_options),
                                        recorded, dict(_START, documents=0 if keep else None)))
        gaps |= progress[-1]["records"] != sum(e["num_documents"] for e in recorded)
    head = final_head(storage, progress)
    if keep and gaps:
        head[provenance.HEAD_KEY] = True
    storage.write_json(HEAD_NAME, head)


def _some_block_keeps_runs(storage: Storage, table: BlockTable) -> bool:
    """Whether a block's offsets sidecar holds record runs (format.provenance): then the blocks
    are rebuilt with them, and the restored head says so again. A missing or damaged sidecar
    says nothing (it is repaired after the head, as the others say)."""
    for b in range(len(table)):
        try:
            if provenance.sidecar_has_runs(storage, table.offsets_path(b),
                                           offsets_max_size(int(table.records["num_documents"][b]))):
                return True
        except (FileNotFoundError, CacheFormatError):
            continue
    return False


def _final_progress(storage: Storage, job: BuildJob, input_index: int, source: InputSource,
                    recorded: list[dict], start: dict[str, Any]) -> dict[str, Any]:
    """An input's final progress, by tokenizing it again from `start`: each block it makes must
    be the one the index records."""
    with _scratch_job(job) as (scratch_job, scratch):
        for event in build_input(scratch_job, input_index, source, start):
            if isinstance(event, BlockWritten):
                k = event.entry["index"]
                if k >= len(recorded) or not _same_files(event.entry, recorded[k]):
                    raise BuildError(f"cannot restore {storage.url}/{HEAD_NAME}: input {source.path} "
                                     f"now makes another block {k} than the index records: it "
                                     "changed since the build. Rebuild the cache into a new directory")
                _remove_scratch_block(scratch, event.entry)
            elif isinstance(event, InputDone):
                return event.progress
    raise BuildError(f"cannot restore {storage.url}/{HEAD_NAME}: input {source.path} ended without "
                     "being finished; rebuild the cache into a new directory")


def _job_for(storage: Storage, manifest: dict[str, Any],
             storage_options: dict[str, Any] | None) -> BuildJob:
    """The build job the manifest's spec describes (with the tokenizer stored in the cache)."""
    spec = manifest["spec"]
    tokenizer_json = None
    if spec["tokenizer"] is not None and "kind" in spec["tokenizer"]:  # tiktoken, SentencePiece
        try:
            files = {name: fmt.read_capped_file(storage, name, fmt.MAX_TOKENIZER_BYTES)
                     for name in stored_file_names(spec["tokenizer"])}
            tokenizer_json = cache_backend(spec["tokenizer"], files,
                                           lambda name: f"{storage.url}/{name}")
        except (OSError, ValueError) as e:
            raise BuildError(f"{storage.url}: cannot rebuild blocks without the cache's "
                             f"{spec['tokenizer']['kind']} tokenizer ({e}); rebuild the cache into "
                             "a new directory") from None
    elif spec["tokenizer"] is not None:
        where = f"{storage.url}/{fmt.TOKENIZER_NAME}"
        try:
            tok = cache_tokenizer(fmt.read_capped_file(storage, fmt.TOKENIZER_NAME,
                                                       fmt.MAX_TOKENIZER_BYTES),
                                  spec["tokenizer"]["fingerprint"], where)
        except (OSError, ValueError) as e:
            raise BuildError(f"{where}: cannot rebuild blocks without the cache's tokenizer ({e}); "
                             "rebuild the cache into a new directory") from None
        tokenizer_json = canonical_json(tok)
    # "skip" reproduces every block a build committed whatever its on_error was: blocks end
    # before the first bad record a raising build stopped at
    return BuildJob.for_spec(storage, spec, tokenizer_json, "skip", storage_options)


def _input_source(spec_input: dict[str, Any], storage_options: dict[str, Any] | None) -> InputSource:
    path = spec_input["path"]
    if path == ITERABLE_PATH:
        raise BuildError("this cache was built from an iterable of strings, which cannot be read "
                         "again; rebuild the cache into a new directory")
    try:
        (source,) = resolve_inputs([path], storage_options)
    except (OSError, ValueError) as e:
        raise BuildError(f"cannot repair from input {path}: {e}") from None
    if source.size != spec_input["size"]:
        raise BuildError(f"input {path} is {source.size} bytes, it was {spec_input['size']} when "
                         "the cache was built: it changed, so the damaged blocks cannot be "
                         "rebuilt from it; rebuild the cache into a new directory")
    return source


def _rebuild_input(storage: Storage, job: BuildJob, manifest: dict[str, Any], input_index: int,
                   wanted: dict[int, _Damaged], storage_options: dict[str, Any] | None,
                   start: dict[str, Any]) -> list[str]:
    """Re-tokenize one input from its start (`start`) into a scratch directory; put back the
    damaged files of the wanted blocks. Returns the files written."""
    source = _input_source(manifest["spec"]["inputs"][input_index], storage_options)
    with _scratch_job(job) as (scratch_job, scratch):
        written: list[str] = []
        for event in build_input(scratch_job, input_index, source, dict(start)):
            if not isinstance(event, BlockWritten):
                continue
            rebuilt = event.entry
            damaged = wanted.pop(rebuilt["index"], None)
            if damaged is not None:
                written += _put_back(storage, scratch, rebuilt, damaged, source.path)
            _remove_scratch_block(scratch, rebuilt)
            if not wanted:
                return written
        raise BuildError(f"input {source.path} now yields fewer blocks than the cache holds: it "
                         "changed since the build; rebuild the cache into a new directory")


_START = {"records": 0, "skipped": {}, "blocks": 0}


def _start(storage: Storage, manifest: dict[str, Any], entries: list[dict]) -> dict[str, Any]:
    """Where an input's rebuild starts: its first record, keeping record runs as the cache's
    blocks do (format.provenance: not in a cache an older builder made)."""
    documents = [0] * len(manifest["spec"]["inputs"])
    for e in entries:
        documents[e["input"]] += e["num_documents"]
    head = read_head(storage, manifest["fingerprint"]) if manifest["version"] >= 2 else None
    return dict(_START, documents=0 if provenance.keeps_runs(head, documents) else None)


@contextlib.contextmanager
def _scratch_job(job: BuildJob) -> Iterator[tuple[BuildJob, str]]:
    """The job, writing into a new scratch directory that is removed afterwards."""
    scratch = tempfile.mkdtemp(prefix="torchcache-repair-")
    try:
        yield dataclasses.replace(job, output=LocalStorage(scratch)), scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _same_files(rebuilt: dict, original: dict) -> bool:
    return all(rebuilt.get(name) == original.get(name) and rebuilt.get(checksum) == original.get(checksum)
               for name, checksum in _FILES)


def _put_back(storage: Storage, scratch: str, rebuilt: dict, damaged: _Damaged,
              input_path: str) -> list[str]:
    """Write a rebuilt block's damaged files over the cache's, after checking the rebuild is
    the block the cache recorded."""
    original = damaged.entry
    if not _same_files(rebuilt, original):
        raise BuildError(_mismatch(storage, rebuilt, damaged, input_path))
    written = []
    # the arrays sidecar is named by the block (its checksum is in the documents sidecar, which
    # _same_files compared, so the rebuilt one is the recorded one byte for byte)
    for rel in [rebuilt.get(name) for name, _ in _FILES] + [_arrays_rel(scratch, rebuilt)]:
        if rel is None or rel not in damaged.files:
            continue
        with open(os.path.join(scratch, *rel.split("/")), "rb") as f:
            storage.write(rel, [f.read()])
        written.append(rel)
    return written


def _mismatch(storage: Storage, rebuilt: dict, damaged: _Damaged, input_path: str) -> str:
    """Why a rebuild differs from the record: a damaged record (the cache's file and the
    rebuild agree), or an input that changed since the build."""
    original = damaged.entry
    record_file, what = damaged.record
    for name, checksum in _FILES:
        rel = original.get(name)
        if rel is None or rebuilt.get(checksum) == original.get(checksum):
            continue
        try:
            actual = "sha256:" + hashlib.sha256(storage.read(rel)).hexdigest()
        except FileNotFoundError:
            actual = None
        if actual == rebuilt.get(checksum):
            return (f"{storage.url}/{record_file}: {what} says {rel} has {original[checksum]}, but "
                    f"the file and a rebuild from {input_path} both have {actual}: the record is "
                    "damaged, not the block file. Nothing was replaced; restore "
                    f"{record_file} from a copy of the cache, or rebuild the cache into a new "
                    "directory")
    return (f"rebuilding {original['path']} from {input_path} gave different bytes than the cache "
            "recorded: the input changed since the build; nothing was replaced for this block. "
            "Rebuild the cache into a new directory")


def _arrays_rel(scratch: str, entry: dict) -> str | None:
    """The rebuilt block's arrays sidecar (None: the cache has no arrays)."""
    rel = arrays_name(entry["path"])
    return rel if os.path.exists(os.path.join(scratch, *rel.split("/"))) else None


def _remove_scratch_block(scratch: str, entry: dict) -> None:
    for rel in [entry.get(name) for name, _ in _FILES] + [_arrays_rel(scratch, entry)]:
        if rel:
            os.unlink(os.path.join(scratch, *rel.split("/")))
