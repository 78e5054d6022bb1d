"""Mean and max pooling of a row's patches in numpy, reading bags into reused buffers.

Each bag is read with ``bags.read_numpy`` in pieces of at most ~4 MiB into one of two reused
buffers, while a reader thread fills the other (the gather and the reductions release the GIL,
so reading and reducing overlap). Each piece is reduced by a numba kernel in one pass
(featurestore.embed.kernel), else by numpy in cache-sized blocks; an int8 split's pieces are
read as float32 values (codes times their bag's scale). Mean sums in float64 (float16, bfloat16
and float32 values are exact in float64, and a float64 sum of up to millions of them is far below float32's
rounding step), so the float32 mean is the float32 rounding of the float64 mean. Max is exact in
float32 (every stored value is a float32 value).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from featurestore.embed.rows import Row, shift_coords, split_subset
from featurestore.format import dtypes

PIECE_BYTES = 4 << 20
# Each piece is converted and reduced in blocks whose float64 copy (512 KiB) stays in the CPU's
# cache: twice the speed of converting a whole 4 MiB piece (16 MiB of float64) at once.
BLOCK_BYTES = 512 << 10


def _pieces(bag: int, length: int, kept: np.ndarray | None, piece_rows: int) -> Iterator[np.ndarray]:
    """Row positions within ``bag``, in pieces of at most ``piece_rows``."""
    if kept is None:
        for start in range(0, length, piece_rows):
            yield np.arange(start, min(start + piece_rows, length), dtype=np.int64)
    else:
        for start in range(0, len(kept), piece_rows):
            yield kept[start:start + piece_rows]


class Pooler:
    """Pools rows of one bag split: ``pool(rows, kept)`` yields ``(row, [dim] float32)`` in order."""

    def __init__(self, bags: Any, how: str) -> None:
        self.bags, self.how = bags, how
        self.dim = int(bags.dim)
        # An int8 split's codes mean nothing without their bag's scale: its pieces are read as
        # float32 values (codes x scale, bags.read_numpy(dtype="float32")) and pooled as float32.
        self.values = "float32" if dtypes.is_int8(bags.dtype) else None
        self.storage = dtypes.storage_dtype(self.values or bags.dtype)
        self.piece_rows = max(1, PIECE_BYTES // (self.dim * self.storage.itemsize))
        self.raw = [np.empty((self.piece_rows, self.dim), self.storage) for _ in range(2)]
        self.block_rows = max(1, BLOCK_BYTES // (self.dim * 8))
        self.f32 = np.empty((self.block_rows, self.dim), np.float32)
        self.f64 = np.empty((self.block_rows, self.dim), np.float64)
        self.partial = np.empty(self.dim, np.float64)
        self.partial32 = np.empty(self.dim, np.float32)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="featurestore-embed-read")
        self._kernel = kernel_for(how, self.values or bags.dtype)

    def close(self) -> None:
        self._reader.shutdown(wait=True)

    def _read(self, bag: int, rows: np.ndarray, buffer: int) -> np.ndarray:
        out = self.raw[buffer][: len(rows)]
        self.bags.read_numpy(bag, rows=rows, out=out, dtype=self.values)
        return out

    def _work(self, rows: list[Row], kept: list[np.ndarray | None]) -> Iterator[tuple[int, int, np.ndarray]]:
        lengths = self.bags.lengths
        for r, (row, positions) in enumerate(zip(rows, kept, strict=True)):
            per_bag = split_subset(positions, [int(lengths[b]) for b in row.bags])
            for bag, subset in zip(row.bags, per_bag, strict=True):
                for piece in _pieces(bag, int(lengths[bag]), subset, self.piece_rows):
                    if len(piece):
                        yield r, bag, piece

    def pool(self, rows: list[Row], kept: list[np.ndarray | None]) -> Iterator[tuple[Row, np.ndarray]]:
        """Each row's pooled ``[dim]`` float32 vector, in the order of ``rows``; a row without
        patches is never asked for (the run refuses or skips it first)."""
        acc = self._fresh()
        count, current = 0, 0
        work = self._work(rows, kept)
        item = next(work, None)
        pending = None if item is None else self._reader.submit(self._read, item[1], item[2], 0)
        turn = 0
        while item is not None:
            r = item[0]
            following = next(work, None)
            upcoming = None if following is None else self._reader.submit(self._read, following[1], following[2], 1 - turn)
            raw = pending.result() if pending is not None else None
            while current < r:  # rows before this piece are done
                yield rows[current], self._finish(acc, count)
                acc, count, current = self._fresh(), 0, current + 1
            self._reduce(raw, acc)
            count += len(raw)
            item, pending, turn = following, upcoming, 1 - turn
        if rows and current < len(rows):
            yield rows[current], self._finish(acc, count)

    def _fresh(self) -> np.ndarray:
        if self.how == "mean":
            return np.zeros(self.dim, np.float64)
        return np.full(self.dim, -np.inf, np.float32)

    def _finish(self, acc: np.ndarray, count: int) -> np.ndarray:
        if self.how == "mean":
            return (acc / max(count, 1)).astype(np.float32)
        return acc.copy()

    def _as_float32(self, raw: np.ndarray) -> np.ndarray:
        n = len(raw)
        out = self.f32[:n]
        if raw.dtype == np.float32:
            return raw
        if raw.dtype == np.uint16:  # bfloat16 bits: the high half of a float32
            bits = out.view(np.uint32)
            np.copyto(bits, raw)
            np.left_shift(bits, 16, out=bits)
            return out
        np.copyto(out, raw)
        return out

    def _reduce(self, raw: np.ndarray, acc: np.ndarray) -> None:
        if self._kernel is not None:  # one pass, in registers (featurestore.embed.kernel)
            self._kernel(raw.view(np.uint16) if raw.dtype == np.float16 else raw, acc)
            return
        for start in range(0, len(raw), self.block_rows):
            block = raw[start:start + self.block_rows]
            if self.how == "mean":
                wide = self.f64[: len(block)]
                np.copyto(wide, block if block.dtype != np.uint16 else self._as_float32(block))
                np.add.reduce(wide, axis=0, out=self.partial)
                acc += self.partial
            else:
                np.maximum.reduce(self._as_float32(block), axis=0, out=self.partial32)
                np.maximum(acc, self.partial32, out=acc)


def kernel_for(how: str, logical: str) -> Any:
    """The numba kernel of ``how`` over stored ``logical`` rows, compiled (or loaded from numba's
    cache) now; None without numba, or with ``FEATURESTORE_EMBED_KERNEL=0``: numpy then."""
    if os.environ.get("FEATURESTORE_EMBED_KERNEL", "1") == "0":
        return None
    try:
        from featurestore.embed.kernel import KERNELS
    except ImportError:
        return None
    kernel = KERNELS[(how, logical)]
    storage = dtypes.storage_dtype(logical)
    sample = np.zeros((1, 1), np.uint16 if storage.itemsize == 2 else np.float32)
    kernel(sample, np.zeros(1, np.float64 if how == "mean" else np.float32))
    return kernel


def gather(bags: Any, row: Row, positions: np.ndarray | None, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A row's patches for a torch slide encoder: features ``[N, dim]`` float32 and coordinates
    ``[N, 2]`` int64, its bags concatenated in order (later slides shifted by their level-0
    ``patch_size`` and more: rows.shift_coords)."""
    lengths = [int(bags.lengths[b]) for b in row.bags]
    feats, coords = [], []
    for bag, subset in zip(row.bags, split_subset(positions, lengths), strict=True):
        # float32 values whatever the stored dtype (bfloat16 decoded, int8 codes x the bag's scale)
        values, xy = bags.read_numpy(bag, rows=subset, dtype="float32")
        feats.append(values)
        coords.append(xy)
    features = np.ascontiguousarray(np.concatenate(feats)) if feats else np.zeros((0, bags.dim), np.float32)
    return features, shift_coords(coords, patch_size)
