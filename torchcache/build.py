"""The cache builder: tokenize inputs into immutable blocks, commit them in a deterministic order.

Each input shard is tokenized sequentially by one worker into blocks of whole documents. A worker
writes a block durably, then tells the coordinator, which records it in the manifest. The token
stream is the blocks in round-robin order over inputs (input 0 block 0, input 1 block 0, ...,
input 0 block 1, ...): a pure function of the inputs, never of timing or worker count. A block
finished out of that order waits in the manifest's `pending` list (durable, so never redone),
invisible to readers until every block before it in stream order is there.
"""

from __future__ import annotations

import os
import queue as queue_module
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from . import format as fmt
from .storage import TMP_MARK, Storage, open_storage
from .inputs import ITERABLE_PATH, InputError, InputSource, iter_records, iter_strings, resolve_inputs
from .tokenizing import (DocumentEncoder, TokenizerLike, canonical_json, load_tokenizer,
                         special_token_id, tokenizer_fingerprint)

if TYPE_CHECKING:
    from .handle import BuildHandle

_BATCH_CHARS = 4 << 20
_BATCH_DOCS = 1024


class BuildError(RuntimeError):
    """The build could not finish; everything committed so far is kept and a re-run resumes."""


@dataclass
class BuildResult:
    """Summary of a finished (or already complete) build."""

    path: str
    num_tokens: int
    num_documents: int
    num_blocks: int
    skipped: dict[str, int]
    fingerprint: str
    seconds: float
    tokens_built: int = 0  # tokens tokenized by this call (0 for a no-op re-run)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_built / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class _Job:
    """Everything a worker needs for one build (picklable, small)."""

    output: Storage
    tokenizer_json: str | None  # None: inputs hold token ids already (webdataset conversion)
    bos_id: int | None
    eos_id: int | None
    dtype: str
    text_key: str
    block_tokens: int
    on_error: str
    special_tokens_as_text: bool
    storage_options: dict = field(default_factory=dict)
    vocab_size: int | None = None


# ---------------------------------------------------------------- per-input work (runs in workers)

def build_input(job: _Job, index: int, source: InputSource | Iterable[str],
                start: dict[str, Any]) -> Iterator[tuple]:
    """Tokenize one input from its resume point; yield events for the coordinator.

    Events: ("block", index, entry, progress), ("progress", index, position, tokens),
    ("done", index, progress). `progress` is the input's resume point (records consumed and
    skip counts) as of the end of that block.
    """
    encode = _document_encoder(job)
    skipped = dict(start["skipped"])
    records = start["records"]
    block_no = start["blocks"]
    if isinstance(source, InputSource):
        stream = iter_records(source, job.text_key, records, job.on_error, job.storage_options,
                              tokens=job.tokenizer_json is None)
    else:
        stream = iter_strings(source, records, job.on_error)
    docs: list[np.ndarray] = []
    keys: list[str | None] = []
    doc_tokens = 0
    last_number, last_counts = records, dict(skipped)  # resume point as of the last document

    def flush(upto: int, counts: dict[str, int]) -> tuple:
        nonlocal docs, keys, doc_tokens, block_no
        entry = _write_block(job, index, block_no, docs, keys)
        block_no += 1
        docs, keys, doc_tokens = [], [], 0
        return ("block", index, entry, {"records": upto, "skipped": dict(counts), "blocks": block_no})

    batches = _Batches(stream, skipped, _token_checker(job, source), job.on_error)
    for batch in batches:
        encoded = encode([r for r, _ in batch])
        for (record, counts), ids in zip(batch, encoded):
            if docs and doc_tokens + len(ids) > job.block_tokens:
                yield flush(last_number, last_counts)
            docs.append(ids)
            keys.append(record.key)
            doc_tokens += len(ids)
            last_number, last_counts = record.number, counts
            if doc_tokens >= job.block_tokens:
                yield flush(last_number, last_counts)
        yield ("progress", index, batch[-1][0].position, int(sum(len(x) for x in encoded)))
    records_end = max(records, batches.last_number)
    if docs:
        yield flush(last_number, last_counts)
    yield ("done", index, {"records": records_end, "skipped": skipped, "blocks": block_no})


