"""Read a whole 2-D HDF5 dataset whose chunks span full rows, with positional reads.

TRIDENT writes each slide's ``features`` in h5 chunks of one row ``(1, D)`` (BAGS.md). h5py reads
such a dataset one chunk at a time, through HDF5's chunk cache, holding the GIL all along: a
60k-patch slide is 60k small reads, and nothing else in the process runs meanwhile (``featurestore
import`` read a 2 GiB TRIDENT directory at 0.19 GB/s cold, and its writer, on another thread,
waited for the GIL: the import took twice the read alone). An unfiltered dataset's chunks
are the raw rows at known file offsets (``H5Dchunk_iter``), mostly back to back: they are read here
as one ``preadv`` per run of adjacent chunks, which releases the GIL.

Anything else (filters, a user block, chunks not spanning whole rows, a byte order or layout this
does not expect, missing chunks) is read by h5py as before: same values either way.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = ["read_rows"]

def read_rows(dataset: Any) -> np.ndarray:
    """``dataset[()]`` of an h5py dataset, read with positional reads when its layout allows."""
    fast = _chunk_runs(dataset)
    if fast is None:
        return dataset[()]
    runs, row_bytes = fast
    out = np.empty(dataset.shape, dataset.dtype)
    flat = memoryview(out.reshape(-1).view(np.uint8))
    fd = os.open(dataset.file.filename, os.O_RDONLY)
    try:
        for address, first_row, rows in runs:
            view = flat[first_row * row_bytes : (first_row + rows) * row_bytes]
            while len(view):
                got = os.preadv(fd, [view], address)
                if got <= 0:
                    raise OSError(f"{dataset.file.filename!r} ended before byte {address} (truncated)")
                view, address = view[got:], address + got
    finally:
        os.close(fd)
    return out


def _chunk_runs(dataset: Any) -> tuple[list[tuple[int, int, int]], int] | None:
    """[(file address, first row, rows)] covering the dataset, and bytes per row; None when the
    layout is not plain row chunks of raw little-endian values in a file without a user block."""
    shape, chunks, dtype = dataset.shape, dataset.chunks, dataset.dtype
    if (chunks is None or len(shape) != 2 or chunks[1] != shape[1] or shape[0] == 0 or dtype.kind not in "biuf"
            or dtype.byteorder == ">" or dataset.id.get_create_plist().get_nfilters() != 0
            or dataset.file.userblock_size != 0 or dataset.file.driver not in ("sec2", None)):  # fmt: skip
        return None
    row_bytes = shape[1] * dtype.itemsize
    chunk_rows, chunk_bytes = chunks[0], chunks[0] * row_bytes
    found: list[tuple[int, int]] = []
    plain = [True]

    def visit(info: Any) -> None:
        found.append((int(info.chunk_offset[0]), int(info.byte_offset)))
        if info.size != chunk_bytes or info.filter_mask:
            plain[0] = False  # not the raw bytes of its rows

    if not hasattr(dataset.id, "chunk_iter"):  # h5py < 3.8
        return None
    dataset.id.chunk_iter(visit)
    if not plain[0]:
        return None
    found.sort()
    if len(found) != -(-shape[0] // chunk_rows) or any(row != k * chunk_rows for k, (row, _) in enumerate(found)):
        return None  # a chunk never written reads as the fill value: h5py knows how
    runs: list[tuple[int, int, int]] = []
    for row, address in found:
        rows = min(chunk_rows, shape[0] - row)
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] * row_bytes == address and last[2] % chunk_rows == 0:
            runs[-1] = (last[0], last[1], last[2] + rows)
        else:
            runs.append((address, row, rows))
    return runs, row_bytes
