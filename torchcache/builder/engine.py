"""The build engine: turn `build_cache`'s arguments into a spec, open (or resume) the output
under its lock, choose an executor, and report the result.

A build is a pure function of (inputs, tokenizer, options): the spec records all of them, and
a re-run with the same spec resumes from the manifest or, when complete, does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from tqdm.auto import tqdm

from ..format import blocks as fmt
from .commit import (Committer, ManifestState, acquire_lock, block_starts, damaged_pending,
                     open_existing, output_names, remove_created_folder, undo_failed_first_build)
from ..errors import BuildError, InputChangedError
from .executors import run_inline, run_pool
from .inputs import content_identity, iter_records, iter_strings, resolve_inputs
from ..format.ledger import record_stamps, write_header
from .ray_executor import run_ray
from .records import ITERABLE_PATH, InputSource
from ..format.storage import LocalStorage, Storage, open_storage
from ..read.cache import TokenCache
from ..format.tokenizer import TokenizerLike, canonical_json, fingerprint_of_json, load_tokenizer
from ..format.tokenizer_backends import TokenizerBackend
from ..format.tokenizer_declarations import tokenizer_declarations
from .tokenizing import special_token_id
from .chat import ChatTemplate, load_chat_template, split_role_markers
from ..format.arrays import merged_declarations
from .formats import documents_spec
from .functions import function_fingerprint, pack_function
from .worker import BlockWritten, BuildJob, build_input


@dataclass
class BuildResult:
    """Summary of a finished (or already complete) build: what `build_cache` returns (its
    docstring has an example)."""

    path: str
    num_tokens: int
    num_documents: int
    num_blocks: int
    skipped: dict[str, int]
    fingerprint: str
    seconds: float
    tokens_built: int = 0  # tokens tokenized by this call (0 for a no-op re-run)
    already_complete: bool = False  # True when the cache was complete before this call

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_built / self.seconds if self.seconds > 0 else 0.0


def default_workers() -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here: the affinity mask is the limit
    return max(1, cpus)


def progress_enabled(progress: bool | None) -> bool:
    """`progress` as given, or by default on unless the TQDM_DISABLE environment variable is set."""
    if progress is not None:
        return progress
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("", "0", "false", "no")


def run_build(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike | None, *,
              text_key: str, block_tokens: int, num_workers: int | None, on_error: str, eos, bos,
              special_tokens_as_text: bool, storage_options: dict[str, Any] | None,
              vocab_size: int | None = None, executor: str = "local", progress: bool = False,
              allow_empty: bool = False, report: Callable[[dict], None] | None = None,
              should_stop: Callable[[], bool] | None = None, input_format: str = "text",
              chat_template: Any = None, train_on: str = "assistant",
              keep_fields: tuple[str, ...] = (), arrays: dict[str, Any] | None = None,
              token_arrays: dict[str, Any] | None = None, block_array_bytes: int = 2 ** 26,
              pipeline: tuple[tuple[str, Callable[[Any], Any]], ...] = ()) -> BuildResult:
    """Build (or resume, or confirm) the cache; the arguments are `build_cache`'s, checked, and
    `pipeline`: a lazy pipeline's filter and map steps, ("filter" | "map", function), applied to
    each record (read whole) before its text is taken; their fingerprints join the spec."""
    started = time.perf_counter()
    storage = open_storage(output, storage_options)
    resolved = resolve_inputs(inputs, storage_options)
    sources = resolved if isinstance(resolved, list) else None
    declared = merged_declarations(arrays, token_arrays)
    whole = input_format != "text" or bool(keep_fields) or bool(declared) or bool(pipeline)  # read whole
    if whole:  # JSON lines objects, Parquet rows; a pipeline also takes tar samples (bytes)
        for s in sources or []:
            if s.kind not in ("jsonl", "parquet") and not (s.kind == "wds" and pipeline):
                raise ValueError(f"{s.path}: input_format={input_format!r}, keep_fields, arrays and "
                                 "pipelines "
                                 "read JSON lines or Parquet files (or an iterable of dicts; "
                                 f"pipelines also webdataset tars), not {s.kind} inputs; convert it "
                                 "to JSON lines"
                                 + (" or read it with tc.source(...)" if s.kind == "wds" else ""))
    if tokenizer is None:
        tok = None
        if input_format != "tokens" and (sources is None or any(s.kind != "wds" for s in sources)):
            raise ValueError("tokenizer is required, except for pre-tokenized inputs "
                             "(input_format='tokens', or webdataset tars: see convert_webdataset)")
        dtype = fmt.token_dtype(vocab_size) if vocab_size is not None else np.dtype("<u4")
        tokenizer_spec = None
        eos = None if isinstance(eos, str) and eos == "auto" else eos  # no tokenizer, no end-of-text
        bos_id, eos_id = (_plain_token_id(x, name, vocab_size) for x, name in ((bos, "bos"), (eos, "eos")))
    else:
        if vocab_size is not None:
            raise ValueError("vocab_size comes from the tokenizer; pass it only without one")
        tok = load_tokenizer(tokenizer)
        if isinstance(tok, TokenizerBackend):  # tiktoken, SentencePiece: their files travel
            vocab_size, tokenizer_json, tokenizer_spec = tok.vocab_size, tok, tok.spec()
        else:
            vocab_size = tok.get_vocab_size(with_added_tokens=True)
            tokenizer_json = canonical_json(tok)  # (made once: a large tokenizer takes ~0.2 s)
            tokenizer_spec = {"fingerprint": fingerprint_of_json(tokenizer_json)}
        dtype = fmt.token_dtype(vocab_size)
        said = tokenizer_declarations(tokenizer)  # a model folder's, a transformers tokenizer's
        bos_id, eos_id = (special_token_id(tok, bos, "bos", said),
                          special_token_id(tok, eos, "eos", said))
    template = None
    if input_format == "messages":
        beside = not (isinstance(tokenizer, str) and tokenizer.startswith("tiktoken:"))
        template = load_chat_template(tokenizer if beside else None, chat_template)
        _warn_split_markers(template, tok)
    documents = documents_spec(input_format, keep_fields, template, train_on, declared or None)
    spec = {
        "tokenizer": tokenizer_spec,
        "vocab_size": vocab_size,
        "dtype": fmt.dtype_name(dtype),
        "bos_id": bos_id,
        "eos_id": eos_id,
        "special_tokens_as_text": special_tokens_as_text,
        "text_key": text_key,
        "block_tokens": block_tokens,
        "inputs": [s.spec() for s in sources] if sources else [{"path": ITERABLE_PATH, "size": None}],
    }
    if declared:  # (absent elsewhere: caches without arrays keep their spec and fingerprint)
        spec["block_array_bytes"] = block_array_bytes
    if documents is not None:
        spec["documents"] = documents
    if pipeline:  # what each step does is part of the cache's identity
        spec["pipeline"] = [{"step": kind, "function": function_fingerprint(fn)}
                            for kind, fn in pipeline]
    _check_output_path(storage)
    before = output_names(storage)  # what a failed first build must leave as it found it
    storage.makedirs()
    try:
        job = BuildJob.for_spec(storage, spec, None if tok is None else tokenizer_json, on_error,
                                storage_options, template.name if template is not None else None,
                                tuple((kind, pack_function(fn)) for kind, fn in pipeline))
        lock = acquire_lock(storage)
    except Exception:
        remove_created_folder(storage, before)
        raise
    first = fmt.MANIFEST_NAME not in (before or ())  # no cache here before this call
    undone = finished = False
    try:
        existing = open_existing(storage, spec)
        # an earlier first build that stopped before committing anything counts as none
        first = first or existing is None or (not existing["complete"] and not existing["blocks"]
                                              and not existing.get("pending"))
        restamped: dict[int, str] = {}
        if existing is not None:
            if sources is None:
                if existing["complete"]:
                    _check_iterable(storage, existing, resolved, objects=job.reads_whole_records)
            else:
                restamped = _check_finished_inputs(storage, existing, sources, job)
                _rewrite_pending(storage, existing, sources, job)
        if existing is not None and existing["complete"]:
            if restamped and existing["version"] >= 2:  # checked unchanged: cheap next time
                record_stamps(storage, existing["fingerprint"], restamped)
            _store_tokenizer(storage, tok)
            _require_trained(storage, _summary(existing), spec, storage_options, template)
            return _result(storage, _summary(existing), started, 0, allow_empty,
                           already_complete=True)
        if existing is None:
            write_header(storage, spec)  # the manifest first: a tokenizer.json without one is never ours
        state = ManifestState(storage, spec, existing, lock)
        for i, stamp in restamped.items():
            state.progress[i]["stamp"] = stamp
        if existing is None:
            state.save()  # an empty first commit
        _store_tokenizer(storage, tok)
        todo = [i for i, p in enumerate(state.progress) if not p["done"]]
        starts = {i: dict(state.progress[i]) for i in todo}
        bar = _ProgressBar(spec["inputs"], state, enabled=progress)
        committer = Committer(state, bar.update, report)
        try:
            workers = min(len(todo), default_workers() if num_workers is None else num_workers)
            if executor == "ray":
                built = run_ray(job, sources, todo, starts, committer, should_stop, num_workers)
            elif sources is None or workers <= 1 or any(s.process_local for s in sources):
                built = run_inline(job, sources or [resolved], todo, starts, committer, should_stop)
            else:
                built = run_pool(job, sources, todo, starts, committer, should_stop, workers)
        except BaseException:
            bar.close(clear=True)  # no stale bar above the error message that follows
            raise
        bar.close()
        finished = True  # from here on only the checks of the result fail (empty, trains nothing)
        _require_trained(storage, state.summary(), spec, storage_options, template)
        return _result(storage, state.summary(), started, built, allow_empty)
    except Exception:
        if first:  # nothing that looks like a cache may stay (committed blocks do: they resume)
            undone = undo_failed_first_build(storage, lock, before, refused=finished)
        raise
    finally:
        lock.release()
        if undone:
            remove_created_folder(storage, before)


def _store_tokenizer(storage: Storage, tok: Any) -> None:
    """The cache's copy of its tokenizer, unless there: tokenizer.json, or a tiktoken or
    SentencePiece backend's own files."""
    if tok is None:
        return
    files = tok.files if isinstance(tok, TokenizerBackend) else \
        {fmt.TOKENIZER_NAME: None}  # (tokenizer.json's text is made only when missing)
    for name, data in files.items():
        if not storage.exists(name):
            storage.write(name, [data if data is not None else tok.to_str().encode()])


