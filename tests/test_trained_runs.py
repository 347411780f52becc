"""The loss masks of token ranges from the blocks' trained runs equal the flags expanded token by
token, whatever blocks the ranges cross, in what order blocks load, and when the table starts over."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchcache.read import trained_runs
from torchcache.read.trained_runs import TrainedRuns


@st.composite
def blocks_and_ranges(draw):
    """Blocks of random sizes with random trained flags; ranges over them."""
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=8))
    flags = [np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=bool) for n in sizes]
    token_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    length = draw(st.integers(1, int(token_starts[-1])))
    starts = draw(st.lists(st.integers(0, int(token_starts[-1]) - length), min_size=1, max_size=12))
    return flags, token_starts, length, np.array(starts, dtype=np.int64)


def runs_of(flags: np.ndarray) -> np.ndarray:
    padded = np.concatenate(([False], flags, [False])).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return np.stack([edges[0::2], edges[1::2] - edges[0::2]], axis=1).astype(np.int64)


@settings(max_examples=300, deadline=None)
@given(blocks_and_ranges(), st.integers(0, 3))
def test_masks_equal_the_expanded_flags(case, budget):
    flags, token_starts, length, starts = case
    everything = np.concatenate(flags)
    table = TrainedRuns()
    old = trained_runs.MAX_RUNS
    trained_runs.MAX_RUNS = [old, 1, 4, 16][budget]  # tiny budgets: the table starts over often
    try:
        # blocks load a few at a time, in different orders, next to blocks loaded before
        for rows in [starts[k:k + 2] for k in range(len(starts))] + [starts, starts[::-1]]:
            got = table.flags(rows, length, token_starts, lambda b: runs_of(flags[b]))
            want = np.concatenate([everything[s:s + length] for s in rows])
            np.testing.assert_array_equal(got, want)
            lengths = np.minimum(np.arange(len(rows)) % (length + 1), len(everything) - rows)
            got = table.flags(rows, lengths, token_starts, lambda b: runs_of(flags[b]))
            want = np.concatenate([everything[s:s + n] for s, n in zip(rows, lengths)])
            np.testing.assert_array_equal(got, want)  # ranges of other lengths, empty ones too
    finally:
        trained_runs.MAX_RUNS = old


def test_a_growing_cache_adds_its_new_blocks():
    table = TrainedRuns()
    first = np.array([True, False, True, True])
    got = table.flags(np.array([0]), 4, np.array([0, 4]), lambda b: runs_of(first)).reshape(1, 4)
    np.testing.assert_array_equal(got[0], first)
    second = np.array([False, True])
    got = table.flags(np.array([2]), 4, np.array([0, 4, 6]),
                      lambda b: runs_of([first, second][b])).reshape(1, 4)
    np.testing.assert_array_equal(got[0], [True, True, False, True])


@pytest.mark.parametrize("rows", [0, 3])
def test_empty_requests(rows):
    table = TrainedRuns()
    got = table.flags(np.zeros(rows, dtype=np.int64), 0, np.array([0, 5]), lambda b: runs_of(np.ones(5, bool)))
    assert got.shape == (0,)
    got = table.flags(np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64), np.array([0, 5]),
                      lambda b: runs_of(np.ones(5, bool)))
    assert got.shape == (0,)
