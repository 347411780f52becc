"""Writing a build's blocks in a background thread, while the next block is being made.

Writing a block (contiguous copies of its arrays, checksums, the writes and their fsync) costs
as much as making it for some inputs: a speech build's arrays sidecar is tens of MB. Those steps
release the GIL, so one thread writes block k while the caller reads, maps and tokenizes the
records of block k + 1, or of the next input. The executor still sees every event in order, and
a block's event only once its files are durable (`in_order`): a block is committed exactly as
if it had been written in place.

At most one write is in flight (`submit` waits for the previous one): memory holds at most the
block being written and the block being filled.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Callable, Iterable, Iterator


class PendingWrite:
    """An event whose write is still running: `in_order` puts `then(result)` in its place."""

    def __init__(self, future: Future, then: Callable[[Any], Any]):
        self.future, self.then = future, then

    def result(self) -> Any:
        """The event, once the write is done (its error, if it failed)."""
        return self.then(self.future.result())


class BackgroundWrites:
    """One writer thread for a build's blocks; a context manager that waits for the last write."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchcache-block-writer")
        self._last: Future | None = None

    def submit(self, write: Callable[[], Any], then: Callable[[Any], Any]) -> PendingWrite:
        """Run `write()` in the writer thread once the previous write is done; the event to
        report is `then(write())`."""
        if self._last is not None:
            wait([self._last])
        self._last = self._pool.submit(write)
        return PendingWrite(self._last, then)

    def in_order(self, events: Iterable[Any]) -> Iterator[list[Any]]:
        """`events` in order, as lists of those ready (possibly empty) after each one made: a
        pending write and whatever follows it wait until it is done. When `events` raises, the
        writes that finished are reported before the error."""
        queue: deque = deque()
        try:
            for event in events:
                queue.append(event)
                yield _ready(queue, block=False)
        except Exception as error:
            written = _written_before(queue, error)
            if written:
                yield written
            raise
        yield _ready(queue, block=True)

    def close(self) -> None:
        """Wait for the write in flight (its error is raised by `in_order`, not here)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "BackgroundWrites":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _ready(queue: deque, block: bool) -> list[Any]:
    out = []
    while queue:
        head = queue[0]
        if isinstance(head, PendingWrite):
            if not block and not head.future.done():
                break
            head = head.result()
        out.append(head)
        queue.popleft()
    return out


def _written_before(queue: deque, error: Exception) -> list[Any]:
    """The events before the first pending write that fails (noted on `error`): what the
    failed run still made durably, to be committed before `error` is raised."""
    out = []
    while queue:
        head = queue.popleft()
        if isinstance(head, PendingWrite):
            try:
                head = head.result()
            except Exception as write_error:  # noqa: BLE001 - kept on the error being raised
                error.add_note(f"also, writing a block in the background failed: {write_error!r}")
                break
        out.append(head)
    return out
