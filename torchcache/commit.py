"""The coordinator's side of a build: the manifest, the lock, and committing worker events.

The token stream is the blocks in round-robin order over inputs (input 0 block 0, input 1
block 0, ..., input 0 block 1, ...): a pure function of the inputs, never of timing or worker
count. A block finished out of that order waits in the manifest's `pending` list (durable, so
never redone), invisible to readers until every block before it in stream order is there. Each
commit rewrites the manifest atomically, so a crash at any point leaves the last commit intact.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any, Callable, Iterable

from . import format as fmt
from .errors import BuildError, InputError
from .storage import TMP_MARK, Lock, Storage
from .worker import BlockWritten, Event, InputDone, Progress, WorkerFailed

# Crash tests set this to kill the builder (SIGKILL, as a crash would) right after its N-th
# manifest write, so a test interrupts a build at a commit instead of racing it with a timer.
_KILL_AFTER_COMMITS = int(os.environ.get("TORCHCACHE_TEST_KILL_AFTER_COMMITS", "0"))

# Names the builder creates: only these are ever deleted, and only when the manifest does not
# know them (left by a crash). Anything else in the output belongs to the user.
_OWN_BLOCK_FILE = re.compile(r"\d{6}-\d{6}(\.offsets\.safetensors|\.keys\.json|\.safetensors)"
                             rf"({re.escape(TMP_MARK)}\d+)?")
_OWN_TOP_TMP = re.compile(rf"(manifest|tokenizer)\.json{re.escape(TMP_MARK)}\d+")


class ManifestState:
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
            if event.kind == "input":
                raise InputError(event.message)
            raise BuildError(f"building input {self.state.spec['inputs'][event.input]['path']} "
                             f"failed: {event.message}")
        raise TypeError(f"unknown build event {event!r}")

    def _save(self) -> None:
        doc = self.state.save()
        if self.report:
            progress = self.state.progress
            self.report({"committed_blocks": len(doc["blocks"]), "committed_tokens": doc["num_tokens"],
                         "committed_documents": doc["num_documents"], "complete": doc["complete"],
                         "inputs_done": sum(p["done"] for p in progress), "inputs": len(progress)})


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
    storage.delete(fmt.TOKENIZER_NAME)
    storage.delete(fmt.MANIFEST_NAME)
