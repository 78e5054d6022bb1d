"""Whether a read of a :class:`~featurestore.core.reader.FeatureArray` needs nothing but memory.

A server hands each read to a worker thread, so that one waiting on a disk does not stall every
other request. For a single page-cached item that hand-over (two thread wake-ups) costs more than
the read itself, so the server answers on its event loop the reads that provably cannot wait
(``server/on_loop.py``). A read is one when every step of the local ``mmap`` path is already done
or in memory: the chunks' maps made, their bytes checked by this process (crc32c or block seals),
an int8 split's scales loaded, and the rows' pages in the page cache now.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.core import chunk_maps, quantize_int8


class MemoryPath:
    """The in-memory test's part of ``FeatureArray``."""

    # Provided by FeatureArray.
    path: str
    local_read: str
    chunk_rows: int
    scales: quantize_int8.ScalesTable | None
    _pid: int
    _blocks: Any
    _verified: Any
    _verified_blocks: Any
    _maps: chunk_maps.ArrayMaps | None

    # FeatureArray's (declared, not defined: no stub may shadow them in the method order)
    _checks_reads: Callable[[str], bool]
    __len__: Callable[[], int]

    def in_memory(self, index: np.ndarray) -> bool:
        """Whether reading rows ``index`` (an int64 array) now would open no file, check no chunk
        and read no byte from a disk: local chunk files this array has mapped, every chunk (or
        block) the rows lie in checked already, an int8 split's scales loaded, and every page of
        the rows in the page cache. False whenever it cannot tell (then the read may wait)."""
        maps = self._maps
        if (self.path != "mmap" or self.local_read == "pread" or maps is None or os.getpid() != self._pid
                or not len(index) or (self.scales is not None and not self.scales.loaded)):  # fmt: skip
            return False
        if int(index.min()) < 0 or int(index.max()) >= len(self):
            return False
        rows = self.chunk_rows
        ordered = (index if len(index) == 1 else np.sort(index)).tolist()
        chunk_of = [row // rows for row in ordered]
        if not self._checked_already(chunk_of, ordered):
            return False
        start = 0
        for end in range(1, len(ordered) + 1):  # one test per chunk it touches
            if end == len(ordered) or chunk_of[end] != chunk_of[start]:
                if not maps.in_memory(chunk_of[start], [row % rows for row in ordered[start:end]]):
                    return False
                start = end
        return True

    def _checked_already(self, chunk_of: list[int], ordered: list[int]) -> bool:
        """Whether the first-read check (featurestore.core.checked) has nothing left to do for the
        rows ``ordered`` (ascending) in chunks ``chunk_of``."""
        if not self._checks_reads("mmap"):
            return True
        blocks = self._blocks
        if blocks is None:  # not decided yet: the first read loads the block seals
            return False
        if blocks is False:  # whole chunks are checked
            return not self._verified.pending(sorted(set(chunk_of)))
        per_block = blocks.block_rows
        units = {c * blocks.per_chunk + (row % self.chunk_rows) // per_block for c, row in zip(chunk_of, ordered)}
        return not self._verified_blocks.pending(sorted(units))
