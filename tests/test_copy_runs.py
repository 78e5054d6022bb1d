"""The runs a local gather copies: every row once, to its own output slot, in ascending storage
order; a row range (a whole bag) cut at chunk bounds without the general path's sort."""

from __future__ import annotations

import numpy as np
import pytest

from featurestore.core.reader_ranges import chunks_of, copy_runs, is_range


def _copied(index: np.ndarray, chunk_rows: int) -> np.ndarray:
    """The storage row each output slot receives, by replaying the runs."""
    got = np.full(len(index), -1, np.int64)
    runs, chunks = copy_runs(index, chunk_rows)
    previous = (-1, -1)
    for chunk, first, target, length in runs:
        assert 0 <= first and first + length <= chunk_rows and length >= 1
        assert (got[target : target + length] == -1).all()  # each slot written once
        got[target : target + length] = chunk * chunk_rows + first + np.arange(length)
        assert (chunk, first) >= previous  # ascending storage order (a duplicate row: equal)
        previous = (chunk, first + length - 1)
    assert chunks == len({r[0] for r in runs})
    return got


@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_runs_copy_every_row_to_its_slot(chunk_rows: int) -> None:
    rng = np.random.default_rng(chunk_rows)
    cases = [np.arange(5, 5 + n) for n in (1, 2, 3, 64, 65, 200)]  # ranges, across chunk bounds
    cases += [rng.integers(0, 300, n) for n in (1, 2, 7, 100)]  # shuffled, duplicates
    cases += [np.sort(rng.choice(300, 50, replace=False)), np.arange(10, 0, -1), np.array([4, 5, 7, 8])]
    for index in cases:
        index = index.astype(np.int64)
        assert (_copied(index, chunk_rows) == index).all(), index
        assert (chunks_of(index, chunk_rows) == np.unique(index // chunk_rows)).all(), index


def test_a_range_is_recognised_only_when_every_step_is_one() -> None:
    assert is_range(np.arange(7, 20)) and is_range(np.array([3])) and is_range(np.array([3, 4]))
    assert not is_range(np.array([], np.int64))
    assert not is_range(np.array([0, 2, 1, 3]))  # first and last agree with a range, the middle does not
    assert not is_range(np.array([5, 4])) and not is_range(np.array([1, 1, 3])) and not is_range(np.array([0, 1, 1, 3]))
    runs, chunks = copy_runs(np.arange(60, 130), 64)
    assert runs == [(0, 60, 0, 4), (1, 0, 4, 64), (2, 0, 68, 2)] and chunks == 3
