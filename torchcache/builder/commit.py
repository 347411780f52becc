"""The coordinator's side of a build: the manifest, the lock, and committing worker events.

The token stream is the blocks in round-robin order over inputs (input 0 block 0, input 1
block 0, ..., input 0 block 1, ...): a pure function of the inputs, never of timing or worker
count. A block finished out of that order waits in the manifest's `pending` list (durable, so
never redone), invisible to readers until every block before it in stream order is there. Each
commit rewrites the manifest atomically, so a crash at any point leaves the last commit intact.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
from typing import Any, Callable, Iterable

from .._util import hooks
from ..errors import BuildError
from ..format.arrays import arrays_name, read_layout
from ..format import blocks as fmt
from ..format import ledger, provenance
from ..format.storage import TMP_MARK, LocalStorage, Lock, Storage
from .worker import BlockWritten, Event, InputDone, Progress, WorkerFailed, raise_failure

# Names the builder creates: only these are ever deleted, and only when the manifest does not
# know them (left by a crash). Anything else in the output belongs to the user.
_OWN_BLOCK_FILE = re.compile(fmt.BLOCK_FILES.pattern + rf"({re.escape(TMP_MARK)}\d+)?")
_OWN_TOP_TMP = re.compile(rf"(manifest|tokenizer|head)\.json{re.escape(TMP_MARK)}\d+")
_OWN_CHUNK = re.compile(r"\d{6}\.(bin|jsonl)")


# an input's final progress in a complete cache's head: the ledger's fields, and the stamp of
# the file version the build read (see `inputs`), which makes a re-run's no-op check cheap
_FINAL_FIELDS = ledger.PROGRESS_FIELDS + ("stamp",)


class ManifestState:
    """The coordinator's view of the build record; `save()` commits what changed since the last
    save (format v2: appends to the commit log and the block index, then replaces head.json)."""

    def __init__(self, storage: Storage, spec: dict[str, Any], existing: dict[str, Any] | None,
                 lock: Lock | None = None):
        self.storage, self.spec, self.lock = storage, spec, lock
        self.saves = 0
        self.fingerprint = fmt.spec_fingerprint(spec)
        n = len(spec["inputs"])
        self.finished: list[list[dict]] = [[] for _ in range(n)]
        self.progress: list[dict] = [{"records": 0, "skipped": {}, "blocks": 0, "done": False}
                                     for _ in range(n)]
        self.skipped: dict[str, int] = {}
        self.inputs_done = 0
        if existing:
            for entry in existing["blocks"] + existing.get("pending", []):
                self.finished[entry["input"]].append(entry)
            for i, p in enumerate(existing["inputs"]):
                self._set_progress(i, {k: p[k] for k in ("records", "skipped", "blocks", "done")})
                for key in ("digest", "stamp"):
                    if p.get(key) is not None:
                        self.progress[i][key] = p[key]
            for blocks in self.finished:
                blocks.sort(key=lambda e: e["index"])
        self._cursor = fmt.StreamCursor(n)
        visible = self._join_stream()
        self.num_blocks = len(visible)
        self.num_tokens = sum(e["num_tokens"] for e in visible)
        self.num_documents = sum(e["num_documents"] for e in visible)
        head = ledger.empty_head(self.fingerprint) if not existing else ledger.read_head(
            storage, self.fingerprint)
        self.records = head["records"]
        # blocks keep their record runs where needed (format.provenance) if this builder (or one
        # that did) made the cache from its start; an older builder's blocks did not
        self.record_runs = head.get(provenance.HEAD_KEY) is True or not any(self.finished)
        for i, blocks in enumerate(self.finished):  # (a worker's start: see format.provenance)
            self.progress[i]["documents"] = sum(e["num_documents"] for e in blocks) \
                if self.record_runs else None
        self._unsaved: list[dict[str, Any]] = []  # commit log records since the last save
        self._array_reference: tuple[str, dict[str, tuple[str, int]]] | None = None
        chunk = existing["chunk_records"] if existing else ledger.new_chunk_records()
        self._writer = ledger.LedgerWriter(storage, head, chunk)

    def _set_progress(self, index: int, progress: dict) -> None:
        self.inputs_done += bool(progress.get("done")) - self.progress[index]["done"]
        for reason, count in self.progress[index]["skipped"].items():
            self.skipped[reason] -= count
        self.progress[index].update(progress)
        for reason, count in self.progress[index]["skipped"].items():
            self.skipped[reason] = self.skipped.get(reason, 0) + count

    def _join_stream(self) -> list[dict]:
        joined = self._cursor.advance(lambda i: len(self.finished[i]),
                                      lambda i: self.progress[i]["done"])
        return [self.finished[i][r] for i, r in joined]

    @property
    def complete(self) -> bool:
        return self._cursor.complete

    def add_block(self, index: int, entry: dict, progress: dict) -> None:
        if entry["index"] < len(self.finished[index]):
            return  # reported again by a retried task: the same block, already recorded
        self._check_array_layout(index, entry)
        self.finished[index].append(entry)
        self._set_progress(index, progress)  # (with the input's "documents" so far, if counted)
        self._unsaved.append({"input": index, "entry": entry, "progress": progress})

    def _check_array_layout(self, index: int, entry: dict) -> None:
        """BuildError unless the block's array fields have the dtype and rank of the cache's
        first block: each input's worker fixes an undeclared field's from its own first record,
        and a cache holds one dtype and rank per field."""
        if not (self.spec.get("documents") or {}).get("arrays"):
            return
        layout = read_layout(self.storage, arrays_name(entry["path"]))
        if self._array_reference is None:
            first = next((blocks[0] for blocks in self.finished if blocks), entry)
            self._array_reference = (first["path"], layout if first is entry else
                                     read_layout(self.storage, arrays_name(first["path"])))
        first_path, reference = self._array_reference
        for name, (dtype, rank) in sorted(layout.items()):
            want = reference.get(name)
            if want is not None and want != (dtype, rank):
                raise BuildError(
                    f"array field {name!r} is {dtype} of rank {rank} in {entry['path']} (from "
                    f"{self.spec['inputs'][index]['path']}), but {want[0]} of rank {want[1]} "
                    f"in {first_path}: an undeclared field takes the dtype and rank of each input's "
                    f"first record, and a cache holds one per field. Declare it, e.g. "
                    f"arrays={{{name!r}: '{want[0]}[{', '.join('*' * want[1])}]'}}, and build "
                    "into a new directory")

    def finish_input(self, index: int, progress: dict) -> None:
        self._set_progress(index, dict(progress, done=True))
        self._unsaved.append({"input": index, "done": True, "progress": progress})

    def summary(self) -> dict[str, Any]:
        """What the last save committed: counts, completeness, skips, fingerprint."""
        return {"num_blocks": self.num_blocks, "num_tokens": self.num_tokens,
                "num_documents": self.num_documents, "complete": self.complete,
                "skipped": {k: v for k, v in self.skipped.items() if v},
                "fingerprint": self.fingerprint,
                "inputs_done": self.inputs_done, "inputs": len(self.progress)}

    def save(self) -> dict[str, Any]:
        """Commit, unless this builder may have lost its lock; O(what changed), not O(cache)."""
        if self.lock is not None:
            try:
                self.lock.check()
            except RuntimeError as e:
                raise BuildError(str(e)) from None
        visible = self._join_stream()
        self.num_blocks += len(visible)
        self.num_tokens += sum(e["num_tokens"] for e in visible)
        self.num_documents += sum(e["num_documents"] for e in visible)
        summary = self.summary()
        head = dict(ledger.empty_head(self.fingerprint), blocks=self.num_blocks,
                    num_tokens=self.num_tokens, num_documents=self.num_documents,
                    complete=self.complete, skipped=summary["skipped"])
        if self.record_runs and (not self.complete or any(
                p["records"] != p["documents"] for p in self.progress)):
            head[provenance.HEAD_KEY] = True  # (a complete cache without gaps: derivable anyway)
        if self.complete:  # the last commit: the head keeps each input's final progress instead
            head.update(records=0, inputs=[{k: p[k] for k in _FINAL_FIELDS if k in p}
                                           for p in self.progress])
            self._writer.finish(visible, head)
            remove_empty_log_dir(self.storage)
        else:
            self.records += len(self._unsaved)
            head.update(records=self.records)
            self._writer.commit(self._unsaved, visible, head)
        self._unsaved = []
        self.saves += 1
        if self.saves == hooks.kill_after_commits:  # a crash test's kill -9, right here
            os.kill(os.getpid(), signal.SIGKILL)
        return summary


class Committer:
    """The commit step every executor calls with the events its workers reported, in order.

    Applies them to the manifest and saves it once per call (also when one of them is an
    error: what was finished before it is kept), then reports the committed counts.
    """

    def __init__(self, state: ManifestState, on_progress: Callable[[int, int, int], None],
                 report: Callable[[dict], None] | None = None):
        self.state, self.on_progress, self.report = state, on_progress, report

    def commit(self, events: Iterable[Event]) -> int:
        """Commit `events`; return the tokens they report as made."""
        built, changed = 0, False
        try:
            for event in events:
                changed |= self._apply(event)
                if isinstance(event, Progress):
                    built += event.tokens
        finally:
            if changed:
                self._save()
        return built

    def _apply(self, event: Event) -> bool:
        """Apply one event; True when the manifest changed and must be saved."""
        if isinstance(event, BlockWritten):
            self.state.add_block(event.input, event.entry, event.progress)
            return True
        if isinstance(event, InputDone):
            self.state.finish_input(event.input, event.progress)
            return True
        if isinstance(event, Progress):
            self.on_progress(event.input, event.position, event.tokens)
            return False
        if isinstance(event, WorkerFailed):
            raise_failure(event, self.state.spec["inputs"][event.input]["path"])
        raise TypeError(f"unknown build event {event!r}")

    def _save(self) -> None:
        summary = self.state.save()
        if self.report:
            self.report({"committed_blocks": summary["num_blocks"],
                         "committed_tokens": summary["num_tokens"],
                         "committed_documents": summary["num_documents"],
                         "complete": summary["complete"], "inputs_done": summary["inputs_done"],
                         "inputs": summary["inputs"]})


# ---------------------------------------------------------------- the output directory

def acquire_lock(storage: Storage) -> Lock:
    """The output's writer lock (a lease on object stores); BuildError when another holds it."""
    lock = storage.lock()
    try:
        lock.acquire()
    except RuntimeError:
        raise BuildError(f"another builder is writing {storage.url!r} right now; wait for it to "
                         "finish (or stop it) before building there") from None
    return lock


