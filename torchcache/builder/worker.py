"""The per-input work of a build: tokenize one input into blocks, reporting typed events.

This is the one work function every executor runs (inline, in a process pool, or as Ray tasks).
It writes each block durably before reporting it; the coordinator (`commit`) decides when a
block becomes visible. It never touches the manifest.
"""

from __future__ import annotations

import pickle
import traceback
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Union

import numpy as np

from ..format import blocks as fmt
from ..errors import BuildError, InputError
from .inputs import iter_records, iter_strings
from .records import BadRecord, InputSource, Record, raise_or_count
from ..format.storage import Storage
from .tokenizing import DocumentEncoder
from .chat import mask_runs
from .formats import RecordShaper
from .functions import unpack_function
from ..format.arrays import arrays_name, write_arrays_file
from ..format.tokenizer_backends import TokenizerBackend
from ..format.tokenizer_kinds import backend_from_files
from .arrays import pad_token_rows
from .background_writes import BackgroundWrites, PendingWrite
from ..format.documents import write_docs_file
from ..format.provenance import RUNS_TENSOR, needs_runs, runs_of

_BATCH_CHARS = 4 << 20
_BATCH_DOCS = 1024


@dataclass(frozen=True)
class BuildJob:
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
    documents: dict | None = None  # the spec's "documents" (format v3), None for plain text
    pipeline: tuple = ()  # a pipeline's steps: ("filter" | "map", packed function), in order
    template_name: str | None = None  # where the chat template came from, for messages
    #: a tiktoken or SentencePiece tokenizer: (kind, its files), rebuilt in each worker (then
    #: tokenizer_json is None); format.tokenizer_backends
    tokenizer_files: tuple | None = None
    #: the most bytes of arrays a block holds (None: no limit, a cache built before the limit)
    block_array_bytes: int | None = None

    @property
    def has_tokenizer(self) -> bool:
        """False when the inputs hold token ids already."""
        return self.tokenizer_json is not None or self.tokenizer_files is not None

    @property
    def reads_whole_records(self) -> bool:
        """Records are read whole (format v3, a pipeline's functions), not as one text field."""
        return self.documents is not None or bool(self.pipeline)

    @classmethod
    def for_spec(cls, output: Storage, spec: dict[str, Any], tokenizer_json: str | Any | None,
                 on_error: str, storage_options: dict[str, Any] | None,
                 template_name: str | None = None, pipeline: tuple = ()) -> "BuildJob":
        """The job that makes the blocks of the cache `spec` describes (a new build's spec, or
        the one a cache's manifest records, for repair), with the tokenizer `tokenizer_json` (a
        Hugging Face tokenizer's JSON, or a tiktoken or SentencePiece backend)."""
        files = None
        if isinstance(tokenizer_json, TokenizerBackend):
            tokenizer_json, files = None, tokenizer_json.payload()
        return cls(output, tokenizer_json, spec["bos_id"], spec["eos_id"],
                   str(fmt.DTYPES[spec["dtype"]]), spec["text_key"], spec["block_tokens"], on_error,
                   spec["special_tokens_as_text"], dict(storage_options or {}), spec["vocab_size"],
                   documents=spec.get("documents"), template_name=template_name,
                   pipeline=tuple(pipeline), tokenizer_files=files,
                   block_array_bytes=spec.get("block_array_bytes"))


# ---------------------------------------------------------------- events a worker reports

@dataclass(frozen=True)
class BlockWritten:
    """A block is on disk. `progress` is the input's resume point as of the end of the block
    (records consumed, skip counts, blocks, digest)."""

    input: int
    entry: dict[str, Any]
    progress: dict[str, Any]


@dataclass(frozen=True)
class Progress:
    """Bytes of the input read so far, and the tokens made since the last report."""

    input: int
    position: int
    tokens: int


@dataclass(frozen=True)
class InputDone:
    """The input is fully built; `progress` is its final resume point."""

    input: int
    progress: dict[str, Any]


@dataclass(frozen=True)
class WorkerFailed:
    """Building the input failed. `kind`: "input" (a bad record: an InputError), "os" (an I/O
    error, one line) or "crash" (a bug, with its traceback). `error` is the exception itself
    and `cause` its cause, when they survive pickling, so that the coordinator raises the same
    exception an inline build would (None: only `message` made it)."""

    input: int
    kind: str
    message: str
    error: BaseException | None = None
    cause: BaseException | None = None