def _check_iterable(storage: Storage, existing: dict[str, Any], items: Any, objects: bool) -> None:
    """A complete cache built from an iterable: the iterable given now must be the same stream
    of strings (or of dicts: `objects`), read and digested here, not tokenized, else
    InputChangedError."""
    recorded = existing["inputs"][0]
    count, digest = content_identity(iter_strings(items, 0, "skip", objects=objects))
    if recorded.get("digest") is None and recorded["records"]:
        return  # a cache made before digests were recorded: nothing to compare with
    if (count, digest) == (recorded["records"], recorded.get("digest")):
        return
    how = (f"{count} items now, {recorded['records']} then" if count != recorded["records"]
           else "as many items, other content")
    raise InputChangedError(f"{storage.url}: the iterable of strings given differs from the one "
                            f"this cache was built from ({how}); the cache is unchanged. Pass "
                            f"the same strings, build into a new output, or delete {storage.url} "
                            "to rebuild it")


def _check_finished_inputs(storage: Storage, existing: dict[str, Any], sources: list[InputSource],
                           job: BuildJob) -> dict[int, str]:
    """Every input an earlier build finished must be the version it read: the same stamp
    (modification time, ETag) proves it cheaply; otherwise its content is read and digested.
    InputChangedError names the first that changed; returns the new stamps of inputs whose
    stamp changed but whose content did not."""
    restamped = {}
    for i, (source, recorded) in enumerate(zip(sources, existing["inputs"])):
        if not recorded["done"]:
            continue  # resumed: the records it read before are checked as they are read again
        stamp = recorded.get("stamp")
        if isinstance(stamp, str) and stamp == source.stamp:
            continue
        if recorded.get("digest") is None and recorded["records"]:
            continue  # a cache made before digests were recorded: nothing to compare with
        whole = job.reads_whole_records
        records = iter_records(source, None if whole else job.text_key, 0, "skip",
                               job.storage_options, tokens=not job.has_tokenizer and not whole)
        if content_identity(records) != (recorded["records"], recorded.get("digest")):
            raise InputChangedError(_changed_message(storage, source, existing["complete"]))
        if source.stamp is not None:
            restamped[i] = source.stamp
    return restamped