def clean_leftovers(storage: Storage, manifest: dict[str, Any] | None) -> None:
    """Delete the builder's own leftovers of a crash: temporary files of writers that are gone,
    and block files that the manifest does not know. Files the builder did not create are never
    touched."""
    known = set()
    if manifest:
        for e in manifest["blocks"] + manifest.get("pending", []):
            known.update((e["path"], e["offsets"], e.get("keys"), e.get("docs")))
            if e.get("docs"):  # (an arrays sidecar, if the cache has arrays, is named by its block)
                known.add(arrays_name(e["path"]))
    fmt.remove_dead_temp_files(storage, "", fmt.TOP_FILES)
    fmt.remove_dead_temp_files(storage, fmt.BLOCK_DIR, _OWN_BLOCK_FILE)
    for name in storage.listdir(fmt.BLOCK_DIR):
        rel = f"{fmt.BLOCK_DIR}/{name}"
        if TMP_MARK not in name and _OWN_BLOCK_FILE.fullmatch(name) and rel not in known:
            storage.delete(rel)
    if manifest and manifest["complete"] and manifest.get("version", 1) >= 2:
        ledger.delete_log(storage)  # left by a crash right after the last commit
        remove_empty_log_dir(storage)


def remove_empty_log_dir(storage: Storage) -> None:
    """A complete cache has no commit log: its emptied folder goes too (object stores have no
    folders). A folder the user put files in is left alone."""
    if not isinstance(storage, LocalStorage):
        return
    folder = os.path.join(storage.root, ledger.LOG_DIR)
    if os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)