class WorkerTraceback(Exception):
    """Where a worker process raised: the traceback, as text, chained under the error."""


def worker_failed(index: int, error: Exception) -> WorkerFailed:
    """The event that reports `error`, raised while building input `index` in a worker."""
    cause: BaseException | None = error.__cause__
    if isinstance(error, InputError):
        kind, message = "input", str(error)
    elif isinstance(error, OSError):  # a full disk, a lost connection...: one line, no traceback
        kind, message = "os", f"{type(error).__name__}: {error}"
    else:  # a bug: reported with its traceback
        cause = WorkerTraceback(traceback.format_exc())
        kind, message = "crash", f"{type(error).__name__}: {error}\n{cause}"
    return WorkerFailed(index, kind, message, _portable(error), _portable(cause))


def _portable(error: BaseException | None) -> BaseException | None:
    """`error` if it comes back from pickling as the same type with the same message, else None
    (some libraries' exceptions cannot be rebuilt from their pickle; their message still is)."""
    if error is None:
        return None
    try:
        again = pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure to round-trip: the message stands in for it
        return None
    return again if type(again) is type(error) and str(again) == str(error) else None


def raise_failure(event: WorkerFailed, input_path: str) -> None:
    """Raise what the worker raised (its own type and message, chained to its cause), as an
    inline build would have; an error that could not travel becomes an InputError or a
    BuildError carrying its message."""
    if event.error is not None:
        raise event.error from event.cause
    if event.kind == "input":
        raise InputError(event.message)
    raise BuildError(f"building input {input_path} failed: {event.message}")


Event = Union[BlockWritten, Progress, InputDone, WorkerFailed]


# ---------------------------------------------------------------- the work function

def build_input(job: BuildJob, index: int, source: InputSource | Iterable[str],
                start: dict[str, Any], writes: BackgroundWrites | None = None) -> Iterator[Any]:
    """Tokenize input `index` from its resume point `start`; yield its events in order. With
    `writes`, blocks are written in its thread and their events are `PendingWrite`s: pass the
    events through `writes.in_order`."""
    encode = _document_encoder(job)
    skipped = dict(start["skipped"])
    records = start["records"]
    block_no = start["blocks"]
    digest = start.get("digest")  # None for caches built before inputs were identified by content
    whole = job.reads_whole_records
    if isinstance(source, InputSource):
        stream = iter_records(source, None if whole else job.text_key, records, job.on_error,
                              job.storage_options, tokens=not job.has_tokenizer and not whole,
                              start_digest=digest)
    else:
        stream = iter_strings(source, records, job.on_error, start_digest=digest,
                              output=job.output.url, objects=whole)
    # the input's documents before the resume point, to know which blocks must keep their
    # records (format.provenance; None: a cache an older builder started, which kept none)
    documents = start.get("documents", 0)
    block = _BlockBuilder(job, index, documents)
    # the input's resume point as of the last document: record number, skip counts, content hash
    last: tuple[int, dict[str, int], str | None] = (records, dict(skipped), digest)

    def flush() -> BlockWritten | PendingWrite:
        nonlocal block_no
        write = block.take(block_no)
        block_no += 1
        upto, counts, upto_digest = last
        progress = {"records": upto, "skipped": dict(counts), "blocks": block_no, "digest": upto_digest}
        if block.documents_before is not None:  # the input's documents so far (format.provenance)
            progress["documents"] = block.documents_before
        if writes is None:
            return BlockWritten(index, write(), progress)
        return writes.submit(write, lambda entry: BlockWritten(index, entry, progress))

    where = _where(source)
    batches = _Batches(stream, skipped, _record_check(job, where), job.on_error, _shaper(job), where)
    for batch in batches:
        encoded = encode(batch)
        for (record, counts, shaped), doc in zip(batch, encoded):
            if block.would_overflow(doc, shaped):
                yield flush()
            block.add(doc, record, shaped)
            last = (record.number, counts, record.digest)
            if block.is_full():
                yield flush()
        yield Progress(index, batch[-1][0].position, int(sum(len(d.ids) for d in encoded)))
    if block.tokens or block.docs:
        yield flush()
    end = (batches.last_number, batches.last_digest) if batches.last_number > records else (records, digest)
    done = {"records": end[0], "skipped": skipped, "blocks": block_no, "digest": end[1]}
    if isinstance(source, InputSource) and source.stamp is not None:  # the version it read
        done["stamp"] = source.stamp
    yield InputDone(index, done)


