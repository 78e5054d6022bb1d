"""Chunk puts off the caller's thread: crc32c and the atomic put of each chunk in a small pool.

Chunks are independent keys, so a few threads write them concurrently (``write``/``crc32c``
release the GIL) while the caller prepares the next batch. Within a chunk the order stays the
one crash safety rests on (labels, statistics row, then the features chunk: its presence with a
valid crc32c proves the chunk done). At most ``max_pending`` chunks are in flight; ``submit``
waits for a free slot beyond that, which bounds the host memory the pool holds.

The first failure stops the pool: chunks not yet started are skipped (a resume rewrites them),
and the error is raised by the next ``submit`` or ``wait``. A full disk becomes one
:class:`~featurestore.errors.StorageFull` line naming the store and what to do.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from featurestore.core import block_seals
from featurestore.core.storage import Storage
from featurestore.errors import StorageFull
from featurestore.format import chunks, layout

# (array name, rows, compressor) of one put; rows are padded to the full chunk shape already.
Put = tuple[str, np.ndarray, "str | None"]


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
        self._slots = threading.Semaphore(max(1, max_pending or 2 * max(1, self._workers)))
        self._executor: ThreadPoolExecutor | None = None
        self._pending: set[Future[None]] = set()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._on_done = on_done

    def submit(self, index: int, puts: Sequence[Put]) -> None:
        """Put chunk ``index`` (its arrays in the given order); waits while the pool is full."""
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
            for array, rows, compressor in puts:
                key = layout.chunk_key(f"{self._key}/{array}", index, rows.ndim)
                if array == layout.FEATURES and compressor is None and self._block_nbytes:
                    payload = chunks.encode(rows, None)
                    assert isinstance(payload, memoryview)
                    block_seals.put_sealed_chunk(self._storage, self._key, index, key, payload, self._block_nbytes)
                    continue
                self._storage.write_sealed(key, chunks.encode(rows, compressor))
            if self._on_done is not None:
                self._on_done(index)
        except BaseException as error:
            with self._lock:
                if self._error is None:
                    self._error = self._explain(error, index)
        finally:
            if release:
                self._slots.release()

    def _explain(self, error: BaseException, index: int) -> BaseException:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            full = StorageFull(
                f"no space left on the device of store {self._storage.url} while writing chunk "
                f"{index} of {self._key}: free space, then rerun with --resume (or "
                "create_split(..., resume=True)); the split stays 'writing' and the chunks already "
                "written are kept"
            )
            full.__cause__ = error
            return full
        return error