def damaged_pending(storage: Storage, manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished blocks that wait, not yet committed to the stream (`pending`), whose files
    are missing or differ from the checksums the commit log recorded for them."""
    return [e for e in manifest.get("pending", []) if not _block_files_match(storage, e)]


def _block_files_match(storage: Storage, entry: dict[str, Any]) -> bool:
    for name, checksum in (("path", "checksum"), ("offsets", "offsets_checksum"),
                           ("keys", "keys_checksum"), ("docs", "docs_checksum")):
        if entry.get(name) is None:
            continue
        try:
            data = storage.read(entry[name])
        except FileNotFoundError:
            return False
        if "sha256:" + hashlib.sha256(data).hexdigest() != entry[checksum]:
            return False
    return True


def block_starts(storage: Storage, manifest: dict[str, Any],
                 blocks: set[tuple[int, int]]) -> dict[tuple[int, int], dict[str, Any]]:
    """Where each (input, block) of `blocks` starts in its input: the input's progress as of its
    block before, from the commit log (absent for a block whose log record has no progress,
    as in a cache upgraded from format v1)."""
    starts = {(i, k): {"records": 0, "skipped": {}, "blocks": 0, "documents": 0}
              for i, k in blocks if k == 0}
    head = ledger.read_head(storage, manifest["fingerprint"])
    keep = provenance.keeps_runs(head)  # (else no block keeps runs: none made again may)
    if not keep:
        for start in starts.values():
            start["documents"] = None
    documents: dict[int, int] = {}  # each input's documents so far (its blocks come in order)
    for record in ledger.read_log(storage, head["records"], manifest["chunk_records"]):
        entry = record.get("entry")
        if entry is None:
            continue
        documents[record["input"]] = documents.get(record["input"], 0) + entry["num_documents"]
        if "progress" not in record:
            continue
        key = (record["input"], entry["index"] + 1)
        if key in blocks:
            starts[key] = dict(record["progress"], blocks=key[1],
                               documents=documents[record["input"]] if keep else None)
    return starts


def check_new_output(storage: Storage) -> None:
    """Refuse an output without a manifest that holds anything but the builder's own leftovers."""
    strangers = [n for n in storage.listdir("")
                 if n not in (".lock", fmt.BLOCK_DIR) and not _OWN_TOP_TMP.fullmatch(n)]
    strangers += [f"{fmt.BLOCK_DIR}/{n}" for n in storage.listdir(fmt.BLOCK_DIR)
                  if TMP_MARK not in n or not _OWN_BLOCK_FILE.fullmatch(n)]
    if strangers:
        raise BuildError(f"output {storage.url!r} is not empty and is not a torchcache cache "
                         f"(it holds {', '.join(strangers[:5])}); nothing was changed. Choose a new "
                         "or empty directory")


def open_existing(storage: Storage, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of an earlier build of the same spec to resume, or None to start afresh.

    A first build that committed nothing is removed, whatever its settings; a cache built with
    other settings is refused. The builder's leftovers of a crash are cleaned up either way.
    """
    existing = None
    if storage.exists(fmt.MANIFEST_NAME):
        existing = ledger.read_manifest(storage)
        if existing["version"] == 1 and not existing["complete"] and existing["spec"] == spec:
            ledger.upgrade(storage)  # resume in format v2 (crash-safe; a complete v1 cache is kept)
            existing = ledger.read_manifest(storage)
        if existing["spec"] != spec and _nothing_committed(existing):
            _start_over(storage)  # a failed first build: start again, new settings
            existing = None
        elif existing["spec"] != spec:
            raise BuildError(
                f"{storage.url!r} holds a cache built with other settings (differs in: "
                f"{', '.join(_spec_diff(existing['spec'], spec))}); refusing to mix them. Use a "
                "new output directory, or delete this one to rebuild")
    if existing is None:
        check_new_output(storage)
    clean_leftovers(storage, existing)
    return existing


def _spec_diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _nothing_committed(manifest: dict[str, Any]) -> bool:
    return not manifest["blocks"] and not manifest.get("pending")


def _start_over(storage: Storage) -> None:
    """Remove a cache that committed nothing (a first build that failed), manifest last."""
    clean_leftovers(storage, None)
    for name in fmt.TOKENIZER_NAMES:  # tokenizer.json, or a tiktoken or SentencePiece file
        storage.delete(name)
    for folder in (ledger.INDEX_DIR, ledger.LOG_DIR):
        for name in storage.listdir(folder):
            if _OWN_CHUNK.fullmatch(name):
                storage.delete(f"{folder}/{name}")
    storage.delete(ledger.HEAD_NAME)  # after the chunks: no head with chunks reads as a lost head
    storage.delete(fmt.MANIFEST_NAME)


def output_names(storage: Storage) -> set[str] | None:
    """The names at the top of a build's output before the build touches it; None where a local
    output folder does not exist yet (an object store has no folders: always a set)."""
    if isinstance(storage, LocalStorage) and not os.path.isdir(storage.root):
        return None
    return set(storage.listdir(""))


def undo_failed_first_build(storage: Storage, lock: Lock, before: set[str] | None,
                            refused: bool = False) -> bool:
    """Remove what a first build that failed created, so that nothing that looks like a cache
    is left (`info` would call an empty skeleton complete): the builder's own files, its
    emptied folders, its lock file and, if the build created it, the output folder. That is
    when it committed no block, or when it completed and its result was `refused` (no
    document, no trained token). A build that committed blocks and stopped keeps them (a
    re-run resumes); a user's files are never touched. Call while holding `lock`; False when
    nothing was removed (the lock may be lost: another builder's files are not ours to delete)."""
    try:
        lock.check()
    except RuntimeError:
        return False
    if storage.exists(fmt.MANIFEST_NAME):
        manifest = ledger.read_manifest(storage)
        if not _nothing_committed(manifest) and not (refused and manifest["complete"]):
            return False
        _start_over(storage)
    # (no manifest: the output was refused before the build wrote anything but its lock; block
    # files there, even with the builder's names, may be the user's)
    if not isinstance(storage, LocalStorage):
        return True  # an object store has no folders; the lease goes when the lock is released
    for folder in (fmt.BLOCK_DIR, ledger.INDEX_DIR, ledger.LOG_DIR):
        path = os.path.join(storage.root, folder)
        if folder not in (before or ()) and os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)
    if ".lock" not in (before or ()):
        storage.delete(".lock")  # still held (flock on the open file) until released
    return True


def remove_created_folder(storage: Storage, before: set[str] | None) -> None:
    """After `undo_failed_first_build`: the output folder too, if the build created it and it is
    empty (a folder the user made, or one holding anything, stays)."""
    root = getattr(storage, "root", None)
    if before is None and isinstance(storage, LocalStorage) and os.path.isdir(root) \
            and not os.listdir(root):
        os.rmdir(root)
