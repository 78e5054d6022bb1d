"""Checked reads: a chunk's size and crc32c are verified the first time a process reads it.

A flipped byte on disk or in a bucket used to be served as data (issue 12.4). Every chunk ends in
the crc32c of its payload (docs/FORMAT.md); checking it needs the whole chunk, so it is done once
per chunk per process, on the first read that touches the chunk, and remembered (a forked worker
starts over). ``verify_reads`` (``FEATURESTORE_VERIFY_READS``) picks when:

* ``"auto"`` (default): on the first read of each chunk, except for local arrays read with
  ``cache="direct"`` (arrays larger than half the memory): there the check would read every chunk
  twice (whole for the crc, then the rows), since nothing stays cached; sizes are still checked.
* ``"first"``: on the first read of each chunk, always.
* ``"off"``: sizes only.

Not caught, by design: bit rot after a chunk's first checked read. The check is once per chunk
per process, so a byte that flips later reaches a long-running process (a server, a loader) as
data until it restarts; ``featurestore verify`` finds it (docs/READS.md).

Cost (``featurestore bench read`` prints it; docs/READS.md): crc32c runs at ~10 GB/s here
(hardware instruction), so a page-cached first epoch pays about one extra pass over the bytes at
that speed, later epochs nothing; on a cold local store that fits the page cache, the whole-chunk
read that feeds the crc also caches the chunk, so the rows read after it are warm.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence

import crc32c as _crc32c

from featurestore.errors import REPAIR_ADVICE
from featurestore.format.layout import CRC_BYTES

VERIFY_MODES = ("auto", "first", "off")
_SLICE = 16 << 20  # crc over a map in slices: no copy of the chunk, bounded page-table work per call


def check_file(path: str, payload_bytes: int) -> str | None:
    """Why the chunk file at ``path`` is damaged (size or crc32c), or None; FileNotFoundError if
    it is missing. Reads through a memory map, so nothing is copied and the pages stay cached."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != payload_bytes + CRC_BYTES:
            return f"size {size} bytes, expected {payload_bytes + CRC_BYTES}"
        if size == 0:
            return "empty file"
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        if hasattr(mmap, "MADV_SEQUENTIAL"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)  # large read-ahead for the one pass
        view = memoryview(mapped)
        try:
            value = 0
            for start in range(0, payload_bytes, _SLICE):
                value = _crc32c.crc32c(view[start : min(payload_bytes, start + _SLICE)], value)
            stored = bytes(view[payload_bytes:])
        finally:
            view.release()
    finally:
        mapped.close()
    if value.to_bytes(CRC_BYTES, "little") != stored:
        return "crc32c mismatch (flipped or truncated bytes)"
    return None


class Verified:
    """Which chunks this process has verified (thread-safe; reset after a fork)."""

    def __init__(self) -> None:
        self._done: set[int] = set()
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def pending(self, chunks: Sequence[int]) -> list[int]:
        with self._lock:
            if self._pid != os.getpid():
                self._done, self._pid = set(), os.getpid()
            return [c for c in chunks if c not in self._done]

    def add(self, chunks: Sequence[int]) -> None:
        with self._lock:
            self._done.update(chunks)

    def __getstate__(self) -> dict[str, object]:
        return {}  # a new process verifies for itself

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]


def damage_message(where: str, reason: str) -> str:
    return f"{where} is damaged: {reason}. The store's bytes are not what was written: {REPAIR_ADVICE}"


def run_checks(pending: Sequence[int], check: Callable[[int], str | None], executor: object | None) -> dict[int, str]:
    """``check(chunk)`` for every pending chunk (concurrently on ``executor`` when given);
    {chunk: reason} of the damaged ones."""
    if executor is not None and len(pending) > 1:
        results = list(executor.map(check, pending))  # type: ignore[attr-defined]
    else:
        results = [check(c) for c in pending]
    return {c: r for c, r in zip(pending, results) if r is not None}