def _changed_message(storage: Storage, source: InputSource, complete: bool) -> str:
    if complete:
        return (f"input {source.path} changed since the cache {storage.url} was built from it "
                f"(same size, other content); the cache is unchanged and holds the old content. "
                f"Restore the input, build into a new output, or delete {storage.url} to rebuild it")
    return (f"input {source.path} changed since the interrupted build into {storage.url} read it "
            "(same size, other content); resuming would mix two versions of it. Restore the "
            "input, or build into a new output")


def _rewrite_pending(storage: Storage, existing: dict[str, Any], sources: list[InputSource],
                     job: BuildJob) -> None:
    """Blocks an interrupted build finished but had not committed to the stream yet (pending)
    whose files are now missing or damaged are made again from their inputs, byte for byte,
    before the build goes on; BuildError when that cannot give the recorded bytes."""
    damaged = damaged_pending(storage, existing)
    if not damaged:
        return
    starts = block_starts(storage, existing, {(e["input"], e["index"]) for e in damaged})
    rebuild = dataclasses.replace(job, on_error="skip")  # blocks end where the first build's did
    for entry in damaged:
        start = starts.get((entry["input"], entry["index"]))
        if start is None:
            raise BuildError(f"{storage.url}/{entry['path']}: a block the interrupted build "
                             "finished is missing or damaged, and the commit log does not say "
                             f"where it starts in its input; delete {storage.url} and build again")
        made = _first_block(build_input(rebuild, entry["input"], sources[entry["input"]], start))
        if made is None or any(made.get(k) != entry.get(k) for k in
                               ("checksum", "offsets_checksum", "keys_checksum", "docs_checksum")):
            raise BuildError(f"{storage.url}/{entry['path']}: a block the interrupted build "
                             f"finished is missing or damaged, and making it again from "
                             f"{sources[entry['input']].path} gave other bytes: the input changed. "
                             f"Restore the input, or delete {storage.url} and build again")


