"""The ``ranges`` read path of :class:`~featurestore.core.reader.FeatureArray`: rows of an
uncompressed array on object storage (or any fsspec URL) by ranged GETs.

One byte range per run of adjacent requested rows, all fetched in one ``read_ranges_into`` call
(issued concurrently); the chunks this process has not checked yet are fetched whole instead, for
their crc32c (featurestore.core.checked), and their rows taken from those bytes. After the ranges
of a read call were answered, one re-read of the split's document proves they were all of the
generation the reader opened (featurestore.core.generation): never rows of two generations.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.core import checked
from featurestore.errors import CorruptChunk
from featurestore.format import layout


class RangesPath:
    """The ranged path's part of ``FeatureArray``."""

    # Provided by FeatureArray.
    _storage: Any
    _key: str
    _ndim: int
    chunk_rows: int
    sample_nbytes: int

    # FeatureArray's (declared, not defined: no stub may shadow them in the method order)
    _verify: Callable[..., dict[int, Any]]
    _block_table: Callable[[str], Any]
    _read_blocks: Callable[..., tuple[np.ndarray, float]]
    _sizes_checked: Callable[[list[str]], None]
    _generation: Callable[[], Any]

    def _gather_ranges_checked(self, index: np.ndarray, rows: np.ndarray, positions: np.ndarray | None) -> None:
        """Rows ``index`` from object storage into ``rows`` (all of it, or the rows at
        ``positions``): the chunks this process has not checked yet are fetched whole for their
        crc32c, and their rows taken from those bytes; the others' rows by ranged GETs."""
        if not len(index):
            return
        dest = rows if positions is None else np.empty((len(index), self.sample_nbytes), np.uint8)
        table = self._block_table("ranges")
        fresh = self._verify(index, path="ranges") if table is None else {}
        if table is not None:  # block seals: only the covering blocks are fetched, checked, copied
            rest, _ = self._read_blocks(index, dest, table, "ranges")
            if len(rest) == len(index):
                self._gather_ranges(index, dest)
            elif len(rest):
                part = np.empty((len(rest), self.sample_nbytes), np.uint8)
                self._gather_ranges(index[rest], part)
                dest[rest] = part
        elif fresh:
            chunk_of, offset = np.divmod(index, self.chunk_rows)
            payload = self.chunk_rows * self.sample_nbytes
            for chunk, blob in fresh.items():
                at = np.flatnonzero(chunk_of == chunk)
                whole = np.frombuffer(blob, np.uint8, count=payload).reshape(self.chunk_rows, self.sample_nbytes)
                dest[at] = whole[offset[at]]
            rest = np.flatnonzero(~np.isin(chunk_of, list(fresh)))
            if len(rest):
                part = np.empty((len(rest), self.sample_nbytes), np.uint8)
                self._gather_ranges(index[rest], part)
                dest[rest] = part
        else:
            self._gather_ranges(index, dest)
        # Every range was answered by now: a check of the split's document requested after this
        # proves they were all the opened generation's (featurestore.core.generation).
        self._generation().after(time.monotonic())
        if positions is not None:
            rows[positions] = dest

    def _gather_ranges(self, index: np.ndarray, rows: np.ndarray) -> None:
        # Ranges are planned over the rows in ascending order; each range's rows go straight to
        # their places in ``rows`` as it arrives (no second pass over the batch), unless a row is
        # asked for twice: then the distinct rows are gathered first and spread out after.
        order = np.argsort(index, kind="stable")
        unique = index[order]
        twice = len(unique) > 1 and bool((unique[1:] == unique[:-1]).any())
        inverse = None
        if twice:
            unique, inverse = np.unique(index, return_inverse=True)
        chunk_of, offset = np.divmod(unique, self.chunk_rows)
        keys, starts, ends, spans = [], [], [], []
        for start, stop in row_runs(chunk_of, offset):
            keys.append(layout.chunk_key(self._key, int(chunk_of[start]), self._ndim))
            starts.append(int(offset[start]) * self.sample_nbytes)
            ends.append(int(offset[start] + (stop - start)) * self.sample_nbytes)
            spans.append((start, stop))
        target = np.empty((len(unique), self.sample_nbytes), np.uint8) if twice else rows
        places = None if twice or bool((order[1:] > order[:-1]).all()) else order

        def sink(i: int, blob: Any) -> None:  # each range as it arrives (the copy overlaps the others)
            start, stop = spans[i]
            if len(blob) != (stop - start) * self.sample_nbytes:  # the object is shorter than its rows
                raise CorruptChunk(checked.damage_message(
                    f"chunk {self._storage.url}/{keys[i]}", f"{len(blob)} bytes where "
                    f"{(stop - start) * self.sample_nbytes} were requested (truncated object)"))
            values = np.frombuffer(blob, np.uint8).reshape(stop - start, self.sample_nbytes)
            if places is None:
                target[start:stop] = values
            else:
                target[places[start:stop]] = values

        try:
            self._storage.read_ranges_into(keys, starts, ends, sink)
        except FileNotFoundError:
            raise
        except CorruptChunk:
            raise
        except OSError:  # e.g. S3 "range not satisfiable": an object shorter than its rows?
            self._sizes_checked(keys)  # CorruptChunk naming the short one
            raise
        if inverse is not None:
            np.take(target, inverse.reshape(-1), axis=0, out=rows)


