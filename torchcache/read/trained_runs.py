"""The trained runs of a cache's blocks in one table, so that the loss masks of many token ranges
come from a few vectorized steps, whatever blocks the ranges fall in.

Format v3 stores each block's trained tokens as runs (start, length), block-relative. A reader
keeps the runs of the blocks it has read, in global token positions, in one table sorted by
position: a range's runs are then found by one binary search over all blocks together, and the
masks of a whole batch are made by one `np.repeat` of alternating False/True segments.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

MAX_RUNS = 1 << 24  # runs kept per process (16 bytes each): past it, the table starts again


class TrainedRuns:
    """The trained runs of the blocks loaded so far (process-local; pickles empty)."""

    def __init__(self) -> None:
        self.starts = np.empty(0, dtype=np.int64)  # global positions, sorted
        self.ends = np.empty(0, dtype=np.int64)
        self.loaded = np.zeros(0, dtype=bool)  # per block
        self.all_loaded = -1  # the number of blocks when every one was loaded (-1: not so)
        self._alternating = np.zeros(0, dtype=bool)  # False, True, False, ...

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()

    def flags(self, starts: np.ndarray, lengths: np.ndarray | int, token_starts: np.ndarray,
              load: Callable[[int], np.ndarray]) -> np.ndarray:
        """Trained flags of the global ranges [starts[k], starts[k] + lengths[k]), end to end in
        one flat bool array (`lengths` an int: every range that long, as rows of a batch).

        token_starts: where each block starts (and the total, last); load(b): block b's runs as
        an (n, 2) array of block-relative (start, length), sorted and apart.
        """
        equal = np.ndim(lengths) == 0
        if equal:
            size = len(starts) * max(int(lengths), 0)
            if not size:
                return np.zeros(size, dtype=bool)
        else:
            size = int(lengths.sum())
            offsets = lengths.cumsum() - lengths  # where each range goes in the output
            keep = lengths > 0  # (an empty range reads nothing, and names no block)
            starts, lengths, offsets = starts[keep], lengths[keep], offsets[keep]
            if not size:
                return np.zeros(size, dtype=bool)
        rows = len(starts)
        ends = starts + lengths
        # (numpy methods, not functions: a batch is a few dozen calls, their overhead counts)
        if self.all_loaded != len(token_starts) - 1:  # some block's runs may be missing
            blocks = token_starts.searchsorted(np.concatenate((starts, ends - 1)), "right") - 1
            first_block, last_block = blocks[:rows], blocks[rows:]
            loaded = self.loaded
            if len(loaded) < len(token_starts) - 1 or not loaded[blocks].all() or \
                    (last_block - first_block).max() > 1:
                self._load_blocks(first_block, last_block, token_starts, load)
        first = self.ends.searchsorted(starts, "right")
        counts = self.starts.searchsorted(ends, "left") - first
        total = int(counts.sum())
        if not total:
            return np.zeros(size, dtype=bool)
        owner = np.arange(rows).repeat(counts)
        which = (first - counts.cumsum() + counts).repeat(counts) + np.arange(total)
        row_start = starts[owner]
        # global position -> position in the flat output
        shift = (owner * lengths if equal else offsets[owner]) - row_start
        bounds = np.empty(2 * total + 2, dtype=np.int64)
        bounds[0], bounds[-1] = 0, size
        bounds[1:-1:2] = np.maximum(self.starts[which], row_start) + shift  # (runs overlap the range)
        bounds[2:-1:2] = np.minimum(self.ends[which], ends[owner]) + shift
        if len(self._alternating) < 2 * total + 1:
            self._alternating = np.arange(4 * total + 2) % 2 == 1  # untrained, trained, ...
        return self._alternating[:2 * total + 1].repeat(bounds[1:] - bounds[:-1])

    def _load_blocks(self, first: np.ndarray, last: np.ndarray, token_starts: np.ndarray,
                     load: Callable[[int], np.ndarray]) -> None:
        """Add the runs of every block the ranges (from block `first` to `last`) touch that the
        table does not hold yet."""
        n_blocks = len(token_starts) - 1
        if len(self.loaded) < n_blocks:  # the cache grew
            self.loaded = np.concatenate([self.loaded, np.zeros(n_blocks - len(self.loaded), bool)])
        needed = np.union1d(first, last)
        for r in np.flatnonzero(last - first > 1):  # a range over more than two blocks
            needed = np.union1d(needed, np.arange(first[r], last[r] + 1))
        missing = needed[~self.loaded[needed]].tolist()
        if not missing:
            return
        added = [(b, load(b)) for b in missing]
        if len(self.starts) + sum(len(runs) for _, runs in added) > MAX_RUNS:  # start again, with
            kept = needed[self.loaded[needed]].tolist()                        # what this needs
            self.__init__()
            self.loaded = np.zeros(n_blocks, dtype=bool)
            added += [(b, load(b)) for b in kept]
        for b, runs in added:
            at = int(np.searchsorted(self.starts, token_starts[b]))
            self.starts = np.insert(self.starts, at, runs[:, 0] + token_starts[b])
            self.ends = np.insert(self.ends, at, runs[:, 0] + runs[:, 1] + token_starts[b])
            self.loaded[b] = True
        self.all_loaded = n_blocks if self.loaded[:n_blocks].all() else -1
