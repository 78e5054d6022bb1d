"""Host buffers for reads: page-aligned arrays and one lease-based pool of recycled buffers.

:func:`aligned_empty` makes a fresh page-aligned output array. :class:`BufferPool` hands out
numpy arrays over recycled buffers with a *lease*: the buffer goes back to the pool when the last
view of the array handed out dies (numpy ``base`` chains and torch storages keep the lease alive),
so nobody has to call a ``release`` at the right moment, and a buffer that someone still holds can
never be rewritten under them. The loader (batches a probe may keep) and the server (responses
still being sent) both use it.

Fresh buffers are anonymous maps: a dropped one goes straight back to the OS (no malloc arena
growth: plain ``np.empty`` buffers of varying sizes fragmented glibc's heap and the server's RSS
climbed 43 -> 664 MiB under a mixed load), and on hosts with transparent huge pages in
``madvise`` mode they take 2 MiB pages, a few faults per batch instead of thousands. Torch-free.
"""

from __future__ import annotations

import collections
import mmap
import threading
from typing import Any

import numpy as np

PAGE = mmap.PAGESIZE


def aligned_empty(shape: tuple[int, ...], dtype: Any, alignment: int = PAGE) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``alignment`` boundary.

    Gathered rows come from page-aligned chunk maps; when the destination sits at another offset
    within a cache line (malloc returns large blocks at +16 bytes), the memcpy slows ~4x on the
    CPUs measured here (2.6 vs 10-12 GB/s for 192 KiB rows, ``featurestore bench read``). Page
    alignment puts source and destination rows at the same offsets whenever a sample's size is a
    multiple of 64 bytes, as it is for the usual widths (384, 768, 1024, 1536, 3072 channels);
    ``O_DIRECT`` reads need it too.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def anonymous(nbytes: int) -> np.ndarray:
    """A fresh page-aligned uint8 buffer of ``nbytes`` backed by its own anonymous map."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):  # not POSIX: plain heap memory, same semantics
        return aligned_empty((max(int(nbytes), 1),), np.uint8)
    mapped = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapped.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled or unsupported: small pages, same behaviour
            pass
    return np.frombuffer(mapped, np.uint8)


class BufferPool:
    """Recycled host buffers handed out with a lease (see the module docstring).

    ``keep`` bounds how many idle buffers stay and ``max_free_bytes`` their total size; anything
    beyond is dropped (unmapped) at once. A request takes the smallest idle buffer that holds it,
    but never one more than twice its size, so a small request cannot pin a large buffer.
    Requests below ``min_pooled`` bytes use the ordinary allocator (not worth a map).

    ``grow=True`` is for requests of varying size (the bags of a bag split): any idle buffer that
    holds a request serves it, a full pool drops its smallest idle buffer for a larger returning
    one, and new buffers are made a quarter octave larger than asked (:func:`grown_size`). The
    pool so converges on the few largest sizes and stops mapping (and page-faulting) new memory.
    """

    def __init__(self, keep: int = 2, max_free_bytes: int | None = None, min_pooled: int = 0,
                 grow: bool = False) -> None:
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self._free: list[np.ndarray] = []
        self._free_bytes = 0
        self._returned: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        self._keep = keep
        self._max_free = max_free_bytes
        self._min_pooled = min_pooled
        self._grow = grow

    @property
    def free_bytes(self) -> int:
        """Bytes of the idle buffers kept for reuse."""
        return self._free_bytes

    def lease(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` over a pooled, page-aligned buffer; the buffer returns to
        the pool when the last view of this array (numpy or torch) is gone."""
        nbytes = int(nbytes)
        if nbytes < self._min_pooled:
            return aligned_empty((nbytes,), np.uint8)
        buffer = None
        with self._lock:
            self._file_returned()
            best = -1
            for i, candidate in enumerate(self._free):
                if nbytes <= candidate.size and (self._grow or candidate.size <= 2 * max(nbytes, PAGE)) and (
                        best < 0 or candidate.size < self._free[best].size):
                    best = i
            if best >= 0:
                buffer = self._free.pop(best)
                self._free_bytes -= buffer.size
        if buffer is None:
            buffer = anonymous(grown_size(nbytes) if self._grow else nbytes)
        return np.asarray(_Lease(self, buffer, nbytes))

    def array(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A leased C-contiguous array of ``shape`` and ``dtype`` (see :meth:`lease`)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        return self.lease(count * dtype.itemsize).view(dtype).reshape(shape)

    def _give_back(self, buffer: np.ndarray) -> None:
        # Runs in a lease's __del__, which the garbage collector may run on a thread that holds
        # the lock already (in lease()): never wait for it. A buffer the lock's holder cannot
        # take now waits in _returned and is filed at the next lease.
        self._returned.append(buffer)
        if self._lock.acquire(blocking=False):
            try:
                self._file_returned()
            finally:
                self._lock.release()

    def _file_returned(self) -> None:
        while self._returned:  # under the lock
            self._file(self._returned.popleft())

    def _file(self, buffer: np.ndarray) -> None:
        if self._grow and len(self._free) >= self._keep and self._free:
            smallest = min(range(len(self._free)), key=lambda i: self._free[i].size)
            if self._free[smallest].size < buffer.size:
                self._free_bytes -= self._free.pop(smallest).size
        if len(self._free) < self._keep and (
                self._max_free is None or self._free_bytes + buffer.size <= self._max_free):
            self._free.append(buffer)
            self._free_bytes += buffer.size
        # otherwise the last reference goes with this frame: the map is unmapped now

    def clear(self) -> None:
        """Drop every idle buffer (leased ones come back, or not, as usual)."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
            self._free_bytes = 0


def grown_size(nbytes: int) -> int:
    """``nbytes`` rounded up to a quarter octave (at most +25 %), at least one page."""
    nbytes = max(int(nbytes), PAGE)
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


class _Lease:
    """The numpy base of one handed-out array: returns its buffer to the pool when collected."""

    def __init__(self, pool: BufferPool, buffer: np.ndarray, nbytes: int) -> None:
        self._pool = pool
        self._buffer = buffer
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "version": 3,
                                    "data": (buffer.ctypes.data, False)}

    def __del__(self) -> None:
        try:
            self._pool._give_back(self._buffer)
        except Exception:  # interpreter shutdown: nothing to recycle into
            pass
