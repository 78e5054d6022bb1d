"""Shuffled rows read through the chunk files' descriptors, vectorized; a large gather shared with
the read pool's threads (:func:`share`: these reads, or a copy out of the maps a chunk at a time).

A gather of shuffled rows reads them with ``preadv`` (nothing mapped in, so nothing added to the
process's RSS; core.chunk_maps). The kernel's copy out of the page cache runs ~14 GB/s on one core
of the 2-core test host and ~22 GB/s on two ([256, 384] float16 rows, 64 shuffled a batch), where
an ``np.memmap`` gather of the same rows, all mapped in already, copies ~19 GB/s in one thread. So
the per-row work is made in numpy passes (a row's Python steps, ~3.5 us, were a fifth of its
copy), and a large gather is shared with the pool's threads: this one starts at once, the others
join as they wake, each taking the next row as it gets free.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence

import numpy as np

from featurestore.core import pread
from featurestore.core.mapped_file import Descriptor, read_into

#: A gather is shared with another thread from this many bytes a thread. Not by row count: 256
#: rows of 2 KiB on two threads measured no faster (each row's system call, ~1.7 us here, needs
#: the interpreter on its way out).
PIECE_BYTES = 2 << 20


def read_rows(rows: np.ndarray, targets: np.ndarray, files: Sequence[tuple[Descriptor, str]], file_of: np.ndarray,
              offsets: np.ndarray, check_size: Callable[[str, int], None], pool: pread.ReadPool | None) -> None:
    """``rows[targets[i]]`` (``rows``: C-contiguous ``[n, row bytes]`` uint8) from byte
    ``offsets[i]`` of ``files[file_of[i]]`` (its descriptor, held open by ``files``, and path),
    shared with ``pool``'s threads (:func:`share`). A file that ends first is refused by
    ``check_size`` (:func:`mapped_file.read_into`)."""
    width = rows.shape[1]
    flat = memoryview(rows).cast("B")
    fd_of = [descriptor.fd for descriptor, _ in files]
    fds = [fd_of[k] for k in file_of.tolist()]
    buffers = [flat[start : start + width] for start in (targets * width).tolist()]
    places = offsets.tolist()
    preadv = os.preadv

    def read(i: int) -> None:
        if preadv(fds[i], [buffers[i]], places[i]) != width:  # short: the whole of it again, or why not
            descriptor, path = files[int(file_of[i])]
            read_into(descriptor, buffers[i], places[i], path, check_size)  # type: ignore[arg-type]

    share(read, len(buffers), len(buffers) * width, pool)


def read_runs(rows: np.ndarray, runs: Sequence[tuple[int, int, int, int]], files: Sequence[tuple[Descriptor, str]],
              file_of: dict[int, int], check_size: Callable[[str, int], None], pool: pread.ReadPool | None) -> None:
    """Runs ``(chunk, first row in it, first output row, length)`` into ``rows`` from
    ``files[file_of[chunk]]``, a ``preadv`` per :data:`PIECE_BYTES` of a run, the pieces shared
    with ``pool``'s threads (:func:`share`)."""
    width = rows.shape[1]
    flat, step = memoryview(rows).cast("B"), max(1, PIECE_BYTES // width)
    pieces = [(file_of[chunk], (first + at) * width, (target + at) * width, min(step, length - at) * width)
              for chunk, first, target, length in runs for at in range(0, length, step)]
    preadv = os.preadv

    def read(i: int) -> None:
        k, offset, start, nbytes = pieces[i]
        buffer = flat[start : start + nbytes]
        if preadv(files[k][0].fd, [buffer], offset) != nbytes:  # short: the whole of it again, or why not
            read_into(files[k][0], buffer, offset, files[k][1], check_size)  # type: ignore[arg-type]

    share(read, len(pieces), sum(piece[3] for piece in pieces), pool)


def share(work: Callable[[int], None], count: int, nbytes: int, pool: pread.ReadPool | None) -> None:
    """``work(i)`` for each ``i`` in ``range(count)`` (``nbytes`` in all), each thread taking the
    next ``i`` as it gets free: this one from the start, helpers from ``pool`` (the default pool's)
    joining as they wake, one per :data:`PIECE_BYTES`, at most one per core (none when the pool
    does not share gathers). Returns once every item is done and no helper runs (none writes into
    the caller's rows after), raising the first error."""
    pool = pool or pread.default_pool()
    helpers = min(nbytes // PIECE_BYTES, cores(), pool.threads, count) - 1 if pool.share_gathers else 0
    taken = itertools.count()  # each next() is atomic

    def run() -> None:
        for i in taken:
            if i >= count:
                return
            work(i)

    if helpers < 1:
        run()
        return
    # The helpers join as they wake (tens of microseconds on a VM). This thread does every item no
    # helper took, so a helper still queued when it is done (a busy pool) is cancelled instead of
    # waited for, and one the pool would not take (shut down meanwhile) is not needed: only one
    # that started can be writing into rows, and it is waited for.
    # A cancelled helper stays in the pool's queue until a thread pops it: it reaches the work (and
    # the descriptors it holds open) only through this cell, emptied on the way out.
    cell = [run]

    def helper() -> None:
        if cell:
            cell[0]()

    futures = []
    try:
        executor = pool.executor()
        for _ in range(helpers):
            futures.append(executor.submit(helper))
    except RuntimeError:  # the pool shut down meanwhile: this thread goes on with what it took
        pass
    try:
        run()
    finally:
        errors = [None if future.cancel() else future.exception() for future in futures]
        cell.clear()
    for error in errors:
        if error is not None:
            raise error


def cores() -> int:
    """CPUs this process may run on (its affinity: a container's or a job's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