def _first_block(events) -> dict[str, Any] | None:
    """The entry of the first block a `build_input` run writes (then it is stopped)."""
    try:
        for event in events:
            if isinstance(event, BlockWritten):
                return event.entry
        return None
    finally:
        events.close()


def _warn_split_markers(template: ChatTemplate, tok: Any) -> None:
    """Warn when the template's role markers are not single tokens of the build's tokenizer."""
    split = split_role_markers(template, tok) if tok is not None else []
    if split:
        warnings.warn(f"chat template {template.name}: its role markers "
                      f"{', '.join(map(repr, split))} (the text it writes right after a turn) "
                      "are not single tokens of the tokenizer, so a token can span the end of a "
                      "turn and what follows, and the trained mask's edges fall inside tokens; "
                      "add them to the tokenizer as special tokens", stacklevel=4)


def _require_trained(storage: Storage, summary: dict[str, Any], spec: dict[str, Any],
                     storage_options: dict[str, Any] | None, template: ChatTemplate | None) -> None:
    """A cache with a loss mask must train some token (BuildError otherwise). Its blocks' masks
    are read until a trained token is found: the first block, unless nothing is trained."""
    documents = spec.get("documents") or {}
    if not documents.get("loss_mask") or not summary["complete"] or not summary["num_documents"]:
        return
    cache = TokenCache(storage.url, storage_options=storage_options)
    starts = cache.block_token_starts()
    for b in range(cache.num_blocks):
        if cache.loss_mask(int(starts[b]), int(starts[b + 1])).any():
            return
    how = {"messages": f"the chat template {template.name if template else ''} marks nothing the "
                       "assistant writes with train_on="
                       f"{documents.get('train_on')!r}: use a template with {{% generation %}} "
                       "tags around what the assistant writes (its content and end-of-turn "
                       "marker), or pass train_on='all'",
           "prompt_completion": "every completion is empty: check the records' 'completion' "
                                "fields, or pass train_on='all'",
           "tokens": "every record's loss_mask (or labels) marks no token: check the records"}
    raise BuildError(f"{storage.url}: no token of this build is trained (0 of "
                     f"{summary['num_tokens']:,} tokens in {summary['num_documents']:,} documents), "
                     f"so it cannot train anything: {how.get(documents.get('input_format'), '')}")