@dataclass
class _Encoded:
    """A document's ids, and which of them are trained (None: the cache keeps no mask)."""

    ids: np.ndarray
    trained: np.ndarray | None = None


class _BlockBuilder:
    """The documents of the block being filled, and how to write it."""

    def __init__(self, job: BuildJob, index: int, documents_before: int | None = 0):
        self.job, self.index = job, index
        self.masked = bool(job.documents and job.documents["loss_mask"])
        self.per_token = {name for name, d in ((job.documents or {}).get("arrays") or {}).items()
                          if d.get("per_token")}
        self.documents_before = documents_before  # the input's documents in earlier blocks
        self._reset()

    def _reset(self) -> None:
        self.docs: list[np.ndarray] = []
        self.trained: list[np.ndarray] = []
        self.keys: list[str | None] = []
        self.records: list[int] = []
        self.fields: list[bytes] = []
        self.arrays: dict[str, list[np.ndarray]] = {name: [] for name in
                                                    ((self.job.documents or {}).get("arrays") or {})}
        self.tokens = 0
        self.array_bytes = 0

    def would_overflow(self, doc: _Encoded, shaped: Any) -> bool:
        """Whether the document would take the block past block_tokens, or its arrays past
        block_array_bytes (never for a block's first document: a large one gets a block alone)."""
        if self.tokens and self.tokens + len(doc.ids) > self.job.block_tokens:
            return True
        limit = self.job.block_array_bytes
        if not self.docs or not self.arrays or limit is None:
            return False
        return self.array_bytes + sum(shaped.arrays[name].nbytes for name in self.arrays) > limit

    def is_full(self) -> bool:
        """Whether the block holds block_tokens tokens, or block_array_bytes bytes of arrays."""
        limit = self.job.block_array_bytes
        return self.tokens >= self.job.block_tokens or (limit is not None and self.array_bytes >= limit)

    def add(self, doc: _Encoded, record: Record, shaped: Any) -> None:
        self.docs.append(doc.ids)
        self.tokens += len(doc.ids)
        self.keys.append(record.key)
        self.records.append(record.number - 1)  # 0-based (numbers are 1-based lines)
        if self.job.documents is not None:
            self.fields.append(shaped.fields if shaped.fields is not None else b"{}")
            for name, values in self.arrays.items():
                array = shaped.arrays[name]
                if name in self.per_token:  # the BOS/EOS added around the record's ids get 0
                    before = int(self.job.bos_id is not None)
                    array = pad_token_rows(array, before, len(doc.ids) - len(array) - before)
                values.append(array)
                self.array_bytes += array.nbytes
            if self.masked:
                self.trained.append(doc.trained)

    def take(self, block_no: int) -> Callable[[], dict[str, Any]]:
        """Hand over the block's documents (this builder starts the next block): a function that
        writes the block's files and returns its index entry, to call here or in another thread."""
        runs = None  # v3 keeps every record in its documents sidecar; text: runs where needed
        if self.job.documents is None and needs_runs(self.records, self.documents_before):
            runs = runs_of(self.records)
        if self.documents_before is not None:
            self.documents_before += len(self.docs)
        job, index, docs, keys, records = self.job, self.index, self.docs, self.keys, self.records
        trained, fields, arrays = self.trained, self.fields, self.arrays
        self._reset()

        def write() -> dict[str, Any]:
            # v3 keeps the sample keys in the documents sidecar (under its checksum), not a keys file
            entry = _write_block(job, index, block_no, docs, keys if job.documents is None else [], runs)
            if job.documents is not None:
                mask = mask_runs(np.concatenate(trained)) if self.masked else None
                kept = fields if job.documents["keep_fields"] else None
                arrays_checksum = None
                if arrays:  # before the documents sidecar, which holds its checksum
                    arrays_checksum = write_arrays_file(job.output, arrays_name(entry["path"]),
                                                        arrays).checksum
                written = write_docs_file(job.output, fmt.docs_name(entry["path"]), records, mask,
                                          kept, entry["num_tokens"], arrays_checksum, keys)
                entry.update(docs=written.path, docs_checksum=written.checksum)
            return entry
        return write