def is_range(index: np.ndarray) -> bool:
    """Whether ``index`` is ``first, first + 1, ..., last`` (a whole bag, a row range). Rising
    everywhere from ``first`` to ``last = first + n - 1`` leaves each step exactly 1: one compare
    pass, half the time of ``np.diff`` (a bag read asks this of its index several times)."""
    n = len(index)
    return n > 0 and int(index[-1]) - int(index[0]) == n - 1 and (n < 3 or bool((index[1:] > index[:-1]).all()))


def chunks_of(index: np.ndarray, chunk_rows: int) -> np.ndarray:
    """The chunks ``index``'s rows lie in, ascending (``np.unique``'s answer, without its sort
    for a row range)."""
    if is_range(index):
        return np.arange(int(index[0]) // chunk_rows, int(index[-1]) // chunk_rows + 1)
    return np.unique(index // chunk_rows)


def copy_runs(index: np.ndarray, chunk_rows: int) -> tuple[list[tuple[int, int, int, int]], int]:
    """``index``'s rows as runs ``(chunk, first row in it, first output row, length)`` in
    ascending storage order, each consecutive in the chunk and in the output, and how many chunks
    they touch. A contiguous ascending index (a whole bag, a row range) is cut at chunk bounds
    without sorting or per-row lists: for a small bag those passes cost more than its copy."""
    if is_range(index):
        first, stop = int(index[0]), int(index[-1]) + 1
        runs = []
        for chunk in range(first // chunk_rows, (stop - 1) // chunk_rows + 1):
            lo, hi = max(first, chunk * chunk_rows), min(stop, (chunk + 1) * chunk_rows)
            runs.append((chunk, lo - chunk * chunk_rows, lo - first, hi - lo))
        return runs, len(runs)
    rows = SortedRows(index, chunk_rows)
    return rows.runs(), rows.chunks


class SortedRows:
    """An index's rows in ascending storage order: ``order`` (their output rows), ``chunk`` and
    ``offset`` (row in its chunk) of each, ``starts`` (where each run of rows consecutive in a
    chunk and in the output begins), ``chunk_starts`` (where each chunk's rows begin) and how many
    ``chunks`` they touch: numpy arrays, so a gather that reads row by row (core.descriptor_reads)
    makes no Python step per row until it reads."""

    def __init__(self, index: np.ndarray, chunk_rows: int) -> None:
        n = len(index)
        self.order = np.argsort(index, kind="stable")
        self.chunk, self.offset = np.divmod(index[self.order], chunk_rows)
        if n <= 1:  # one row (the server's single item): no numpy passes for it
            self._starts: np.ndarray | None = np.zeros(n, np.int64)
            self.chunk_starts = self._starts
            self.chunks = n
            return
        self._chunk_step = np.diff(self.chunk) != 0
        self._starts = None  # made when asked: a read through descriptors never asks
        self.chunk_starts = np.concatenate(([0], np.flatnonzero(self._chunk_step) + 1))
        self.chunks = len(self.chunk_starts)

    def chunk_positions(self) -> np.ndarray:
        """Each row's chunk as its position among the chunks touched (0, 0, 1, 2, 2, ...)."""
        if len(self.order) <= 1:
            return np.zeros(len(self.order), np.int64)
        return np.concatenate(([0], np.cumsum(self._chunk_step)))

    @property
    def starts(self) -> np.ndarray:
        if self._starts is None:
            step = self._chunk_step | (np.diff(self.offset) != 1) | (np.diff(self.order) != 1)
            self._starts = np.concatenate(([0], np.flatnonzero(step) + 1))
        return self._starts

    def runs(self) -> list[tuple[int, int, int, int]]:
        """As :func:`copy_runs` lists them."""
        starts = self.starts
        lengths = np.diff(np.append(starts, len(self.order))).tolist()
        return list(zip(self.chunk[starts].tolist(), self.offset[starts].tolist(), self.order[starts].tolist(),
                        lengths))


def row_runs(chunk_of: np.ndarray, offset: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) positions of maximal runs where rows are consecutive within one chunk (runs
    that also land in consecutive output rows: :class:`SortedRows`)."""
    n = len(chunk_of)
    if n <= 1:  # one row (the server's single item): no numpy passes for it
        return [(0, n)] if n else []
    step = (np.diff(chunk_of) != 0) | (np.diff(offset) != 1)
    breaks = np.flatnonzero(step) + 1
    bounds = np.concatenate(([0], breaks, [n]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
