"""Builds on Ray: the same work function as the local pool, run as Ray generator tasks.

Each input is one task that streams its events (finished blocks, progress) back to the driver,
which commits blocks in the same deterministic order as a local build, so the cache is
byte-for-byte the same. Outputs must be reachable from every node: an fsspec URL (s3://, gs://)
or a shared filesystem. Ray retries a task whose worker or node dies; a retried task starts over
from its input's resume point and the driver ignores blocks it already has.
"""

from __future__ import annotations

from typing import Iterator

from .commit import Committer
from ..errors import BuildError, InputError
from .executors import ShouldStop, check_cancelled
from .records import InputSource
from .worker import BuildJob, Event, build_input, worker_failed

_MAX_RETRIES = 3


def _build_input_task(job: BuildJob, index: int, source: InputSource, start: dict) -> Iterator[Event]:
    try:
        yield from build_input(job, index, source, start)
    except InputError as e:  # bad input is not worth retrying: report it like a local worker does
        yield worker_failed(index, e)


def run_ray(job: BuildJob, sources: list[InputSource] | None, todo: list[int],
            starts: dict[int, dict], committer: Committer, should_stop: ShouldStop,
            num_workers: int | None) -> int:
    """Run the inputs `todo` on Ray (connecting to a running cluster, or starting a local one)."""
    try:
        import ray
    except ImportError:
        raise ImportError("executor='ray' needs Ray: `pip install torchcache-lm[ray]`") from None
    if sources is None or any(s.process_local for s in sources):
        raise ValueError("executor='ray' needs file inputs that every node can read (paths on a "
                         "shared filesystem or fsspec URLs), not an iterable or memory:// inputs")
    if not ray.is_initialized():
        ray.init(num_cpus=num_workers, log_to_driver=False)
    task = ray.remote(_build_input_task).options(max_retries=_MAX_RETRIES,
                                                 retry_exceptions=[OSError, ConnectionError])
    running = {task.remote(job, i, sources[i], dict(starts[i])): i for i in todo}
    built = 0
    try:
        while running:
            ready, _ = ray.wait(list(running), num_returns=1, timeout=0.5)
            check_cancelled(should_stop)
            events: list[Event] = []
            try:
                for gen in ready:
                    try:
                        events.append(ray.get(next(gen)))
                    except StopIteration:
                        del running[gen]
                    except ray.exceptions.RayTaskError as e:
                        if isinstance(e.cause, Exception):  # the task's own error, as inline
                            raise e.cause from e
                        raise _failed(sources[running[gen]], e) from None
                    except ray.exceptions.RayError as e:  # a worker or node lost for good
                        raise _failed(sources[running[gen]], e) from None
            finally:
                built += committer.commit(events)
    finally:
        for gen in running:
            ray.cancel(gen, force=True)
    return built


def _failed(source: InputSource, error: Exception) -> BuildError:
    return BuildError(f"building input {source.path} failed on Ray after {_MAX_RETRIES} retries: "
                      f"{error}; committed blocks are kept and a re-run resumes")