def _shaper(job: BuildJob) -> Callable[[Record], Any] | None:
    """For a v3 build or a pipeline: record -> Shaped document (BadRecord when it cannot be one;
    reason "filtered" for a record a pipeline's filter leaves out)."""
    if not job.reads_whole_records:
        return None
    shape = RecordShaper(job.documents, job.text_key, job.template_name)
    steps = [(kind, unpack_function(packed)) for kind, packed in job.pipeline]
    if not steps:
        return lambda record: shape(record.obj)
    return lambda record: shape(run_steps(steps, record.obj))


def run_steps(steps: list[tuple[str, Callable[[Any], Any]]], record: Any) -> Any:
    """A record through a pipeline's filter and map steps (BadRecord "filtered" when a filter
    leaves it out, "map_error" when a step raises or a map returns something else than a dict)."""
    for kind, fn in steps:
        try:
            result = fn(record)
        except Exception as error:  # noqa: BLE001 - the user's function: its error names the record
            bad = BadRecord("map_error", f"the {kind} step {fn.__qualname__} raised "
                                         f"{type(error).__name__}: {error}")
            bad.__cause__ = error
            raise bad from error
        if kind == "filter":
            if not result:
                raise BadRecord("filtered", "left out by the pipeline's filter")
        elif not isinstance(result, dict):
            raise BadRecord("map_error", f"the map step {fn.__qualname__} returned a "
                                         f"{type(result).__name__}, not a record (a dict)")
        else:
            record = result
    return record


_ENCODERS: dict[int, DocumentEncoder] = {}  # id(job) -> its encoder, while the job lives


def _encoder_of(job: BuildJob, dtype: np.dtype) -> DocumentEncoder:
    """The job's DocumentEncoder, made once per job in this process rather than once per input:
    making one parses the tokenizer's JSON several times (tenths of a second per input). It
    holds no state of an input; it goes with the job."""
    encoder = _ENCODERS.get(id(job))
    if encoder is None:
        tokenizer = job.tokenizer_json if job.tokenizer_files is None else \
            backend_from_files(*job.tokenizer_files)
        encoder = DocumentEncoder(tokenizer, bos_id=job.bos_id, eos_id=job.eos_id,
                                  dtype=dtype, special_tokens_as_text=job.special_tokens_as_text)
        _ENCODERS[id(job)] = encoder
        weakref.finalize(job, _ENCODERS.pop, id(job), None)
    return encoder


def _document_encoder(job: BuildJob) -> Callable[[list[tuple[Record, Any, Any]]], list[_Encoded]]:
    """A batch of (record, counts, shaped) -> encoded documents: the tokenizer for text (with
    each token's trained flag, from its characters, for chat and instruction records), BOS/EOS
    added to pre-tokenized ids. BOS is never trained; EOS is when the document's last token is."""
    head = [] if job.bos_id is None else [job.bos_id]
    tail = [] if job.eos_id is None else [job.eos_id]
    dtype = np.dtype(job.dtype)

    def wrap(ids: Any, trained: np.ndarray | None) -> _Encoded:
        out = np.concatenate([np.asarray(head, dtype=dtype), np.asarray(ids).astype(dtype),
                              np.asarray(tail, dtype=dtype)])
        if trained is None:
            return _Encoded(out)
        last = bool(trained[-1]) if len(trained) else False
        flags = np.concatenate([np.zeros(len(head), bool), trained, np.full(len(tail), last)])
        return _Encoded(out, flags)

    if not job.has_tokenizer:
        return lambda batch: [wrap(r.tokens if s is None else s.ids, None if s is None else s.trained)
                              for r, _, s in batch]
    encoder = _encoder_of(job, dtype)

    def encode(batch: list[tuple[Record, Any, Any]]) -> list[_Encoded]:
        shaped = [s for _, _, s in batch]
        if all(s is None or (s.text is not None and s.spans is None) for s in shaped):
            texts = [r.text if s is None else s.text for r, _, s in batch]
            return [_Encoded(ids) for ids in encoder.encode(texts)]
        spanned = [s for s in shaped if s.text is not None]
        encoded = iter(encoder.encode_trained([s.text for s in spanned], [s.spans for s in spanned]))
        out = []
        for s in shaped:
            if s.text is None:  # pre-tokenized
                out.append(wrap(s.ids, s.trained))
            else:
                out.append(wrap(*next(encoded)))
        return out
    return encode


