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
import re
import signal
import time
import traceback
from multiprocessing.connection import Connection, wait as wait_for_connections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from . import format as fmt
from ._procs import Child, start_child
from ._args import int_arg
from .storage import TMP_MARK, LocalStorage, Lock, Storage, open_storage
from .inputs import ITERABLE_PATH, InputError, InputSource, iter_records, iter_strings, resolve_inputs
from .tokenizing import (DocumentEncoder, TokenizerLike, canonical_json, load_tokenizer,
                         special_token_id, tokenizer_fingerprint)

if TYPE_CHECKING:
    from .handle import BuildHandle

# Crash tests set this to kill the builder (SIGKILL, as a crash would) right after its N-th
# manifest write, so a test interrupts a build at a commit instead of racing it with a timer.
_KILL_AFTER_COMMITS = int(os.environ.get("TORCHCACHE_TEST_KILL_AFTER_COMMITS", "0"))
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
    already_complete: bool = False  # True when the cache was complete before this call

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
    digest = start.get("digest")  # None for caches built before inputs were identified by content
    if isinstance(source, InputSource):
        stream = iter_records(source, job.text_key, records, job.on_error, job.storage_options,
                              tokens=job.tokenizer_json is None, start_digest=digest)
    else:
        stream = iter_strings(source, records, job.on_error, start_digest=digest)
    docs: list[np.ndarray] = []
    keys: list[str | None] = []
    doc_tokens = 0
    # the input's resume point as of the last document: record number, skip counts, content hash
    last: tuple[int, dict[str, int], str | None] = (records, dict(skipped), digest)

    def flush() -> tuple:
        nonlocal docs, keys, doc_tokens, block_no
        entry = _write_block(job, index, block_no, docs, keys)
        block_no += 1
        docs, keys, doc_tokens = [], [], 0
        upto, counts, upto_digest = last
        return ("block", index, entry, {"records": upto, "skipped": dict(counts), "blocks": block_no,
                                        "digest": upto_digest})

    batches = _Batches(stream, skipped, _token_checker(job, source), job.on_error)
    for batch in batches:
        encoded = encode([r for r, _ in batch])
        for (record, counts), ids in zip(batch, encoded):
            if docs and doc_tokens + len(ids) > job.block_tokens:
                yield flush()
            docs.append(ids)
            keys.append(record.key)
            doc_tokens += len(ids)
            last = (record.number, counts, record.digest)
            if doc_tokens >= job.block_tokens:
                yield flush()
        yield ("progress", index, batch[-1][0].position, int(sum(len(x) for x in encoded)))
    if docs:
        yield flush()
    end = (batches.last_number, batches.last_digest) if batches.last_number > records else (records, digest)
    yield ("done", index, {"records": end[0], "skipped": skipped, "blocks": block_no, "digest": end[1]})


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
        self.stream, self.skipped = stream, skipped
        self.last_number, self.last_digest = 0, None  # of the last record read, kept or not
        self.check, self.on_error = check, on_error

    def _count(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def __iter__(self):
        batch, chars = [], 0
        try:
            for record in self.stream:
                self.last_number, self.last_digest = record.number, record.digest
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

def _worker_main(conn: Connection, job: _Job, sources: list[InputSource], starts: dict) -> None:
    """A pool worker (see _procs): build the inputs the coordinator sends until it sends None.

    A dead coordinator closes the connection, so the next send fails and the worker exits.
    """
    while True:
        index = conn.recv()
        if index is None:
            return
        try:
            for event in build_input(job, index, sources[index], starts[index]):
                conn.send(event)
        except InputError as e:
            conn.send(("error", index, "input", str(e)))
            return
        except OSError as e:  # a full disk, a lost connection...: one line, no traceback
            conn.send(("error", index, "os", f"{type(e).__name__}: {e}"))
            return
        except Exception as e:  # a bug: reported with its traceback, re-raised by the coordinator
            conn.send(("error", index, "crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            return


# ---------------------------------------------------------------- coordinator

class _Manifest:
    """The coordinator's view of the manifest; `save()` writes it atomically."""

    def __init__(self, storage: Storage, spec: dict[str, Any], existing: dict[str, Any] | None,
                 lock: Lock | None = None):
        self.storage, self.spec, self.lock = storage, spec, lock
        self.saves = 0
        n = len(spec["inputs"])
        self.finished: list[list[dict]] = [[] for _ in range(n)]
        self.progress: list[dict] = [{"records": 0, "skipped": {}, "blocks": 0, "done": False}
                                     for _ in range(n)]
        if existing:
            for entry in existing["blocks"] + existing.get("pending", []):
                self.finished[entry["input"]].append(entry)
            for i, p in enumerate(existing["inputs"]):
                self.progress[i] = {k: p[k] for k in ("records", "skipped", "blocks", "done")}
                if p.get("digest") is not None:
                    self.progress[i]["digest"] = p["digest"]
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
        order, complete = fmt.stream_order([len(blocks) for blocks in self.finished],
                                           [p["done"] for p in self.progress])
        visible = [self.finished[i][r] for i, r in order]
        taken = {id(e) for e in visible}
        pending = [e for blocks in self.finished for e in blocks if id(e) not in taken]
        return visible, pending, complete

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
        """Write the manifest atomically, unless this builder may have lost its lock."""
        if self.lock is not None:
            try:
                self.lock.check()
            except RuntimeError as e:
                raise BuildError(str(e)) from None
        doc = self.document()
        self.storage.write_json(fmt.MANIFEST_NAME, doc)
        self.saves += 1
        if self.saves == _KILL_AFTER_COMMITS:  # fault injection for crash tests: kill -9 right here
            os.kill(os.getpid(), signal.SIGKILL)
        return doc


def _lock(storage: Storage) -> Lock:
    lock = storage.lock()
    try:
        lock.acquire()
    except RuntimeError:
        raise BuildError(f"another builder is writing {storage.url!r} right now; wait for it to "
                         "finish (or stop it) before building there") from None
    return lock


# Names the builder creates: only these are ever deleted, and only when the manifest does not
# know them (left by a crash). Anything else in the output belongs to the user.
_OWN_BLOCK_FILE = re.compile(r"\d{6}-\d{6}(\.offsets\.safetensors|\.keys\.json|\.safetensors)"
                             rf"({re.escape(TMP_MARK)}\d+)?")
_OWN_TOP_TMP = re.compile(rf"(manifest|tokenizer)\.json{re.escape(TMP_MARK)}\d+")


def _clean(storage: Storage, manifest: dict[str, Any] | None) -> None:
    """Delete the builder's own leftovers of a crash: temporary files, and block files that the
    manifest does not know. Files the builder did not create are never touched."""
    known = set()
    if manifest:
        for e in manifest["blocks"] + manifest.get("pending", []):
            known.update((e["path"], e["offsets"], e.get("keys")))
    for name in storage.listdir(""):
        if _OWN_TOP_TMP.fullmatch(name):
            storage.delete(name)
    for name in storage.listdir(fmt.BLOCK_DIR):
        rel = f"{fmt.BLOCK_DIR}/{name}"
        if _OWN_BLOCK_FILE.fullmatch(name) and rel not in known:
            storage.delete(rel)


def _check_new_output(storage: Storage) -> None:
    """Refuse an output without a manifest that holds anything but the builder's own leftovers."""
    strangers = [n for n in storage.listdir("")
                 if n not in (".lock", fmt.BLOCK_DIR) and not _OWN_TOP_TMP.fullmatch(n)]
    strangers += [f"{fmt.BLOCK_DIR}/{n}" for n in storage.listdir(fmt.BLOCK_DIR)
                  if TMP_MARK not in n or not _OWN_BLOCK_FILE.fullmatch(n)]
    if strangers:
        raise BuildError(f"output {storage.url!r} is not empty and is not a torchcache cache "
                         f"(it holds {', '.join(strangers[:5])}); nothing was changed. Choose a new "
                         "or empty directory")


def _spec_diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _nothing_committed(manifest: dict[str, Any]) -> bool:
    return not manifest["blocks"] and not manifest.get("pending")


def _start_over(storage: Storage) -> None:
    """Remove a cache that committed nothing (a first build that failed), manifest last."""
    _clean(storage, None)
    storage.delete(fmt.TOKENIZER_NAME)
    storage.delete(fmt.MANIFEST_NAME)


def build_cache(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike | None, *,
                text_key: str = "text", block_tokens: int = 2 ** 24, num_workers: int | None = None,
                on_error: str = "raise", background: bool = False, executor: str = "local",
                eos: int | str | None = "auto", bos: int | str | None = None,
                special_tokens_as_text: bool = True, progress: bool | None = None,
                storage_options: dict[str, Any] | None = None,
                vocab_size: int | None = None, allow_empty: bool = False) -> "BuildResult | BuildHandle":
    """Tokenize `inputs` into a cache at `output`; see the README for every option.

    Re-running a finished build with the same arguments is a cheap no-op; an interrupted build
    (even by kill -9) resumes where it stopped and ends with exactly the cache an uninterrupted
    build would have made. `background=True` returns a BuildHandle at once so training can read
    the committed prefix while the build goes on. A build that yields no document at all is an
    error unless `allow_empty=True`.

    Example:
        >>> result = tc.build_cache("data/*.jsonl", "caches/web", "tokenizer.json")
        >>> result.num_tokens, result.skipped
    """
    _check_build_arguments(text_key=text_key, block_tokens=block_tokens, num_workers=num_workers,
                           on_error=on_error, background=background, executor=executor, eos=eos,
                           bos=bos, special_tokens_as_text=special_tokens_as_text,
                           progress=progress, storage_options=storage_options,
                           vocab_size=vocab_size, allow_empty=allow_empty)
    kwargs = dict(text_key=text_key, block_tokens=block_tokens, num_workers=num_workers,
                  on_error=on_error, eos=eos, bos=bos, special_tokens_as_text=special_tokens_as_text,
                  storage_options=storage_options, vocab_size=vocab_size, executor=executor,
                  allow_empty=allow_empty)
    if background:
        from .handle import BuildHandle
        return BuildHandle.start(inputs, output, tokenizer, kwargs)
    return _build(inputs, output, tokenizer, progress=True if progress is None else progress, **kwargs)


def _check_build_arguments(*, text_key, block_tokens, num_workers, on_error, background, executor,
                           eos, bos, special_tokens_as_text, progress, storage_options, vocab_size,
                           allow_empty) -> None:
    """Every argument's type and value, before anything is read or written."""
    if not isinstance(text_key, str) or not text_key:
        raise TypeError(f"text_key must be a non-empty string naming the text field, not {text_key!r}")
    int_arg(block_tokens, "block_tokens", minimum=1)
    if num_workers is not None:
        int_arg(num_workers, "num_workers", minimum=0)
    if vocab_size is not None:
        int_arg(vocab_size, "vocab_size", minimum=1, maximum=2 ** 32)
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', not {on_error!r}")
    if executor not in ("local", "ray"):
        raise ValueError(f"executor must be 'local' or 'ray', not {executor!r}")
    for name, token in (("eos", eos), ("bos", bos)):
        if token is not None and (isinstance(token, bool) or not isinstance(token, (int, np.integer, str))):
            raise TypeError(f"{name} must be a token id (int), a token string, 'auto' or None, "
                            f"not {token!r}")
    for name, flag in (("background", background), ("special_tokens_as_text", special_tokens_as_text),
                       ("allow_empty", allow_empty)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, not {flag!r}")
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be True, False or None, not {progress!r}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options, not {storage_options!r}")


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


def _build(inputs: Any, output: str | os.PathLike, tokenizer: TokenizerLike, *, text_key: str,
           block_tokens: int, num_workers: int | None, on_error: str, eos, bos,
           special_tokens_as_text: bool, storage_options: dict[str, Any] | None,
           vocab_size: int | None = None, executor: str = "local", progress: bool = False,
           allow_empty: bool = False, report: Callable[[dict], None] | None = None,
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
    _check_output_path(storage)
    storage.makedirs()
    lock = _lock(storage)
    try:
        existing = None
        if storage.exists(fmt.MANIFEST_NAME):
            existing = fmt.read_manifest(storage)
            if existing["spec"] != spec and _nothing_committed(existing):
                _start_over(storage)  # a failed first build: start again, new settings
                existing = None
            elif existing["spec"] != spec:
                raise BuildError(
                    f"{storage.url!r} holds a cache built with other settings (differs in: "
                    f"{', '.join(_spec_diff(existing['spec'], spec))}); refusing to mix them. Use a "
                    "new output directory, or delete this one to rebuild")
        if existing is None:
            _check_new_output(storage)
        _clean(storage, existing)
        state = _Manifest(storage, spec, existing, lock)
        if existing is None:
            state.save()  # the manifest first: a tokenizer.json without one is never ours
        if tok is not None and not storage.exists(fmt.TOKENIZER_NAME):
            storage.write(fmt.TOKENIZER_NAME, [tok.to_str().encode()])
        if existing is not None and existing["complete"]:
            return _result(storage, existing, started, 0, allow_empty, already_complete=True)
        job = _Job(storage, None if tok is None else canonical_json(tok), bos_id, eos_id,
                   str(dtype), text_key, block_tokens, on_error, special_tokens_as_text,
                   dict(storage_options or {}), vocab_size)
        todo = [i for i, p in enumerate(state.progress) if not p["done"]]
        bar = _ProgressBar(spec["inputs"], state, enabled=progress)
        try:
            workers = min(len(todo), default_workers() if num_workers is None else num_workers)
            if executor == "ray":
                from .ray_executor import run_ray
                built = run_ray(job, sources, todo, state, bar, report, should_stop, num_workers)
            elif sources is None or workers <= 1 or any(s.process_local for s in sources):
                built = _run_inline(job, sources or [resolved], todo, state, bar, report, should_stop)
            else:
                built = _run_pool(job, sources, todo, state, workers, bar, report, should_stop)
        finally:
            bar.close()
        return _result(storage, state.document(), started, built, allow_empty)
    finally:
        lock.release()


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
        raise ValueError(f"{role}={token!r}: without a tokenizer, give {role} as a token id or None")
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise ValueError(f"{role}={token} is outside the vocabulary (size {vocab_size})")
    return int(token)


def _result(storage: Storage, manifest: dict, started: float, built: int, allow_empty: bool,
            already_complete: bool = False) -> BuildResult:
    if manifest["complete"] and not manifest["num_documents"] and not allow_empty:
        skipped = ", ".join(f"{v} {k}" for k, v in sorted(manifest["skipped"].items()))
        why = f"every record was skipped ({skipped})" if skipped else "the inputs hold no document"
        raise BuildError(f"{storage.url}: the build produced an empty cache: {why}. Check the "
                         "inputs and text_key (or pass allow_empty=True to accept an empty cache)")
    return BuildResult(storage.url, manifest["num_tokens"], manifest["num_documents"],
                       len(manifest["blocks"]), dict(manifest["skipped"]), manifest["fingerprint"],
                       time.perf_counter() - started, built, already_complete)


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
    """Build the inputs `todo` on `workers` worker processes, committing as blocks arrive.

    Inputs are handed out one at a time, in order, to whichever worker is free.
    """
    starts = {i: state.progress[i] for i in todo}
    waiting = list(todo)
    children = [start_child("torchcache.build:_worker_main", job, sources, starts)
                for _ in range(workers)]
    by_conn = {child.conn: child for child in children}

    stopped: set[Child] = set()

    def hand_out(child: Child) -> None:
        if not waiting:
            stopped.add(child)
        child.conn.send(waiting.pop(0) if waiting else None)

    remaining, built = set(todo), 0
    try:
        for child in children:
            hand_out(child)
        while remaining:
            ready = wait_for_connections(list(by_conn), timeout=0.5)
            check_cancelled(should_stop)
            events, finished, died = [], [], None
            for conn in ready:
                child = by_conn[conn]
                try:
                    while conn.poll():
                        events.append(conn.recv())
                        if events[-1][0] == "done":
                            finished.append(child)
                except EOFError:
                    del by_conn[conn]
                    if child not in stopped and not any(e[0] == "error" for e in events):
                        died = child
            built += _commit(events, state, bar, report)  # what arrived before a death is kept
            if died is not None:
                raise BuildError(f"a build worker died (exit code {died.join(5)}) while building "
                                 f"inputs {sorted(remaining)}; committed blocks are kept and a "
                                 "re-run resumes")
            remaining.difference_update(e[1] for e in events if e[0] == "done")
            for child in finished:
                hand_out(child)
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.join()
            child.close()
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
