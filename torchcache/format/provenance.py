"""Record numbers of a text cache's documents, kept without a number per document (docs/format.md,
"Record runs").

Document d of input i came from record ``r`` of that input (0-based: line - 1 of a JSON lines
file, row, tar sample, iterable item). Mostly every record gives a document, so ``r`` is the
number of documents of input i before d: derivable from the block index alone, and a block whose
documents are exactly that stores nothing extra (such a cache keeps its bytes). A block whose
documents are not (a record at or before them gave no document: a blank line, a record skipped
on error, one a pipeline's filter left out) keeps its documents' records as runs in its offsets
sidecar: tensor ``record_runs``, I64, ``(first record, documents)`` pairs, flattened. Once an
input has such a gap, every later block of it has runs (the derivation no longer holds there).

Caches built before runs were kept have gaps without runs, so a reader derives records only
where it knows that cannot be: head.json says ``"record_runs": true`` (written by builders that
keep runs, only where it tells something: in a head whose cache has a gap), or the input's final
record count equals its document count (no gap at all).
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import CacheFormatError
from . import blocks as fmt
from .storage import Storage

RUNS_TENSOR = "record_runs"
HEAD_KEY = "record_runs"

__all__ = ["HEAD_KEY", "RUNS_TENSOR", "check_runs", "derived_records_hold", "keeps_runs", "needs_runs",
           "record_at", "runs_of", "sidecar_has_runs"]


def needs_runs(records: Sequence[int], documents_before: int | None) -> bool:
    """Whether a block whose documents came from 0-based `records` (increasing) must store them:
    True unless they are ``documents_before, documents_before + 1, ...``. None: the cache is one
    an older builder started, which kept no runs; its blocks are made as that builder made them
    (so a resumed build, or a repaired block, gives the bytes it would have)."""
    if documents_before is None:
        return False
    return bool(len(records)) and (records[0] != documents_before
                                   or records[-1] != documents_before + len(records) - 1)


def runs_of(records: Sequence[int]) -> np.ndarray:
    """0-based increasing record numbers as flattened (first record, count) runs, int64.

    >>> runs_of([0, 1, 2, 5, 6, 9]).tolist()
    [0, 3, 5, 2, 9, 1]
    """
    r = np.asarray(records, dtype=np.int64)
    if not len(r):
        return np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(r) != 1) + 1
    starts = np.concatenate([[0], breaks])
    counts = np.diff(np.concatenate([starts, [len(r)]]))
    return np.stack([r[starts], counts], axis=1).reshape(-1).astype(np.int64)


def check_runs(flat: np.ndarray, num_documents: int, bad: Callable[[str], Exception]) -> np.ndarray:
    """Stored runs, checked: pairs, counts >= 1 adding up to the block's documents, records from
    0, increasing and apart (a run never continues the one before). Returns an (n, 2) array."""
    if len(flat) % 2:
        raise bad(f"{RUNS_TENSOR} holds an odd number of values")
    runs = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    first, count = runs[:, 0], runs[:, 1]
    if np.any(count <= 0) or int(count.sum()) != num_documents:
        raise bad(f"{RUNS_TENSOR} counts {int(count.sum())} documents in runs of at least one, the "
                  f"block has {num_documents}")
    if len(runs) and (first[0] < 0 or np.any(first[1:] <= first[:-1] + count[:-1])):
        raise bad(f"{RUNS_TENSOR} records are not increasing from 0 in separate runs")
    return runs


def keeps_runs(head: dict[str, Any] | None, documents: Sequence[int] = ()) -> bool:
    """Whether the blocks of the cache with this head.json keep record runs where needed: the
    head says so, or nothing can need them (a complete cache whose inputs have as many records
    as `documents`, each input's document count: its blocks are the same either way)."""
    if head is None:
        return False
    if head.get(HEAD_KEY) is True:
        return True
    inputs = head.get("inputs")
    return inputs is not None and len(inputs) == len(documents) and all(
        p["records"] == n for p, n in zip(inputs, documents))


def sidecar_has_runs(storage: Storage, rel: str, max_size: int) -> bool:
    """Whether the offsets sidecar `rel` holds record runs (read whole, capped at `max_size`)."""
    data = fmt.read_capped_file(storage, rel, max_size)
    n = int.from_bytes(bytes(data[:8]), "little")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise CacheFormatError(f"{storage.url}/{rel}: corrupted safetensors header ({e}); run "
                               "`torchcache verify`") from None
    return isinstance(header, dict) and RUNS_TENSOR in header


def record_at(runs: np.ndarray, local: int) -> int:
    """The record of the block's document `local`, from its (n, 2) runs."""
    ends = np.cumsum(runs[:, 1])
    k = int(np.searchsorted(ends, local, side="right"))
    return int(runs[k, 0] + local - (ends[k] - runs[k, 1]))


def last_record(runs: np.ndarray) -> int:
    """The highest record the runs name (-1 for none)."""
    return int(runs[-1, 0] + runs[-1, 1] - 1) if len(runs) else -1


def derived_records_hold(head: dict[str, Any] | None, input_index: int, documents: int) -> bool:
    """Whether the records of input `input_index`'s blocks without runs are their documents'
    numbers within the input (its `documents` committed documents): the head says runs are kept
    wherever they are needed, or the complete cache's input has exactly one record per document."""
    if head is None:
        return False
    if head.get(HEAD_KEY) is True:
        return True
    inputs = head.get("inputs")
    return inputs is not None and inputs[input_index]["records"] == documents


def input_records(head: dict[str, Any] | None, input_index: int) -> int | None:
    """The number of records of input `input_index` when the head knows it (a complete cache)."""
    inputs = (head or {}).get("inputs")
    return None if inputs is None else int(inputs[input_index]["records"])


def past_the_input(path: str, record: int, records: int | None, input_path: str) -> None:
    """Refuse a stored record number past its input's record count (a damaged sidecar)."""
    if records is not None and record >= records:
        raise CacheFormatError(f"{path}: a document's record number {record} is past the "
                               f"{records} records of its input {input_path}; the sidecar is "
                               "corrupted (run `torchcache verify --repair`)")