def _document_encoder(job: _Job) -> Callable[[list], list[np.ndarray]]:
    """Records -> token arrays: the tokenizer for text, BOS/EOS added to pre-tokenized ids."""
    if job.tokenizer_json is not None:
        encoder = DocumentEncoder(job.tokenizer_json, bos_id=job.bos_id, eos_id=job.eos_id,
                                  dtype=np.dtype(job.dtype),
                                  special_tokens_as_text=job.special_tokens_as_text)
        return lambda records: encoder.encode([r.text for r in records])
    head = [] if job.bos_id is None else [job.bos_id]
    tail = [] if job.eos_id is None else [job.eos_id]

    def wrap(records: list) -> list[np.ndarray]:
        return [np.concatenate([np.asarray(head, dtype=job.dtype), r.tokens.astype(job.dtype),
                                np.asarray(tail, dtype=job.dtype)]) for r in records]
    return wrap


def _token_checker(job: _Job, source: Any) -> Callable[[Any], str | None]:
    """For pre-tokenized records: a message if ids fall outside the vocabulary, else None."""
    limit = job.vocab_size if job.vocab_size is not None else np.iinfo(np.dtype(job.dtype)).max + 1

    def check(record) -> str | None:
        ids = record.tokens
        if ids is None or not len(ids):
            return None
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and high < limit:
            return None
        bad = low if low < 0 else high
        return (f"{getattr(source, 'path', source)}: sample {record.key!r}: token id {bad} is outside "
                f"the vocabulary [0, {limit}); pass the right vocab_size, or on_error='skip' to skip "
                "and count such samples")
    return check