def _check_output_path(storage: Storage) -> None:
    """A local output must be a directory (or not exist yet)."""
    root = getattr(storage, "root", None)
    if isinstance(storage, LocalStorage) and os.path.exists(root) and not os.path.isdir(root):
        raise BuildError(f"output {root!r} is a file, not a directory; give a new or empty "
                         "directory for the cache")


def _plain_token_id(token: Any, role: str, vocab_size: int | None) -> int | None:
    """BOS/EOS for pre-tokenized data: an id or None (there is no tokenizer to look names up)."""
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
        raise ValueError(f"{role}={token!r}: without a tokenizer there are no token strings to look "
                         f"up; give {role}=ID (a token id), or {role}=None for none")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{role}={token} is outside the vocabulary (size {vocab_size})")
    return int(token)


def _summary(manifest: dict[str, Any]) -> dict[str, Any]:
    """A (v1-shaped) manifest's counts, as ManifestState.summary() gives them."""
    return {"num_blocks": len(manifest["blocks"]), "complete": manifest["complete"],
            "num_tokens": sum(e["num_tokens"] for e in manifest["blocks"]),
            "num_documents": sum(e["num_documents"] for e in manifest["blocks"]),
            "skipped": dict(manifest.get("skipped", {})), "fingerprint": manifest["fingerprint"]}


def _result(storage: Storage, summary: dict[str, Any], started: float, built: int,
            allow_empty: bool, already_complete: bool = False) -> BuildResult:
    if summary["complete"] and not summary["num_documents"] and not allow_empty:
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(summary["skipped"].items()))
        why = f"every record was skipped ({skipped})" if skipped else "the inputs hold no document"
        raise BuildError(f"{storage.url}: the build produced an empty cache: {why}. Check the "
                         "inputs and text_key (or pass allow_empty=True to accept an empty cache)")
    return BuildResult(storage.url, summary["num_tokens"], summary["num_documents"],
                       summary["num_blocks"], dict(summary["skipped"]), summary["fingerprint"],
                       time.perf_counter() - started, built, already_complete)


class _ProgressBar:
    """tqdm over input bytes, with tokens/s; a no-op when disabled."""

    def __init__(self, inputs: list[dict], state: ManifestState, enabled: bool):
        self.bar = None
        self.positions: dict[int, int] = {}
        self.tokens = 0
        self.started = time.perf_counter()
        if not enabled:
            return
        total = sum(i["size"] or 0 for i in inputs) or None
        done = sum(i["size"] or 0 for i, p in zip(inputs, state.progress) if p["done"])
        # disable=False: progress_enabled() has heard TQDM_DISABLE, and progress=True wins over it
        self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="tokenizing",
                        dynamic_ncols=True, disable=False)

    def update(self, index: int, position: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is None:
            return
        delta = position - self.positions.get(index, 0)
        self.positions[index] = position
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed / 1e6:.2f}M tok/s", refresh=False)
        self.bar.update(max(delta, 0))

    def close(self, clear: bool = False) -> None:
        """Leave the final bar on screen, or erase it (`clear`)."""
        if self.bar is not None:
            self.bar.leave = not clear
            self.bar.close()
