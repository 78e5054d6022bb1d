"""Chunk puts off the caller's thread: crc32c and the atomic put of each chunk in a small pool.

Chunks are independent keys, so a few threads write them concurrently (``write``/``crc32c``
release the GIL) while the caller prepares the next batch. Within a chunk, the last array (the
features chunk of a dense split, the record of a bag segment: its presence with a valid crc32c
proves the chunk done) is put only once every other put of the chunk has landed, which is the
order crash safety rests on. Those others (labels, statistics row, int8 scales, the block seals
row) are independent objects. On object storage (a storage that hints ``put_threads``: its puts
wait on the network) they go out together, on a few side threads beside the put thread: each put
is a round trip, so a chunk costs two of them on its put thread's path whatever its number of
arrays. On a local disk a small put is a few syscalls with nothing to overlap, so they go one
after another, without thread handoffs. At most ``max_pending`` chunks are in flight; ``submit`` waits for
a free slot beyond that, which bounds the host memory the pool holds.

The first failure stops the pool: chunks not yet started are skipped (a resume rewrites them),
and the error is raised by the next ``submit`` or ``wait``; a chunk whose early puts failed never
puts its last array, and reports the failure only once all of its early puts have settled (none
lands after the writer gave up, beside what a resume writes). A full disk becomes one
:class:`~featurestore.errors.StorageFull` line naming the store and what to do.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from functools import partial

import numpy as np

from featurestore.core import block_seals
from featurestore.core.storage import Storage
from featurestore.errors import ReadOnlyStore, StorageFull
from featurestore.format import chunks, layout

# (array name, rows, compressor) of one put; rows are padded to the full chunk shape already.
Put = tuple[str, np.ndarray, "str | None"]

# Side threads per put thread: a chunk's early puts beyond the one its put thread makes itself
# (labels, statistics row, int8 scales, block seals row: at most three more).
SIDE_PER_WORKER = 3


def default_workers(storage: Storage | None = None) -> int:
    """``FEATURESTORE_PUT_THREADS``, else the storage's own hint (object storage: puts wait on the
    network, not the CPU, so more are in flight), else min(4, cores): page-cache writes are
    memcpy-bound per thread, so a few threads reach a disk's rate; more only add contention."""
    value = os.environ.get("FEATURESTORE_PUT_THREADS")
    if value is not None and value.strip().isdigit():
        return int(value)
    hint = getattr(storage, "put_threads", None)
    if isinstance(hint, int) and hint > 0:
        return hint
    return min(4, os.cpu_count() or 1)


class ChunkPuts:
    """A pool of put threads for one split writer (``workers=0``: puts run in the caller)."""

    def __init__(self, storage: Storage, key: str, *, workers: int | None = None,
                 max_pending: int | None = None, on_done: Callable[[int], None] | None = None,
                 block_nbytes: int | None = None) -> None:
        self._storage = storage
        # Features chunks are put with their block seals (featurestore.core.block_seals), blocks
        # of this many bytes; None: the trailer alone.
        self._block_nbytes = block_nbytes
        self._key = key
        self._workers = default_workers(storage) if workers is None else max(0, workers)
        self._together_puts = getattr(storage, "put_threads", None) is not None and self._workers > 0
        self._slots = threading.Semaphore(max(1, max_pending or 2 * max(1, self._workers)))
        self._executor: ThreadPoolExecutor | None = None
        self._side: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._on_done = on_done

    def submit(self, index: int, puts: Sequence[Put]) -> None:
        """Put chunk ``index``: every array but the last together, then the last one; waits while
        the pool is full."""
        self.raise_error()
        if self._workers == 0:
            self._run(index, puts, release=False)
            self.raise_error()
            return
        self._slots.acquire()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._workers, thread_name_prefix="featurestore-put")
        future = self._executor.submit(self._run, index, puts, True)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def wait(self) -> None:
        """Until every submitted chunk is on storage (or skipped after a failure); then raise the
        first failure, if any."""
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                break
            for future in pending:
                future.result()
        self.raise_error()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
            if self._side is not None:
                self._side.shutdown(wait=True)
                self._side = None

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _forget(self, future: Future[None]) -> None:
        with self._lock:
            self._pending.discard(future)

    def _run(self, index: int, puts: Sequence[Put], release: bool) -> None:
        try:
            if self._error is not None:
                return  # the split stopped at the first failure; resume rewrites the rest
            *early, final = puts
            calls: list[Callable[[], None]] = []
            for array, rows, compressor in early:
                # features among the early puts (a bag segment's, whose record comes last): its
                # row goes up beside it; a commit checks it against the chunk before using it
                calls.extend(self._puts_of(index, array, rows, compressor))
            *rest, last = self._puts_of(index, *final)
            self._together([*calls, *rest])  # a features chunk put last comes after its row
            last()
            if self._on_done is not None:
                self._on_done(index)
        except BaseException as error:
            with self._lock:
                if self._error is None:
                    self._error = self._explain(error, index)
        finally:
            if release:
                self._slots.release()

    def _puts_of(self, index: int, array: str, rows: np.ndarray, compressor: str | None) -> list[Callable[[], None]]:
        """The put of one array's chunk; a features chunk's block seals row's before it, made
        in the crc32c pass its trailer needs."""
        if array == layout.FEATURES and compressor is None and self._block_nbytes:
            key = layout.chunk_key(f"{self._key}/{array}", index, rows.ndim)
            payload = chunks.encode(rows, None)
            assert isinstance(payload, memoryview)
            return list(block_seals.sealed_puts(self._storage, self._key, index, key, payload, self._block_nbytes))
        return [partial(self._put, index, array, rows, compressor)]

    def _put(self, index: int, array: str, rows: np.ndarray, compressor: str | None) -> None:
        key = layout.chunk_key(f"{self._key}/{array}", index, rows.ndim)
        self._storage.write_sealed(key, chunks.encode(rows, compressor))

    def _together(self, calls: Sequence[Callable[[], None]]) -> None:
        """Run ``calls`` (at once where puts are round trips: this thread makes the first) and
        return when all have settled; then raise the first failure among them, in their order."""
        if not self._together_puts or len(calls) < 2:
            for call in calls:
                call()
            return
        with self._lock:
            if self._side is None:
                self._side = ThreadPoolExecutor(SIDE_PER_WORKER * self._workers,
                                                thread_name_prefix="featurestore-put-side")
            side = self._side
        futures = [side.submit(call) for call in calls[1:]]
        try:
            calls[0]()
        finally:
            wait_all(futures)
        for future in futures:
            future.result()

    def _explain(self, error: BaseException, index: int) -> BaseException:
        kept = ("then rerun with --resume (or create_split / create_bag_split(..., resume=True)); the split stays "
                "'writing' and the chunks already written are kept")
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            explained: BaseException = StorageFull(
                f"no space left on the device of store {self._storage.url} while writing chunk "
                f"{index} of {self._key}: free space, {kept}")
        elif isinstance(error, OSError) and error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            explained = ReadOnlyStore(
                f"store {self._storage.url} refused the write of chunk {index} of {self._key} ({error.strerror}): "
                f"make it writable (a file system remounted read-only, or permissions), {kept}")
        else:
            return error
        explained.__cause__ = error
        return explained
