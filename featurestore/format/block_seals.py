"""``block_seals``: a crc32c per row block of every features chunk, so a read checks only the bytes
it reads (docs/FORMAT.md, "Block seals").

A chunk's crc32c trailer needs the whole chunk: an int8 chunk of hundreds of MiB read whole to
deliver a few rows. A dense split written since block seals exist also has the plain Zarr v3 array
``<split>/block_seals`` (uint32, shape ``[n_chunks, blocks_per_chunk]``, one chunk per row, in
featurestore's own chunk encoding): a block is ``block_rows`` whole rows of a features chunk's
payload (about ``BLOCK_BYTES``, one row if a row is bigger; the chunk's last block may be shorter),
and row ``c`` holds the *running* crc32c of chunk ``c`` at the end of each block:
``seals[c, j] = crc32c(payload[:end_j])``. One pass of the writer gives them all, the last one is
the chunk's trailer (the link to ``chunk_seals``), and block ``j`` alone is checked with
``crc32c(block_j, seals[c, j - 1] if j else 0) == seals[c, j]``. Older readers never open the
array; splits without it are read with the whole-chunk check.
"""

from __future__ import annotations

import crc32c as _crc32c
import numpy as np

BLOCK_SEALS = "block_seals"
BLOCK_BYTES = 1 << 20  # about this many payload bytes a block (whole rows)


def block_rows(sample_nbytes: int, chunk_rows: int) -> int:
    """Rows of one block: whole rows, about ``BLOCK_BYTES``, one if a row is bigger."""
    return max(1, min(int(chunk_rows), BLOCK_BYTES // max(1, int(sample_nbytes))))


def blocks_per_chunk(chunk_rows: int, rows_per_block: int) -> int:
    return -(-int(chunk_rows) // int(rows_per_block))


def running_crcs(payload: memoryview | bytes, block_nbytes: int) -> np.ndarray:
    """The running crc32c of ``payload`` at the end of each block of ``block_nbytes`` bytes
    (uint32; the last one is the crc32c of the whole payload: the chunk's trailer)."""
    view = memoryview(payload).cast("B")
    count = max(1, -(-len(view) // block_nbytes))
    out = np.empty(count, np.uint32)
    crc = 0
    for j in range(count):
        crc = _crc32c.crc32c(view[j * block_nbytes : (j + 1) * block_nbytes], crc)
        out[j] = crc
    return out


def block_ok(data: memoryview | bytes, row: np.ndarray, j: int) -> bool:
    """Whether ``data`` is block ``j`` of the chunk whose running crcs are ``row``."""
    return _crc32c.crc32c(data, int(row[j - 1]) if j else 0) == int(row[j])


def damaged_blocks(payload: memoryview | bytes, row: np.ndarray, block_nbytes: int) -> list[int]:
    """The blocks of a whole chunk's ``payload`` that do not match ``row`` (each against its own
    seal: a flipped byte names one block)."""
    view = memoryview(payload).cast("B")
    return [j for j in range(len(row))
            if not block_ok(view[j * block_nbytes : (j + 1) * block_nbytes], row, j)]


def block_span(j: int, rows_per_block: int, chunk_rows: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of its chunk that block ``j`` holds."""
    return j * rows_per_block, min(chunk_rows, (j + 1) * rows_per_block)
