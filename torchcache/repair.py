"""Repair a cache: rebuild exactly its damaged blocks from the inputs, byte for byte.

A build is a pure function of (inputs, tokenizer, options), so a damaged block can be made again
by re-tokenizing its input from the start. Each rebuilt block is compared with the checksums the
manifest recorded before it replaces the damaged files, so a repair can never write different
data: if an input changed since the build, the repair stops and says so.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from . import format as fmt
from .commit import acquire_lock
from .errors import BuildError
from .ledger import read_manifest
from .inputs import resolve_inputs
from .records import ITERABLE_PATH, InputSource
from .storage import LocalStorage, Storage, open_storage
from .tokenizing import canonical_json, load_tokenizer, tokenizer_fingerprint
from .verify import check_cache
from .worker import BlockWritten, BuildJob, build_input

_FILES = (("path", "checksum"), ("offsets", "offsets_checksum"), ("keys", "keys_checksum"))


@dataclass
class RepairResult:
    """What a repair did: the block files it rewrote, and the problems it found first.

    Example:
        >>> result = tc.repair_cache("caches/web")
        >>> result.repaired, result.problems   # ([], []) for a healthy cache
    """

    path: str
    repaired: list[str]
    problems: list[str]


def repair_cache(path: str | os.PathLike, *, storage_options: dict[str, Any] | None = None,
                 local_dir: str | None = None) -> RepairResult:
    """Find damaged blocks (as `verify_cache` does) and rebuild exactly those from the inputs.

    The inputs must still be at the paths the manifest records, unchanged. Problems that are
    not a damaged block (a manifest in the wrong order, a corrupted manifest) cannot be
    repaired this way and raise BuildError.

    Example:
        >>> result = tc.repair_cache("caches/web")
        >>> result.repaired   # e.g. ['blocks/000002-000005.safetensors']
    """
    storage = open_storage(path, storage_options)
    lock = acquire_lock(storage)  # no builder may write while blocks are replaced
    try:
        problems = check_cache(path, storage_options=storage_options, local_dir=local_dir)
        if not problems:
            return RepairResult(storage.url, [], [])
        unfixable = [p.message for p in problems if p.entry is None]
        if unfixable:
            raise BuildError(f"{storage.url}: cannot repair this by rebuilding blocks: "
                             f"{'; '.join(unfixable[:3])}. Rebuild the cache into a new directory")
        manifest = read_manifest(storage)
        entries = manifest["blocks"] + manifest.get("pending", [])
        damaged: dict[int, set[int]] = {}
        for p in problems:
            entry = entries[p.entry]
            damaged.setdefault(entry["input"], set()).add(entry["index"])
        job = _job_for(storage, manifest, storage_options)
        repaired: list[str] = []
        for input_index in sorted(damaged):
            wanted = {e["index"]: e for e in entries
                      if e["input"] == input_index and e["index"] in damaged[input_index]}
            repaired += _rebuild_input(storage, job, manifest, input_index, wanted, storage_options)
        return RepairResult(storage.url, repaired, [p.message for p in problems])
    finally:
        lock.release()


def _job_for(storage: Storage, manifest: dict[str, Any],
             storage_options: dict[str, Any] | None) -> BuildJob:
    """The build job the manifest's spec describes (with the tokenizer stored in the cache)."""
    spec = manifest["spec"]
    tokenizer_json = None
    if spec["tokenizer"] is not None:
        try:
            tok = load_tokenizer_from_bytes(storage.read(fmt.TOKENIZER_NAME))
        except (OSError, ValueError) as e:
            raise BuildError(f"{storage.url}/{fmt.TOKENIZER_NAME}: cannot load the cache's "
                             f"tokenizer ({e}); rebuild the cache into a new directory") from None
        if tokenizer_fingerprint(tok) != spec["tokenizer"]["fingerprint"]:
            raise BuildError(f"{storage.url}/{fmt.TOKENIZER_NAME}: this is not the tokenizer the "
                             "cache was built with; rebuild the cache into a new directory")
        tokenizer_json = canonical_json(tok)
    # "skip" reproduces every block a build committed whatever its on_error was: blocks end
    # before the first bad record a raising build stopped at
    dtype = {"U16": "uint16", "U32": "uint32"}[spec["dtype"]]
    return BuildJob(storage, tokenizer_json, spec["bos_id"], spec["eos_id"], dtype, spec["text_key"],
                spec["block_tokens"], "skip", spec["special_tokens_as_text"],
                dict(storage_options or {}), spec["vocab_size"])


def load_tokenizer_from_bytes(data: bytes) -> Tokenizer:
    """A tokenizer from tokenizer.json bytes; ValueError if they are not one."""
    try:
        return load_tokenizer(Tokenizer.from_str(data.decode("utf-8")))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ValueError(str(e)) from None


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
                   wanted: dict[int, dict], storage_options: dict[str, Any] | None) -> list[str]:
    """Re-tokenize one input from its start into a scratch directory; put back the wanted blocks."""
    source = _input_source(manifest["spec"]["inputs"][input_index], storage_options)
    scratch = tempfile.mkdtemp(prefix="torchcache-repair-")
    try:
        scratch_job = _replace_output(job, LocalStorage(scratch))
        start = {"records": 0, "skipped": {}, "blocks": 0}
        written: list[str] = []
        for event in build_input(scratch_job, input_index, source, start):
            if not isinstance(event, BlockWritten):
                continue
            rebuilt = event.entry
            original = wanted.pop(rebuilt["index"], None)
            if original is not None:
                written += _put_back(storage, scratch, rebuilt, original, source.path)
            _remove_scratch_block(scratch, rebuilt)
            if not wanted:
                return written
        raise BuildError(f"input {source.path} now yields fewer blocks than the cache holds: it "
                         "changed since the build; rebuild the cache into a new directory")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _replace_output(job: BuildJob, output: Storage) -> BuildJob:
    return dataclasses.replace(job, output=output)


def _put_back(storage: Storage, scratch: str, rebuilt: dict, original: dict, input_path: str) -> list[str]:
    """Write a rebuilt block's files over the damaged ones, after checking they are identical."""
    for name, checksum in _FILES:
        if rebuilt.get(name) != original.get(name) or rebuilt.get(checksum) != original.get(checksum):
            raise BuildError(f"rebuilding {original['path']} from {input_path} gave different "
                             f"bytes than the cache recorded: the input changed since the build; "
                             "nothing was replaced for this block. Rebuild the cache into a new "
                             "directory")
    written = []
    for name, _ in _FILES:
        rel = rebuilt.get(name)
        if rel is None:
            continue
        with open(os.path.join(scratch, *rel.split("/")), "rb") as f:
            storage.write(rel, [f.read()])
        written.append(rel)
    return written


def _remove_scratch_block(scratch: str, entry: dict) -> None:
    for name, _ in _FILES:
        if entry.get(name):
            os.unlink(os.path.join(scratch, *entry[name].split("/")))