def _where(source: InputSource | Iterable[str]) -> Callable[[Record], str]:
    """Where a record is, for messages: its tar and sample key, file:line, or the item."""
    if not isinstance(source, InputSource):
        return lambda record: f"inputs item {record.number}"
    path = source.path
    return lambda record: (f"{path}:{record.number}" if record.key is None  # file:line
                           else f"{path}: sample {record.key!r}")


def _record_check(job: BuildJob,
                  where: Callable[[Record], str]) -> Callable[[Record, Any], tuple[str, BadRecord] | None]:
    """(where, why) if a record's pre-tokenized ids fall outside the vocabulary, else None."""
    limit = job.vocab_size if job.vocab_size is not None else np.iinfo(np.dtype(job.dtype)).max + 1

    def check(record: Record, shaped: Any) -> tuple[str, BadRecord] | None:
        ids = record.tokens if shaped is None else shaped.ids
        if ids is None or not len(ids):
            return None
        low, high = int(ids.min()), int(ids.max())
        if low >= 0 and high < limit:
            return None
        bad = low if low < 0 else high
        return (where(record), BadRecord("bad_tokens", f"token id {bad} is outside the vocabulary "
                                               f"[0, {limit}); pass the right vocab_size"))
    return check


class _Batches:
    """Groups non-empty documents into batches and counts skipped and empty records.

    Each document comes with a snapshot of the skip counts as of its record, so a block can
    record the input's exact resume point, and (v3) with what `shape` made of its record.
    """

    def __init__(self, stream: Iterator[Record], skipped: dict[str, int],
                 check: Callable[[Record, Any], tuple[str, BadRecord] | None], on_error: str = "raise",
                 shape: Callable[[Record], Any] | None = None,
                 where: Callable[[Record], str] = lambda record: str(record.number)):
        self.stream, self.skipped = stream, skipped
        self.last_number, self.last_digest = 0, None  # of the last record read, kept or not
        self.check, self.on_error, self.shape, self.where = check, on_error, shape, where

    def _count(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _content(self, record: Record) -> tuple[Any, Any]:
        """(shaped document or None, its text or ids); raises BadRecord."""
        if self.shape is None or record.obj is None:
            return None, record.text if record.tokens is None else record.tokens
        shaped = self.shape(record)
        return shaped, shaped.text if shaped.text is not None else shaped.ids

    def __iter__(self) -> Iterator[list[tuple[Record, dict[str, int], Any]]]:
        batch, chars = [], 0
        try:
            for record in self.stream:
                self.last_number, self.last_digest = record.number, record.digest
                if record.problem is not None:
                    self._count(record.problem)
                    continue
                try:
                    shaped, content = self._content(record)
                except BadRecord as bad:  # (a record a filter leaves out is counted, never an error)
                    self._count(bad.reason if bad.reason == "filtered" else
                                raise_or_count(self.where(record), bad, self.on_error))
                    continue
                if not len(content):
                    self._count("empty")
                    continue
                problem = self.check(record, shaped)
                if problem is not None:
                    self._count(raise_or_count(*problem, self.on_error))
                    continue
                if record.obj is not None:  # shaped: the raw record (a tar sample's audio) goes
                    record = replace(record, obj=None)
                batch.append((record, dict(self.skipped), shaped))
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


def _write_block(job: BuildJob, index: int, block_no: int, docs: list[np.ndarray],
                 keys: list[str | None], record_runs: np.ndarray | None = None) -> dict[str, Any]:
    tokens = np.concatenate(docs).astype(job.dtype, copy=False)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    path = fmt.block_name(index, block_no)
    meta = {"format": fmt.FORMAT_NAME, "version": fmt.BLOCK_FILE_VERSION}
    block = fmt.write_tensor_file(job.output, path, "tokens", tokens, meta)
    sidecar = {"offsets": offsets} if record_runs is None else {"offsets": offsets,
                                                                  RUNS_TENSOR: record_runs}
    side = fmt.write_tensors_file(job.output, fmt.offsets_name(path), sidecar, meta)
    entry = {"path": block.path, "checksum": block.checksum, "size": block.size,
             "offsets": side.path, "offsets_checksum": side.checksum,
             "num_tokens": int(len(tokens)), "num_documents": len(docs),
             "input": index, "index": block_no}
    if any(k is not None for k in keys):
        written = fmt.write_keys_file(job.output, fmt.keys_name(path), keys)
        entry.update(keys=written.path, keys_checksum=written.checksum)
    return entry
