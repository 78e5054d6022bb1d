"""Checked reads: a chunk's size and crc32c are verified the first time a process reads it.

A flipped byte on disk or in a bucket used to be served as data. Every chunk ends in
the crc32c of its payload (docs/FORMAT.md); checking it needs the whole chunk, so it is done once
per chunk per process, on the first read that touches the chunk, and remembered (a forked worker
starts over). ``verify_reads`` (``FEATURESTORE_VERIFY_READS``) picks when:

* ``"auto"`` (default): on the first read of each chunk, except for local arrays read with
  ``cache="direct"`` (arrays larger than half the memory): there the check would read every chunk
  twice (whole for the crc, then the rows), since nothing stays cached; sizes are still checked.
* ``"first"``: on the first read of each chunk, always.
* ``"off"``: sizes only.

A split with ``block_seals`` is checked by row block instead (featurestore.core.reader_blocks:
a read checks exactly the blocks covering its rows, from the bytes it copies them out of);
:class:`Verified` then holds block numbers, in a set of their own.

Not caught, by design: bit rot after a chunk's first checked read. The check is once per chunk
per process, so a byte that flips later reaches a long-running process (a server, a loader) as
data until it restarts; ``featurestore verify`` finds it (docs/READS.md).

Cost (``featurestore bench read`` prints it; docs/READS.md): crc32c runs at ~10 GB/s here
(hardware instruction), so a page-cached first epoch pays about one extra pass over the bytes at
that speed, later epochs nothing; on a cold local store that fits the page cache, the whole-chunk
read that feeds the crc also caches the chunk, so the rows read after it are warm.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import crc32c as _crc32c
import numpy as np

from featurestore.core import open_files
from featurestore.core.buffers import BufferPool
from featurestore.errors import REPAIR_ADVICE
from featurestore.format.layout import CRC_BYTES

VERIFY_MODES = ("auto", "first", "off")


def check_files(paths: Sequence[str], payload_bytes: int, executor: Any = None,
                inspect: Callable[[int, memoryview], str | None] | None = None) -> list[str | None]:
    """Why each chunk file in ``paths`` is damaged (size or crc32c), or None, in order;
    FileNotFoundError if one is missing. ``inspect(k, chunk)``, given, is asked about each file
    whose crc32c is right (``chunk``: its bytes, trailer included): whether it is the chunk its
    position holds (the chunk cache checks a file against the split's seal for that position).

    The files are read concurrently, in ``_PIECE`` positional reads on ``executor`` (the read
    pool): on a cold store this whole-chunk read is the device read, and pieces on the pool's
    threads keep as many requests in flight as there are threads, where faulting a map in one
    thread per chunk kept one small read-ahead request each (a bag of a few chunks read cold ran
    at ~0.5x of the same bytes read in parallel pieces). Buffered reads: the pages stay
    cached for the gather that follows.

    Without ``inspect`` the pieces stream through a window of ``WINDOW`` piece buffers and the
    crc32c runs piece by piece in this thread while the pool reads the next ones: a chunk of
    hundreds of MiB (int8 splits have at least 128 rows a chunk) is neither held whole in memory
    (a fresh mapping faulted in per chunk) nor read before its crc starts. ``inspect`` needs the
    whole chunk: those are checked ``CHECK_BYTES`` at a time, in buffers of one pool."""
    group = open_files.per_read(open_files.descriptor_share())
    if len(paths) > group:
        return [reason for lo in range(0, len(paths), group) for reason in check_files(
            paths[lo : lo + group], payload_bytes, executor,
            None if inspect is None else lambda k, chunk, lo=lo: inspect(lo + k, chunk))]  # type: ignore[misc]
    if inspect is None:
        return _check_streamed(paths, payload_bytes, executor)
    return _check_buffered(paths, payload_bytes, executor, inspect)


def _open_checked(paths: Sequence[str], k: int, expected: int, reasons: list[str | None]) -> int | None:
    """``paths[k]`` opened if it has ``expected`` bytes; else its reason is set and None returned."""
    fd = os.open(paths[k], os.O_RDONLY)
    size = os.fstat(fd).st_size
    if size == expected:
        return fd
    os.close(fd)
    reasons[k] = f"size {size} bytes, expected {expected}" if size else "empty file"
    return None


def _check_streamed(paths: Sequence[str], payload_bytes: int, executor: Any) -> list[str | None]:
    reasons: list[str | None] = [None] * len(paths)
    expected = payload_bytes + CRC_BYTES
    fds: dict[int, int] = {}
    inflight: collections.deque[Any] = collections.deque()
    try:
        for k in range(len(paths)):
            fd = _open_checked(paths, k, expected, reasons)
            if fd is not None:
                fds[k] = fd
        pieces = [(k, lo) for k in fds for lo in range(0, expected, _PIECE)]
        window = min(WINDOW, len(pieces)) if executor is not None else 1
        slab = _pool().lease(max(1, window) * _PIECE)
        views = [memoryview(slab)[i * _PIECE:(i + 1) * _PIECE] for i in range(max(1, window))]

        def read(j: int) -> int:
            k, offset = pieces[j]
            view = views[j % window][: min(expected, offset + _PIECE) - offset]
            done = 0
            while done < len(view):
                got = os.preadv(fds[k], [view[done:]], offset + done)
                if got <= 0:  # the file shrank under us
                    return done
                done += got
            return done

        crcs = dict.fromkeys(fds, 0)
        trailers = {k: bytearray() for k in fds}
        for j in range(len(pieces)):
            if executor is None:
                got = read(j)
            else:
                while len(inflight) < window and j + len(inflight) < len(pieces):
                    inflight.append(executor.submit(read, j + len(inflight)))
                got = inflight.popleft().result()
            k, offset = pieces[j]
            size = min(expected, offset + _PIECE) - offset
            if reasons[k] is not None:
                continue
            if got < size:
                reasons[k] = "ended before its crc32c (truncated while reading)"
                continue
            view = views[j % window][:size]
            cut = max(0, min(size, payload_bytes - offset))
            crcs[k] = _crc32c.crc32c(view[:cut], crcs[k])
            trailers[k] += view[cut:]
            if offset + size == expected and crcs[k].to_bytes(CRC_BYTES, "little") != bytes(trailers[k]):
                reasons[k] = "crc32c mismatch (flipped or truncated bytes)"
        views.clear()  # back to the pool (the closure holds the list, not its views)
        del slab
    finally:
        for future in inflight:  # a read raised: none may still use a descriptor closed below
            future.cancel()
        futures.wait(inflight)
        for fd in fds.values():
            os.close(fd)
    return reasons


def _check_buffered(paths: Sequence[str], payload_bytes: int, executor: Any = None,
                inspect: Callable[[int, memoryview], str | None] | None = None) -> list[str | None]:
    """:func:`check_files` with ``inspect``: each chunk whole in a buffer, ``CHECK_BYTES`` of
    chunks at a time in buffers of one pool (the memory bounded whatever the number of chunks)."""
    reasons: list[str | None] = [None] * len(paths)
    expected = payload_bytes + CRC_BYTES
    per_group = max(1, CHECK_BYTES // expected)
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

            def read(piece: tuple[int, int]) -> bool:
                k, offset = piece
                view = memoryview(buffers[k])[offset : min(expected, offset + _PIECE)]
                while len(view):
                    got = os.preadv(fds[k], [view], offset)
                    if got <= 0:  # the file shrank under us
                        return False
                    view, offset = view[got:], offset + got
                return True

            whole = list(executor.map(read, pieces)) if executor is not None and len(pieces) > 1 \
                else [read(piece) for piece in pieces]  # fmt: skip
            short = {k for (k, _), ok in zip(pieces, whole) if not ok}
            for k, buffer in buffers.items():
                if k in short:
                    reasons[k] = "ended before its crc32c (truncated while reading)"
                elif _crc32c.crc32c(buffer[:payload_bytes]).to_bytes(CRC_BYTES, "little") != bytes(buffer[payload_bytes:]):
                    reasons[k] = "crc32c mismatch (flipped or truncated bytes)"
                elif inspect is not None:
                    reasons[k] = inspect(k, memoryview(buffer)[:expected])
            buffers.clear()  # back to the pool
        finally:
            for fd in fds.values():
                os.close(fd)
    return reasons


_PIECE = 1 << 20  # bytes per positional read of a chunk being checked
CHECK_BYTES = 64 << 20  # chunk bytes one call checks at once (the buffers it takes; one chunk if larger)
WINDOW = 32  # pieces a streamed check has read ahead of its crc32c (the pool's threads stay busy)
_POOL: BufferPool | None = None


def _pool() -> BufferPool:
    global _POOL
    if _POOL is None:
        _POOL = BufferPool(keep=8, max_free_bytes=CHECK_BYTES)
    return _POOL


def _after_fork_in_child() -> None:
    # A forked reader (a DataLoader worker) makes its own: a parent's read thread may have held the
    # pool's lock at the fork (its first checked read would wait for it forever), and its idle
    # buffers are the parent's pages.
    global _POOL
    _POOL = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def lease(nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` from the checked reads' pool (a block-checked read's blocks:
    featurestore.core.reader_blocks), back in the pool when dropped."""
    return _pool().lease(nbytes)


def release_buffers() -> None:
    """Unmap the idle buffers of checked reads (up to ``CHECK_BYTES``). A reader calls it once
    every chunk of its array is checked: the first epoch is over, and a long run would otherwise
    hold them to the end for checks that no longer come (another array's next check maps anew)."""
    if _POOL is not None:
        _POOL.clear()


class Verified:
    """Which chunks this process has verified (thread-safe; reset after a fork), and which are
    being verified now (:meth:`claim`): a loader's threads read several batches at once, and on a
    cold epoch they touch the same chunks; each chunk is read whole for its crc32c by one of them
    while the others wait for it, not once by each (an int8 split's chunks of hundreds of MiB
    were read and checked by every thread in flight)."""

    def __init__(self) -> None:
        self._done: set[int] = set()
        self._claims: dict[int, threading.Event] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _here(self) -> None:
        if self._pid != os.getpid():  # under the lock: a forked process verifies for itself
            self._done, self._claims, self._pid = set(), {}, os.getpid()

    def pending(self, chunks: Sequence[int]) -> list[int]:
        with self._lock:
            self._here()
            return [c for c in chunks if c not in self._done]

    def complete(self, total: int) -> bool:
        """Whether all ``total`` chunks of the array are verified in this process: a warm epoch's
        batches then skip the per-chunk bookkeeping (a set's size read without the lock)."""
        return len(self._done) >= total and self._pid == os.getpid()

    def claim(self, chunks: Sequence[int]) -> tuple[list[int], list[threading.Event]]:
        """Of ``chunks`` not verified yet: those the caller is now to verify (then :meth:`add`, or
        :meth:`release` if it could not), and the events of those another thread is verifying
        (wait, then claim again: a chunk the other thread failed on comes back to the caller)."""
        with self._lock:
            self._here()
            mine = [c for c in chunks if c not in self._done and c not in self._claims]
            theirs = list({id(e): e for c in chunks if c not in self._done and (e := self._claims.get(c))}.values())
            event = threading.Event()
            for c in mine:
                self._claims[c] = event
        return mine, theirs

    def release(self, chunks: Sequence[int]) -> None:
        """Give up the claim on ``chunks`` (their check raised): a waiting thread checks them."""
        with self._lock:
            for c in chunks:
                if (event := self._claims.pop(c, None)) is not None:
                    event.set()

    def add(self, chunks: Sequence[int], total: int | None = None) -> None:
        """Record ``chunks`` as checked (their claims, if any, end); once all ``total`` chunks
        of the array are, the process's idle check buffers go (:func:`release_buffers`)."""
        with self._lock:
            before = len(self._done)
            self._done.update(chunks)
            finished = total is not None and before < total <= len(self._done)
            for c in chunks:
                if (event := self._claims.pop(c, None)) is not None:
                    event.set()
        if finished:
            release_buffers()

    def all_of(self, total: int) -> bool:
        """Whether all ``total`` chunks (or blocks) are checked: the reads after the first
        epoch skip the per-read claim."""
        with self._lock:
            self._here()
            return len(self._done) >= total

    def __getstate__(self) -> dict[str, object]:
        return {}  # a new process verifies for itself

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__()  # type: ignore[misc]


def damage_message(where: str, reason: str) -> str:
    return f"{where} is damaged: {reason}. The store's bytes are not what was written: {REPAIR_ADVICE}"