class _Batches:
    """Groups non-empty documents into batches and counts skipped and empty records.

    Each document comes with a snapshot of the skip counts as of its record, so a block can
    record the input's exact resume point.
    """

    def __init__(self, stream: Iterator, skipped: dict[str, int], check: Callable[[Any], str | None],
                 on_error: str = "raise"):
        self.stream, self.skipped, self.last_number = stream, skipped, 0
        self.check, self.on_error = check, on_error

    def _count(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def __iter__(self):
        batch, chars = [], 0
        try:
            for record in self.stream:
                self.last_number = record.number
                content = record.text if record.tokens is None else record.tokens
                if content is None:
                    self._count(record.problem)
                    continue
                if not len(content):
                    self._count("empty")
                    continue
                problem = self.check(record)
                if problem is not None:
                    if self.on_error == "raise":
                        raise InputError(problem)
                    self._count("bad_tokens")
                    continue
                batch.append((record, dict(self.skipped)))
                chars += len(content)
                if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
                    yield batch
                    batch, chars = [], 0
        except InputError:
            if batch:  # let the blocks completed before the bad record be committed first
                yield batch
            raise
        if batch:
            yield batch


def _write_block(job: _Job, index: int, block_no: int, docs: list[np.ndarray],
                 keys: list[str | None]) -> dict[str, Any]:
    tokens = np.concatenate(docs).astype(job.dtype, copy=False)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    path = fmt.block_name(index, block_no)
    meta = {"format": fmt.FORMAT_NAME, "version": str(fmt.FORMAT_VERSION)}
    block = fmt.write_tensor_file(job.output, path, "tokens", tokens, meta)
    side = fmt.write_tensor_file(job.output, fmt.offsets_name(path), "offsets", offsets, meta)
    entry = {"path": block.path, "checksum": block.checksum, "size": block.size,
             "offsets": side.path, "offsets_checksum": side.checksum,
             "num_tokens": int(len(tokens)), "num_documents": len(docs),
             "input": index, "index": block_no}
    if any(k is not None for k in keys):
        written = fmt.write_keys_file(job.output, fmt.keys_name(path), keys)
        entry.update(keys=written.path, keys_checksum=written.checksum)
    return entry


# ---------------------------------------------------------------- worker processes

def _die_with_parent() -> None:
    """Make a worker exit if its coordinator is killed (Linux), so no orphan keeps writing."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker_main(job: _Job, sources: list[InputSource], starts: dict, tasks, events) -> None:
    _die_with_parent()
    parent = os.getppid()
    while True:
        index = tasks.get()
        if index is None:
            return
        try:
            for event in build_input(job, index, sources[index], starts[index]):
                if os.getppid() != parent:
                    return
                events.put(event)
        except InputError as e:
            events.put(("error", index, "input", str(e)))
            return
        except Exception as e:  # reported to the coordinator, which re-raises it
            import traceback
            events.put(("error", index, "crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return


# ---------------------------------------------------------------- coordinator

class _Manifest:
    """The coordinator's view of the manifest; `save()` writes it atomically."""

    def __init__(self, storage: Storage, spec: dict[str, Any], existing: dict[str, Any] | None):
        self.storage, self.spec = storage, spec
        n = len(spec["inputs"])
        self.finished: list[list[dict]] = [[] for _ in range(n)]
        self.progress: list[dict] = [{"records": 0, "skipped": {}, "blocks": 0, "done": False}
                                     for _ in range(n)]
        if existing:
            for entry in existing["blocks"] + existing.get("pending", []):
                self.finished[entry["input"]].append(entry)
            for i, p in enumerate(existing["inputs"]):
                self.progress[i] = {k: p[k] for k in ("records", "skipped", "blocks", "done")}
            for blocks in self.finished:
                blocks.sort(key=lambda e: e["index"])

    def add_block(self, index: int, entry: dict, progress: dict) -> None:
        if entry["index"] < len(self.finished[index]):
            return  # reported again by a retried task: the same block, already recorded
        self.finished[index].append(entry)
        self.progress[index].update(progress)

    def finish_input(self, index: int, progress: dict) -> None:
        self.progress[index].update(progress, done=True)

    def stream(self) -> tuple[list[dict], list[dict], bool]:
        """The committed stream (round-robin prefix), the pending rest, and completeness."""
        visible, r, n = [], 0, len(self.finished)
        while True:
            advanced = False
            for i in range(n):
                if r < len(self.finished[i]):
                    visible.append(self.finished[i][r])
                    advanced = True
                elif not self.progress[i]["done"]:
                    taken = {id(e) for e in visible}
                    pending = [e for blocks in self.finished for e in blocks if id(e) not in taken]
                    return visible, pending, False
            if not advanced:
                return visible, [], True
            r += 1

    def document(self) -> dict[str, Any]:
        visible, pending, complete = self.stream()
        skipped: dict[str, int] = {}
        for p in self.progress:
            for k, v in p["skipped"].items():
                skipped[k] = skipped.get(k, 0) + v
        return {
            "format": fmt.FORMAT_NAME, "version": fmt.FORMAT_VERSION, "spec": self.spec,
            "fingerprint": fmt.spec_fingerprint(self.spec),
            "blocks": visible, "pending": pending, "complete": complete,
            "num_tokens": sum(e["num_tokens"] for e in visible),
            "num_documents": sum(e["num_documents"] for e in visible),
            "inputs": [dict(spec_input, **progress)
                       for spec_input, progress in zip(self.spec["inputs"], self.progress)],
            "skipped": skipped,
        }

    def save(self) -> dict[str, Any]:
        doc = self.document()
        self.storage.write_json(fmt.MANIFEST_NAME, doc)
        return doc


def _lock(storage: Storage):
    lock = storage.lock()
    try:
        lock.acquire()
    except RuntimeError:
        raise BuildError(f"another builder is writing {storage.url!r} right now; wait for it to "
                         "finish (or stop it) before building there") from None
    return lock


def _clean(storage: Storage, manifest: dict[str, Any] | None) -> None:
    """Remove temporary files and block files the manifest does not know (left by a crash)."""
    known = set()
    if manifest:
        for e in manifest["blocks"] + manifest.get("pending", []):
            known.update((e["path"], e["offsets"], e.get("keys")))
    for name in storage.listdir(""):
        if TMP_MARK in name:
            storage.delete(name)
    for name in storage.listdir(fmt.BLOCK_DIR):
        if TMP_MARK in name or f"{fmt.BLOCK_DIR}/{name}" not in known:
            storage.delete(f"{fmt.BLOCK_DIR}/{name}")


def _check_output(storage: Storage) -> None:
    allowed = {fmt.MANIFEST_NAME, fmt.TOKENIZER_NAME, fmt.BLOCK_DIR, ".lock"}
    strangers = [n for n in storage.listdir("") if n not in allowed and TMP_MARK not in n]
    if strangers:
        raise BuildError(f"output {storage.url!r} is not empty and is not a torchcache cache "
                         f"(it holds {strangers[:5]}); choose a new or empty directory")


def _spec_diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def build_cache(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike | None, *,
                text_key: str = "text", block_tokens: int = 2 ** 24, num_workers: int | None = None,
                on_error: str = "raise", background: bool = False, executor: str = "local",
                eos: int | str | None = "auto", bos: int | str | None = None,
                special_tokens_as_text: bool = True, progress: bool | None = None,
                storage_options: dict[str, Any] | None = None,
                vocab_size: int | None = None) -> "BuildResult | BuildHandle":
    """Tokenize `inputs` into a cache at `output`; see the README for every option.

    Re-running a finished build with the same arguments is a cheap no-op; an interrupted build
    (even by kill -9) resumes where it stopped and ends with exactly the cache an uninterrupted
    build would have made. `background=True` returns a BuildHandle at once so training can read
    the committed prefix while the build goes on.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if not isinstance(block_tokens, int) or block_tokens < 1:
        raise ValueError(f"block_tokens must be a positive int, not {block_tokens!r}")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', not {executor!r}")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, not {num_workers}")
    kwargs = dict(text_key=text_key, block_tokens=block_tokens, num_workers=num_workers,
                  on_error=on_error, eos=eos, bos=bos, special_tokens_as_text=special_tokens_as_text,
                  storage_options=storage_options, vocab_size=vocab_size, executor=executor)
    if background:
        from .handle import BuildHandle
        return BuildHandle.start(inputs, output, tokenizer, kwargs)
    return _build(inputs, output, tokenizer, progress=True if progress is None else progress, **kwargs)


def _build(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike, *, text_key: str,
           block_tokens: int, num_workers: int | None, on_error: str, eos, bos,
           special_tokens_as_text: bool, storage_options: dict[str, Any] | None,
           vocab_size: int | None = None, executor: str = "local", progress: bool = False,
           report: Callable[[dict], None] | None = None,
           should_stop: Callable[[], bool] | None = None) -> BuildResult:
    started = time.perf_counter()
    storage = open_storage(output, storage_options)
    resolved = resolve_inputs(inputs, storage_options)
    sources = resolved if isinstance(resolved, list) else None
    if tokenizer is None:
        tok = None
        if sources is None or any(s.kind != "wds" for s in sources):
            raise ValueError("tokenizer is required, except for pre-tokenized webdataset tars "
                             "(see convert_webdataset)")
        dtype = fmt.token_dtype(vocab_size) if vocab_size is not None else np.dtype("<u4")
        tokenizer_spec = None
        bos_id, eos_id = (_plain_token_id(x, name, vocab_size) for x, name in ((bos, "bos"), (eos, "eos")))
    else:
        if vocab_size is not None:
            raise ValueError("vocab_size comes from the tokenizer; pass it only without one")
        tok = load_tokenizer(tokenizer)
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        dtype = fmt.token_dtype(vocab_size)
        tokenizer_spec = {"fingerprint": tokenizer_fingerprint(tok)}
        bos_id, eos_id = special_token_id(tok, bos, "bos"), special_token_id(tok, eos, "eos")
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
    storage.makedirs()
    lock = _lock(storage)
    try:
        existing = None
        if storage.exists(fmt.MANIFEST_NAME):
            existing = fmt.read_manifest(storage)
            if existing["spec"] != spec:
                raise BuildError(
                    f"{storage.url!r} holds a cache built with other settings (differs in: "
                    f"{', '.join(_spec_diff(existing['spec'], spec))}); refusing to mix them. Use a "
                    "new output directory, or delete this one to rebuild")
        else:
            _check_output(storage)
        _clean(storage, existing)
        state = _Manifest(storage, spec, existing)
        if existing is None:
            if tok is not None:
                storage.write(fmt.TOKENIZER_NAME, [tok.to_str().encode()])
            state.save()
        elif existing["complete"]:
            return _result(storage, existing, started, 0)
        job = _Job(storage, None if tok is None else canonical_json(tok), bos_id, eos_id,
                   str(dtype), text_key, block_tokens, on_error, special_tokens_as_text,
                   dict(storage_options or {}), vocab_size)
        todo = [i for i, p in enumerate(state.progress) if not p["done"]]
        bar = _ProgressBar(spec["inputs"], state, enabled=progress)
        try:
            workers = min(len(todo), (os.cpu_count() or 1) if num_workers is None else num_workers)
            if executor == "ray":
                from .ray_executor import run_ray
                built = run_ray(job, sources, todo, state, bar, report, should_stop, num_workers)
            elif sources is None or workers <= 1 or any(s.process_local for s in sources):
                built = _run_inline(job, sources or [resolved], todo, state, bar, report, should_stop)
            else:
                built = _run_pool(job, sources, todo, state, workers, bar, report, should_stop)
        finally:
            bar.close()
        return _result(storage, state.document(), started, built)
    finally:
        lock.release()


def _plain_token_id(token: Any, role: str, vocab_size: int | None) -> int | None:
    """BOS/EOS for pre-tokenized data: an id or None (there is no tokenizer to look names up)."""
    if token is None:
        return None
    if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
        raise ValueError(f"{role}={token!r}: without a tokenizer, give {role} as a token id or None")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{role}={token} is outside the vocabulary (size {vocab_size})")
    return int(token)


def _result(storage: Storage, manifest: dict, started: float, built: int) -> BuildResult:
    return BuildResult(storage.url, manifest["num_tokens"], manifest["num_documents"],
                       len(manifest["blocks"]), dict(manifest["skipped"]), manifest["fingerprint"],
                       time.perf_counter() - started, built)


def _apply(event: tuple, state: _Manifest, bar: "_ProgressBar") -> bool:
    """Apply one worker event; True when the manifest changed and must be saved."""
    kind, index = event[0], event[1]
    if kind == "block":
        state.add_block(index, event[2], event[3])
        return True
    if kind == "done":
        state.finish_input(index, event[2])
        return True
    if kind == "progress":
        bar.update(index, event[2], event[3])
        return False
    if kind == "error":
        if event[2] == "input":
            raise InputError(event[3])
        raise BuildError(f"building input {state.spec['inputs'][index]['path']} failed: {event[3]}")
    raise AssertionError(f"unknown event {kind}")


def _commit(events: list[tuple], state: _Manifest, bar: "_ProgressBar", report) -> int:
    """Apply worker events in order, then save the manifest once (also when one of them is an
    error: what was finished before it is kept). Returns the tokens the events report."""
    built, changed = 0, False
    try:
        for event in events:
            changed |= _apply(event, state, bar)
            if event[0] == "progress":
                built += event[3]
    finally:
        if changed:
            _save(state, report)
    return built


def check_cancelled(should_stop: Callable[[], bool] | None) -> None:
    if should_stop and should_stop():
        raise BuildError("build cancelled; committed blocks are kept and a re-run resumes")


def _run_inline(job, sources, todo, state, bar, report, should_stop) -> int:
    built = 0
    for index in todo:
        for event in build_input(job, index, sources[index], state.progress[index]):
            built += _commit([event], state, bar, report)
            check_cancelled(should_stop)
    return built


def _save(state: _Manifest, report) -> None:
    doc = state.save()
    if report:
        report({"committed_blocks": len(doc["blocks"]), "committed_tokens": doc["num_tokens"],
                "committed_documents": doc["num_documents"], "complete": doc["complete"],
                "inputs_done": sum(p["done"] for p in state.progress), "inputs": len(state.progress)})


def _run_pool(job, sources, todo, state, workers, bar, report, should_stop) -> int:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    tasks, events = ctx.Queue(), ctx.Queue()
    for index in todo:
        tasks.put(index)
    for _ in range(workers):
        tasks.put(None)
    starts = {i: state.progress[i] for i in todo}
    procs = [ctx.Process(target=_worker_main, args=(job, sources, starts, tasks, events), daemon=True)
             for _ in range(workers)]
    for p in procs:
        p.start()
    remaining, built = set(todo), 0
    try:
        while remaining:
            try:
                batch = [events.get(timeout=0.5)]
            except queue_module.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BuildError(f"a build worker died (exit code {dead[0].exitcode}); committed "
                                     "blocks are kept and a re-run resumes") from None
                if all(p.exitcode == 0 for p in procs):
                    raise BuildError("build workers stopped before finishing inputs "
                                     f"{sorted(remaining)}") from None
                check_cancelled(should_stop)
                continue
            while True:
                try:
                    batch.append(events.get_nowait())
                except queue_module.Empty:
                    break
            built += _commit(batch, state, bar, report)
            remaining.difference_update(event[1] for event in batch if event[0] == "done")
            check_cancelled(should_stop)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        events.close()
        tasks.close()
    return built


class _ProgressBar:
    """tqdm over input bytes, with tokens/s; a no-op when disabled."""

    def __init__(self, inputs: list[dict], state: _Manifest, enabled: bool):
        self.bar = None
        self.positions: dict[int, int] = {}
        self.tokens = 0
        self.started = time.perf_counter()
        if not enabled:
            return
        from tqdm.auto import tqdm
        total = sum(i["size"] or 0 for i in inputs) or None
        done = sum(i["size"] or 0 for i, p in zip(inputs, state.progress) if p["done"])
        self.bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc="tokenizing",
                        dynamic_ncols=True)

    def update(self, index: int, position: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is None:
            return
        delta = position - self.positions.get(index, 0)
        self.positions[index] = position
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / elapsed / 1e6:.2f}M tok/s", refresh=False)
        self.bar.update(max(delta, 0))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
