"""BuildHandle: a build running in the background while training reads its committed prefix."""

from __future__ import annotations

import atexit
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from .._util.procs import Child, start_child
from .engine import BuildResult, run_build
from ..errors import BuildError
from .inputs import resolve_inputs


class BuildHandle:
    """A running background build: `wait()`, `done`, `progress`, `cancel()`, `error`.

    File inputs are built in a separate process (killing it never harms committed data); an
    iterable of strings cannot be sent to another process, so it is built in a thread.

    Example (training can open the cache as soon as a block is committed:
    `tc.TokenDataset(out, seq_len=2048)` reads the committed prefix, and grows):

        >>> import os, tempfile, tokenizers
        >>> tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(  # a toy: one word, one id
        ...     {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}, "<unk>"))
        >>> tmp = tempfile.TemporaryDirectory()
        >>> data = os.path.join(tmp.name, "doc.txt")   # a text file is one document
        >>> with open(data, "w") as f:
        ...     _ = f.write("hello")
        >>> handle = tc.build_cache(data, os.path.join(tmp.name, "cache"), tokenizer,
        ...                         background=True)   # built in another process
        >>> result = handle.wait()   # the BuildResult; re-raises the build's error
        >>> handle.done, result.num_tokens, handle.progress["committed_tokens"]
        (True, 2, 2)
        >>> tmp.cleanup()
    """

    def __init__(self) -> None:
        self._result = None
        self._error: BaseException | None = None
        self._progress: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._child: Child | None = None
        self._conn: Connection | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, inputs: Any, output, tokenizer, kwargs: dict) -> "BuildHandle":
        handle = cls()
        sources = resolve_inputs(inputs, kwargs.get("storage_options"))
        if isinstance(sources, list) and not any(s.process_local for s in sources):
            handle._child = start_child("torchcache.builder.handle:_child_main", inputs, output, tokenizer,
                                        kwargs)
            handle._conn = handle._child.conn
            atexit.register(handle._finish_at_exit)
        else:
            handle._thread = threading.Thread(target=handle._thread_main,
                                              args=(inputs, output, tokenizer, kwargs), daemon=True)
            handle._thread.start()
        return handle

    def _finish_at_exit(self) -> None:
        """A program that ends while its build runs waits for the build, as before it ended."""
        if self._child is not None and self._child.is_alive():
            self._child.join()

    # -- thread mode
    def _thread_main(self, inputs, output, tokenizer, kwargs) -> None:
        try:
            self._result = run_build(inputs, output, tokenizer, report=self._set_progress,
                                  should_stop=self._cancelled.is_set, **kwargs)
        except BaseException as e:  # kept for .error / wait()
            self._error = e

    def _set_progress(self, progress: dict) -> None:
        with self._lock:
            self._progress = dict(progress)

    # -- process mode
    def _poll(self, timeout: float = 0.0) -> None:
        if self._conn is None:
            return
        try:
            while self._conn.poll(timeout):
                kind, payload = self._conn.recv()
                timeout = 0.0
                if kind == "progress":
                    self._set_progress(payload)
                elif kind == "result":
                    self._result = payload
                elif kind == "error":
                    self._error = payload
        except (EOFError, OSError):
            self._conn.close()
            self._conn = None
        if self._conn is None or self._result is not None or self._error is not None:
            self._reap()

    def _reap(self) -> None:
        """Wait for the finished build process (so it leaves no zombie) and explain its end."""
        child = self._child
        if child is None or child.join(timeout=None if self._conn is None else 5) is None:
            return
        atexit.unregister(self._finish_at_exit)
        if self._result is None and self._error is None:
            reason = "it was cancelled" if self._cancelled.is_set() else \
                f"the build process died (exit code {child.exitcode})"
            self._error = BuildError(f"background build stopped: {reason}; committed blocks are "
                                     "kept and re-running the build resumes it")
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @property
    def done(self) -> bool:
        """True once the build has finished, failed or been cancelled."""
        self._poll()
        if self._thread is not None:
            return not self._thread.is_alive()
        return self._result is not None or self._error is not None

    @property
    def progress(self) -> dict[str, Any]:
        """Latest committed counts: blocks, tokens, documents, inputs done, complete."""
        self._poll()
        with self._lock:
            return dict(self._progress)

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the build, or None."""
        self._poll()
        return self._error

    def wait(self, timeout: float | None = None) -> BuildResult:
        """Block until the build ends and return its BuildResult; re-raise its error.

        Raises TimeoutError if it is still running after `timeout` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"build still running after {timeout} s")
            if self._thread is not None:
                self._thread.join(0.2 if left is None else min(left, 0.2))
            else:
                self._poll(0.2 if left is None else min(left, 0.2))
        if self._error is not None:
            raise self._error
        return self._result

    def cancel(self) -> None:
        """Stop the build. Committed blocks stay; running the same build again resumes it."""
        self._cancelled.set()
        if self._child is not None and self._child.is_alive():
            self._child.terminate()
            self._child.join()
        if self._thread is not None:
            self._thread.join()
        self._poll()


def _child_main(conn: Connection, inputs, output, tokenizer, kwargs) -> None:
    """The background build process (see _procs): runs the build, reports progress and outcome."""
    def report(progress: dict) -> None:
        conn.send(("progress", progress))

    try:
        result = run_build(inputs, output, tokenizer, report=report, **kwargs)
        conn.send(("result", result))
    except BaseException as e:
        try:
            conn.send(("error", e))
        except Exception:
            conn.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
    finally:
        conn.close()


