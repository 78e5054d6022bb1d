"""Positional reads of rows from local chunk files: the local read path built for cold data.

A page fault on a memory map reads one small piece at a time, one fault after another, so a
shuffled epoch over a store larger than RAM ran at ~0.3x of what the disk gives to concurrent
reads. Here a gather is a list of ``os.preadv`` calls, one per run of rows that are
adjacent in a chunk file (a scatter read: each row goes straight to its own output slot), issued
concurrently from a small thread pool (``preadv`` releases the GIL), so the device queue stays full.

Rows already in the page cache are not sent to the pool: every read is first tried inline with
``RWF_NOWAIT`` (Linux >= 4.14), which copies cached bytes and refuses (``EAGAIN``, or a short
count) instead of waiting for the disk; only what is missing goes to the threads. A warm batch so
costs no thread hand-off, a cold one is read in parallel, and a half-cached one both at once.

``cache`` picks what the page cache does with the bytes (``docs/READS.md`` has the figures):
``"keep"`` (plain buffered reads), ``"drop"`` (``POSIX_FADV_DONTNEED`` on the chunks just read, so
an epoch over a store larger than RAM does not evict everything else) or ``"direct"``
(``O_DIRECT``: no page cache, no read-ahead of bytes nobody asked for; needs rows that are a
multiple of 4 KiB and falls back to buffered reads otherwise). ``"auto"`` (the default) is
``"direct"`` when the array is larger than half the memory this process may use (RAM, or its
memory cgroup's limit), where caching only evicts, and ``"keep"`` otherwise, so a store that fits
is cached by the first epoch and read warm by the next.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from featurestore.core.open_files import FileBudget, file_budget
from featurestore.errors import REPAIR_ADVICE, CorruptChunk, InvalidOption

CACHE_MODES = ("auto", "keep", "drop", "direct")
_IOV_MAX = 1024  # Linux's limit on buffers per preadv
_MAX_REQUEST = 8 << 20  # split long runs so one batch spreads over the threads
_DIRECT_ALIGN = 4096
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class ReadPool:
    """A small thread pool for positional reads, private to the process that made it.

    After a fork the child gets a fresh pool on first use (a forked copy of a pool has no threads),
    so DataLoader workers each read with their own. ``shutdown`` stops the threads.
    ``share_gathers``: a warm shuffled gather may take helpers from it (core.descriptor_reads);
    False for a pool whose callers already read concurrently (a loader's producers).
    """

    def __init__(self, threads: int = 8, *, share_gathers: bool = True) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise InvalidOption(f"read threads must be a positive integer, got {threads!r}")
        self.threads = threads
        self.share_gathers = share_gathers
        self._executor: ThreadPoolExecutor | None = None
        self._pid = -1
        self._lock = threading.RLock()  # a finalizer's shutdown may run inside executor()
        _POOLS.add(self)

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid():
                self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="featurestore-read")
                self._pid = os.getpid()
            return self._executor

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads; ``wait=False`` only tells them to stop (for a finalizer: it may run
        inside the garbage collector at any point, even in ``threading`` holding its own locks,
        where joining a thread deadlocks)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None and self._pid == os.getpid():
            executor.shutdown(wait=wait, cancel_futures=True)


_DEFAULT: ReadPool | None = None
_POOLS: weakref.WeakSet[ReadPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A thread that did not come along may have held a pool's lock (in executor(), which every
    # shared gather calls): the child's first read through that pool would wait for it forever.
    for pool in list(_POOLS):
        pool._lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_mincore: Any = None


def resident(address: int, nbytes: int) -> bool | None:
    """Whether every page of ``[address, address + nbytes)`` of a file map is in the page cache
    (``mincore``, one syscall; the pages need not be mapped in yet), or None where unknown."""
    pages = _residency(address, nbytes)
    return None if pages is None else pages.count(0) == 0


def resident_pages(address: int, nbytes: int) -> int | None:
    """How many pages of ``[address, address + nbytes)`` of a file map are in the page cache, as
    :func:`resident` asks; None where unknown."""
    pages = _residency(address, nbytes)
    return None if pages is None else pages.count(1)


def _residency(address: int, nbytes: int) -> bytearray | None:
    """``mincore``'s answer for the pages of the span, a byte each: 1 resident, 0 not."""
    global _mincore
    if _mincore is None:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _mincore = (libc.mincore, ctypes)
        except (OSError, AttributeError):
            _mincore = False
    if not _mincore or nbytes <= 0:
        return None
    call, ctypes = _mincore
    start = address - address % _PAGE
    length = address + nbytes - start
    pages = -(-length // _PAGE)
    vector = bytearray(pages)
    if call(start, length, (ctypes.c_char * pages).from_buffer(vector)) != 0:
        return None
    # Only the lowest bit of each byte means "resident"; counted in C, not per page in Python.
    return vector.translate(_LOWEST_BIT)


_LOWEST_BIT = bytes(i & 1 for i in range(256))


def sampled_cached(path: str, nbytes: int, probes: int = 16) -> bool | None:
    """Whether the first ``nbytes`` of ``path`` look page-cached: ``probes`` one-page reads spread
    over them with ``RWF_NOWAIT``, which refuses rather than wait for a disk; None where the kernel
    or the file system cannot say. For files whose ``mincore`` answer is untruthful (a file this
    process may not write: ``mapped_file.mincore_truthful``), at ~2 us a probe."""
    if not _NOWAIT or nbytes <= 0:
        return None
    step = max(_PAGE, nbytes // probes // _PAGE * _PAGE)
    fd = os.open(path, os.O_RDONLY)
    try:
        return _read_without_waiting(fd, [(offset, min(_PAGE, nbytes - offset)) for offset in range(0, nbytes, step)])
    finally:
        os.close(fd)


def cached_now(path: str, inode: int, rows: list[int], width: int) -> bool | None:
    """Whether rows ``rows`` (ascending) of ``width`` bytes from the start of ``path`` (still inode
    ``inode``) are all in the page cache now: one ``RWF_NOWAIT`` read per run of adjacent rows,
    which copies cached bytes and refuses (or stops short) at the first missing page. For files
    whose ``mincore`` answer is untruthful, where :func:`resident` cannot tell; None where the
    kernel or the file system cannot say either. Costs a copy of the rows (~20 us for 192 KiB)."""
    if not _NOWAIT or not rows or width <= 0:
        return None
    spans, start = [], 0
    for end in range(1, len(rows) + 1):
        if end == len(rows) or rows[end] > rows[end - 1] + 1:
            spans.append((rows[start] * width, (rows[end - 1] - rows[start] + 1) * width))
            start = end
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_ino != inode:  # replaced since it was mapped: not the map's pages
            return False
        return _read_without_waiting(fd, spans)
    finally:
        os.close(fd)


_SCRATCH = threading.local()


def _read_without_waiting(fd: int, spans: list[tuple[int, int]]) -> bool | None:
    """Whether every ``(offset, nbytes)`` span of ``fd`` reads in full with ``RWF_NOWAIT`` (into a
    scratch buffer of this thread): False at the first span that would wait, None where the file
    system does not offer it."""
    for offset, nbytes in spans:
        scratch = getattr(_SCRATCH, "buffer", None)
        if scratch is None or len(scratch) < nbytes:
            scratch = _SCRATCH.buffer = bytearray(max(nbytes, 1 << 20))
        try:
            if os.preadv(fd, [memoryview(scratch)[:nbytes]], offset, _NOWAIT) < nbytes:
                return False
        except BlockingIOError:
            return False
        except OSError:  # RWF_NOWAIT not offered here (EOPNOTSUPP, EINVAL)
            return None
    return True


def default_pool() -> ReadPool:
    """The process's shared pool (``FEATURESTORE_READ_THREADS``, default 8)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ReadPool(int(os.environ.get("FEATURESTORE_READ_THREADS", "8")))
    return _DEFAULT


def memory_limit() -> int:
    """Bytes of memory this process may use: RAM, or its memory cgroup's limit when lower."""
    limit = os.sysconf("SC_PHYS_PAGES") * _PAGE if hasattr(os, "sysconf") else 1 << 62
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            candidates = [os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.max")]
        elif "memory" in controllers.split(","):
            candidates = [os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), "memory.limit_in_bytes")]
        else:
            continue
        for name in candidates:
            try:
                with open(name) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit():
                limit = min(limit, int(text))
    return limit


def resolve_cache(cache: str, array_bytes: int) -> str:
    """``"auto"`` -> ``"direct"`` for arrays larger than half of :func:`memory_limit`, else ``"keep"``."""
    if cache != "auto":
        return cache
    return "direct" if array_bytes > memory_limit() // 2 else "keep"


class _Read:
    """One positional read: ``nbytes`` at ``offset`` of one chunk file into a list of buffers."""

    __slots__ = ("chunk", "offset", "buffers", "nbytes")

    def __init__(self, chunk: int, offset: int, buffers: list[memoryview], nbytes: int) -> None:
        self.chunk, self.offset, self.buffers, self.nbytes = chunk, offset, buffers, nbytes

    def advance(self, done: int) -> None:
        """Drop the first ``done`` bytes (a short read continues where it stopped)."""
        self.offset += done
        self.nbytes -= done
        while done and self.buffers:
            head = self.buffers[0]
            if len(head) <= done:
                done -= len(head)
                self.buffers.pop(0)
            else:
                self.buffers[0] = head[done:]
                done = 0


def plan_reads(index: np.ndarray, rows: np.ndarray, chunk_rows: int) -> tuple[list[_Read], np.ndarray, np.ndarray]:
    """The reads that fill ``rows`` (uint8 ``[n, sample_nbytes]``) with rows ``index``, and the
    (source, target) output positions of duplicates, copied after the reads."""
    sample_nbytes = rows.shape[1]
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    first = np.ones(len(ordered), bool)
    first[1:] = ordered[1:] != ordered[:-1]
    # A duplicate copies the output row of the first occurrence of its value.
    first_pos = np.maximum.accumulate(np.where(first, np.arange(len(ordered)), 0))
    dup_targets = order[~first]
    dup_sources = order[first_pos[~first]]
    unique, targets = ordered[first], order[first]
    chunk_of, offset = np.divmod(unique, chunk_rows)
    breaks = np.flatnonzero((np.diff(chunk_of) != 0) | (np.diff(offset) != 1)) + 1
    bounds = np.concatenate(([0], breaks, [len(unique)])).tolist()
    per_request = max(1, min(_IOV_MAX, _MAX_REQUEST // max(sample_nbytes, 1)))
    target_list, chunk_list, offset_list = targets.tolist(), chunk_of.tolist(), offset.tolist()
    flat = memoryview(rows.reshape(-1))
    reads: list[_Read] = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        for a in range(start, stop, per_request):
            b = min(stop, a + per_request)
            buffers: list[memoryview] = []
            run_start = prev = target_list[a]
            for t in target_list[a + 1 : b]:  # rows adjacent in the output share one buffer
                if t != prev + 1:
                    buffers.append(flat[run_start * sample_nbytes : (prev + 1) * sample_nbytes])
                    run_start = t
                prev = t
            buffers.append(flat[run_start * sample_nbytes : (prev + 1) * sample_nbytes])
            reads.append(_Read(chunk_list[a], offset_list[a] * sample_nbytes, buffers, (b - a) * sample_nbytes))
    return reads, dup_sources, dup_targets


class ChunkFiles:
    """Open file descriptors of one array's chunk files for one gather (closed by ``close``).

    Each file's size is checked on open: a truncated chunk fails here, naming the file, instead
    of leaving zeros or stale bytes in the output. Every descriptor is one of the process's
    ``budget`` (:mod:`featurestore.core.open_files`), so a gather over thousands of chunk files
    never holds thousands of descriptors; ``has_room`` says when the caller must first finish
    and ``close`` what it holds.
    """

    def __init__(self, path_of: Callable[[int], str], expected_size: int, direct: bool,
                 budget: FileBudget | None = None) -> None:
        self._path_of = path_of
        self._expected = expected_size
        self._direct = direct
        self._budget = budget or file_budget()
        self.fds: dict[int, int] = {}
        self._reserved = False

    def has_room(self) -> bool:
        """Reserve one descriptor for the next ``open`` without waiting; False when none is free."""
        if not self._reserved:
            self._reserved = self._budget.try_take()
        return self._reserved

    def open(self, chunk: int) -> int:
        fd = self.fds.get(chunk)
        if fd is not None:
            return fd
        if not self._reserved:  # hold none while waiting (see FileBudget)
            self._budget.take()
        self._reserved = False
        try:
            fd = self._open(self._path_of(chunk))
        except BaseException:
            self._budget.give()
            raise
        self.fds[chunk] = fd
        return fd

    def _open(self, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY | (_O_DIRECT if self._direct else 0))
        except FileNotFoundError:
            raise  # the reader names the chunk and says what to do, by the split's status
        except OSError:
            if not self._direct:
                raise
            fd = os.open(path, os.O_RDONLY)  # this filesystem refuses O_DIRECT: buffered reads
        size = os.fstat(fd).st_size
        if size != self._expected:
            os.close(fd)
            raise CorruptChunk(f"chunk file {path} has {size} bytes, expected {self._expected} (truncated or "
                               f"overwritten): {REPAIR_ADVICE}")
        return fd

    def close(self, drop_cache: bool = False) -> None:
        """Close every descriptor (``drop_cache``: after ``POSIX_FADV_DONTNEED`` on its file)."""
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            if drop_cache:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass  # advice only: the bytes read are right either way
            os.close(fd)
            self._budget.give()
        if self._reserved:
            self._budget.give()
            self._reserved = False


def _read_blocking(fd: int, read: _Read, path_of: Callable[[int], str]) -> None:
    while read.nbytes > 0:
        done = os.preadv(fd, read.buffers, read.offset)
        if done <= 0:  # end of file before the row's end: the file shrank under us
            raise CorruptChunk(f"chunk file {path_of(read.chunk)} ended before byte {read.offset + read.nbytes} "
                               f"(truncated while reading): {REPAIR_ADVICE}")
        read.advance(done)


def gather(
    index: np.ndarray,
    rows: np.ndarray,
    *,
    chunk_rows: int,
    path_of: Callable[[int], str],
    expected_size: int,
    pool: ReadPool | None = None,
    cache: str = "keep",
) -> dict[str, int]:
    """(``cache`` is resolved by the caller: "keep", "drop" or "direct".)"""
    """Fill ``rows`` (uint8 ``[len(index), sample_nbytes]``) with rows ``index`` of the chunk
    files ``path_of(chunk)``; returns counts of reads served inline (cached) and by the pool."""
    if cache not in CACHE_MODES[1:]:
        raise InvalidOption(f"cache must be one of {', '.join(CACHE_MODES)}, got {cache!r}")
    sample_nbytes = rows.shape[1]
    direct = cache == "direct" and _O_DIRECT != 0 and sample_nbytes % _DIRECT_ALIGN == 0 \
        and rows.ctypes.data % _DIRECT_ALIGN == 0
    reads, dup_sources, dup_targets = plan_reads(index, rows, chunk_rows)
    files = ChunkFiles(path_of, expected_size, direct)
    futures: list[Future[Any]] = []
    inline = pooled = 0
    try:
        executor = (pool or default_pool()).executor()
        for read in reads:  # in storage order: each chunk file is opened once
            if read.chunk not in files.fds and files.fds and not files.has_room():
                # The process's descriptors are all taken: finish and close what this gather
                # holds, then wait for one (a waiting gather holds none).
                pooled += _finish(futures)
                files.close(drop_cache=cache == "drop")
            fd = files.open(read.chunk)
            if _NOWAIT and not direct:
                try:
                    done = os.preadv(fd, read.buffers, read.offset, _NOWAIT)
                except BlockingIOError:  # not cached: the disk is needed, a thread waits for it
                    done = 0
                if done >= read.nbytes:
                    inline += 1
                    continue
                read.advance(done)
            futures.append(executor.submit(_read_blocking, fd, read, path_of))
        pooled += _finish(futures)
        # "drop": these rows are not read again this epoch: do not let them evict others.
        files.close(drop_cache=cache == "drop")
    finally:
        for future in futures:
            future.cancel()
        if futures:
            wait(futures)  # no thread still reads through a descriptor closed below
        files.close()
    if len(dup_targets):
        rows[dup_targets] = rows[dup_sources]
    return {"inline": inline, "pool": pooled}


def _finish(futures: list[Future[Any]]) -> int:
    """Wait for every submitted read (all done writing into the output), raise the first
    failure in the caller, and empty the list; returns how many there were."""
    if futures:
        wait(futures)
        for future in futures:
            future.result()
    count = len(futures)
    futures.clear()
    return count
