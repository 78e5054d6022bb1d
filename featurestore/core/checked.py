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

import os
import threading
from collections.abc import Sequence
from typing import Any

import crc32c as _crc32c

from featurestore.core.buffers import BufferPool
from featurestore.errors import REPAIR_ADVICE
from featurestore.format.layout import CRC_BYTES

VERIFY_MODES = ("auto", "first", "off")


def check_files(paths: Sequence[str], payload_bytes: int, executor: Any = None,
                into: Sequence[tuple[int, Any] | None] | None = None) -> list[str | None]:
    """Why each chunk file in ``paths`` is damaged (size or crc32c), or None, in order;
    FileNotFoundError if one is missing.

    ``into`` (one entry per path, or None): ``(start, view)`` lands payload bytes ``[start, start +
    len(view))`` of that chunk straight in ``view`` (a writable byte memoryview: the caller's
    output rows) instead of a scratch buffer, so a read that wants those bytes gets them from
    the same device read that is checked, with no second pass (issue 23: whole bags read cold).
    The crc32c runs over the scratch and the view in file order; on damage the view holds the
    damaged bytes and the caller must raise.

    The files are read concurrently, in ``_PIECE`` positional reads on ``executor`` (the read
    pool): on a cold store this whole-chunk read is the device read, and pieces on the pool's
    threads keep as many requests in flight as there are threads, where faulting a map in one
    thread per chunk kept one small read-ahead request each (a bag of a few chunks read cold ran
    at ~0.5x of the same bytes read in parallel pieces, issue 23). Buffered reads: the pages stay
    cached for the gather that follows. Chunks are checked ``_GROUP_BYTES`` at a time, in buffers
    of one pool, so the memory it takes is bounded whatever the number of chunks."""
    reasons: list[str | None] = [None] * len(paths)
    expected = payload_bytes + CRC_BYTES
    per_group = max(1, _GROUP_BYTES // expected)
    for first in range(0, len(paths), per_group):
        fds: dict[int, int] = {}
        try:
            for k in range(first, min(len(paths), first + per_group)):
                fd = os.open(paths[k], os.O_RDONLY)
                size = os.fstat(fd).st_size
                if size == expected:
                    fds[k] = fd
                else:
                    os.close(fd)
                    reasons[k] = f"size {size} bytes, expected {expected}" if size else "empty file"
            buffers = {k: _pool().lease(expected) for k in fds}
            pieces = [(k, lo) for k in fds for lo in range(0, expected, _PIECE)]
            targets = {k: into[k] for k in fds if into is not None and into[k] is not None}

            left = {k: -(-expected // _PIECE) for k in fds}  # pieces still to read, per chunk
            lock = threading.Lock()

            def read(piece: tuple[int, int]) -> None:
                k, offset = piece
                stop = min(expected, offset + _PIECE)
                while offset < stop:
                    got = os.preadv(fds[k], _segments(buffers[k], targets.get(k), offset, stop), offset)
                    if got <= 0:  # the file shrank under us
                        reasons[k] = "ended before its crc32c (truncated while reading)"
                        break
                    offset += got
                with lock:
                    left[k] -= 1
                    last = left[k] == 0
                if last and reasons[k] is None:  # the chunk's crc on the thread that read its last piece
                    buffer = buffers[k]          # (overlaps the other chunks' reads)
                    if _crc(buffer, targets.get(k), payload_bytes) != bytes(buffer[payload_bytes:expected]):
                        reasons[k] = "crc32c mismatch (flipped or truncated bytes)"

            if executor is not None and len(pieces) > 1:
                for _ in executor.map(read, pieces):
                    pass
            else:
                for piece in pieces:
                    read(piece)
            del buffers  # back to the pool
        finally:
            for fd in fds.values():
                os.close(fd)
    return reasons


def _segments(buffer: Any, target: tuple[int, Any] | None, lo: int, hi: int) -> list[Any]:
    """The buffers that file bytes ``[lo, hi)`` of a chunk go to: the scratch ``buffer``, except
    the payload range ``target`` sends to the caller's view."""
    if target is None:
        return [memoryview(buffer)[lo:hi]]
    start, view = target
    stop = start + len(view)
    out = []
    if lo < start:
        out.append(memoryview(buffer)[lo : min(hi, start)])
    if lo < stop and hi > start:
        out.append(view[max(lo, start) - start : min(hi, stop) - start])
    if hi > stop:
        out.append(memoryview(buffer)[max(lo, stop) : hi])
    return out


def _crc(buffer: Any, target: tuple[int, Any] | None, payload_bytes: int) -> bytes:
    """crc32c of a chunk's payload: the scratch ``buffer``, with ``target``'s range in its view."""
    if target is None:
        value = _crc32c.crc32c(buffer[:payload_bytes])
    else:
        start, view = target
        value = _crc32c.crc32c(buffer[:start])
        value = _crc32c.crc32c(view, value)
        value = _crc32c.crc32c(buffer[start + len(view) : payload_bytes], value)
    return int(value).to_bytes(CRC_BYTES, "little")


_PIECE = 1 << 20  # bytes per positional read of a chunk being checked
_GROUP_BYTES = 64 << 20  # chunk bytes checked at once (the buffers they take)
_POOL: BufferPool | None = None


def _pool() -> BufferPool:
    global _POOL
    if _POOL is None:
        _POOL = BufferPool(keep=8, max_free_bytes=_GROUP_BYTES)
    return _POOL


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
