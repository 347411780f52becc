"""Executors: run the work function (`worker.build_input`) over the inputs to build, and hand
the events to the commit step (`commit.Committer`) in the order they arrive.

Inline runs in this process; the pool runs one fresh interpreter per worker (see `_procs`); Ray
lives in `ray_executor`. The cache does not depend on which one ran, nor on how many workers.
"""

from __future__ import annotations

import itertools
from multiprocessing.connection import Connection, wait as wait_for_connections
from typing import Any, Callable, Iterable

from .._util.procs import Child, start_child
from .background_writes import BackgroundWrites
from .commit import Committer
from ..errors import BuildError
from .records import InputSource
from .worker import BuildJob, Event, InputDone, WorkerFailed, build_input, worker_failed

ShouldStop = Callable[[], bool] | None


def check_cancelled(should_stop: ShouldStop) -> None:
    """BuildError when the caller asked the build to stop (a background build's cancel())."""
    if should_stop and should_stop():
        raise BuildError("build cancelled; committed blocks are kept and a re-run resumes")


def run_inline(job: BuildJob, sources: list[InputSource] | list[Iterable[str]], todo: list[int],
               starts: dict[int, dict], committer: Committer, should_stop: ShouldStop) -> int:
    """Build the inputs `todo` one after the other in this process, committing each event. A
    block is written in the background while the next is made, also across inputs."""
    built = 0
    with BackgroundWrites() as writes:
        events = itertools.chain.from_iterable(build_input(job, index, sources[index], starts[index],
                                                           writes) for index in todo)
        for ready in writes.in_order(events):
            built += committer.commit(ready)
            check_cancelled(should_stop)
    return built


def run_pool(job: BuildJob, sources: list[InputSource], todo: list[int], starts: dict[int, dict],
             committer: Committer, should_stop: ShouldStop, workers: int) -> int:
    """Build the inputs `todo` on `workers` worker processes, committing as blocks arrive.

    Inputs are handed out one at a time, in order, to whichever worker is free.
    """
    waiting = list(todo)
    children = [start_child("torchcache.builder.executors:_pool_worker", job, sources,
                            {i: starts[i] for i in todo}) for _ in range(workers)]
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
            events: list[Event] = []
            finished: list[Child] = []
            died = None
            for conn in ready:
                child = by_conn[conn]
                try:
                    while conn.poll():
                        events.append(conn.recv())
                        if isinstance(events[-1], InputDone):
                            finished.append(child)
                except EOFError:
                    del by_conn[conn]
                    if child not in stopped and not any(isinstance(e, WorkerFailed) for e in events):
                        died = child
            built += committer.commit(events)  # what arrived before a death is kept
            if died is not None:
                raise BuildError(f"a build worker died (exit code {died.join(5)}) while building "
                                 f"inputs {sorted(remaining)}; committed blocks are kept and a "
                                 "re-run resumes")
            remaining.difference_update(e.input for e in events if isinstance(e, InputDone))
            for child in finished:
                hand_out(child)
    finally:
        for child in children:
            child.kill()
        for child in children:
            child.join()
            child.close()
    return built


def _pool_worker(conn: Connection, job: BuildJob, sources: list[InputSource],
                 starts: dict[int, dict[str, Any]]) -> None:
    """A pool worker (a child started by `_procs`): build the inputs the coordinator sends
    until it sends None. A dead coordinator closes the connection, so the next send fails and
    the worker exits. A failure is sent to the coordinator, which raises it as its own."""
    while True:
        index = conn.recv()
        if index is None:
            return
        try:
            with BackgroundWrites() as writes:
                for ready in writes.in_order(build_input(job, index, sources[index], starts[index],
                                                         writes)):
                    for event in ready:
                        conn.send(event)
        except Exception as e:  # noqa: BLE001 - reported whole (type, message, cause) and raised there
            conn.send(worker_failed(index, e))
            return
