"""``featurestore verify``'s check of a split's ``block_seals`` (featurestore.core.block_seals),
for every kind that has them (uncompressed dense splits, bag splits): the table checked as an
array, each valid features chunk against its row, and a damaged chunk's damaged blocks named
(the rows a read refuses; the rest of the chunk reads fine)."""

from __future__ import annotations

import numpy as np

from featurestore.core import block_seals
from featurestore.core.array_check import Expected, check_array
from featurestore.core.split_kind import Findings
from featurestore.core.storage import Storage
from featurestore.format import layout
from featurestore.format.block_seals import BLOCK_SEALS
from featurestore.format.metadata import SplitMetadata


def table(storage: Storage, key: str, meta: SplitMetadata, found: Findings) -> np.ndarray | None:
    """The split's ``block_seals`` values, checked as an array; None where it has none (written
    before them, or compressed) or they are damaged (then in ``found``)."""
    if meta.compressor is not None or not storage.exists(f"{key}/{BLOCK_SEALS}/{layout.ZARR_JSON}"):
        return None
    _, per_chunk, _ = block_seals.expected_shape(meta)
    spec = Expected([meta.num_chunks, per_chunk], "uint32", np.dtype(np.uint32), 1)
    return check_array(storage, key, BLOCK_SEALS, spec, found, keep=True)


class RowChecks:
    """Valid features chunks checked against their block seals rows. A mismatch is reported after
    the ``chunk_seals`` check, and only for a chunk it found in its place: a chunk swapped or
    copied from another run mismatches its row too, and the table's line says what happened."""

    def __init__(self, blocks: np.ndarray | None, meta: SplitMetadata) -> None:
        self._blocks = blocks
        self._meta = meta
        self._stale: dict[int, str] = {}

    def check(self, index: int, raw: bytes) -> None:
        if self._blocks is not None and (damaged := block_seals.block_problems(raw, self._blocks[index], self._meta, index)):
            self._stale[index] = damaged[0]

    def report(self, key: str, found: Findings) -> None:
        ndim = 1 + len(self._meta.sample_shape)
        for index, block in sorted(self._stale.items()):
            where = f"{layout.chunk_key(f'{key}/{layout.FEATURES}', index, ndim)}"
            if not any(where in problem for problem in found.problems):
                found.problems.append(f"{where}: its crc32c is valid, but {block} does not match its block seal: "
                                      f"{BLOCK_SEALS} is not this chunk's")


def name_damaged_blocks(storage: Storage, key: str, meta: SplitMetadata, found: Findings,
                        blocks: np.ndarray | None, bad: set[int]) -> None:
    """Each damaged features chunk's line (``bad``: their indices) extended by its damaged blocks.
    A damaged chunk is read again here rather than kept from the array check, so that a verify of
    a badly damaged split holds one chunk at a time, not every damaged one."""
    if blocks is None:
        return
    ndim = 1 + len(meta.sample_shape)
    for index in sorted(c for c in bad if c < meta.num_chunks):
        try:
            raw = storage.read(layout.chunk_key(f"{key}/{layout.FEATURES}", index, ndim))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            continue  # reported missing
        where = f"{layout.chunk_key(f'{key}/{layout.FEATURES}', index, ndim)}: "
        damaged = block_seals.block_problems(raw, blocks[index], meta, index)
        line = next((k for k, p in enumerate(found.problems) if p.startswith(where) and "crc32c mismatch" in p), None)
        if damaged and line is not None:  # the chunk's one line names its damaged blocks
            found.problems[line] += f" in {'; '.join(damaged)}"
