"""One array's front on the chunk cache: which chunks are local, fetching the others, the plan.

A chunk a read needs and the cache does not hold is fetched whole by a fetch thread of the
process's :class:`~featurestore.core.chunk_cache.ChunkCache` (one GET, or concurrent ranged parts
past :data:`~featurestore.core.chunk_cache.PART_BYTES`), checked, and written into the array's
directory of the cache. The checks before it is kept: its size, its crc32c trailer, and the seal
of its statistics row (``chunk_stats``, fetched *after* the chunk, its GET overlapping the write):
the row must carry the split's generation and the chunk's index. An overwrite deletes the old
chunks before writing new ones, so a chunk of another generation fetched by a reader that opened
the split earlier is caught (:class:`SplitChanged`) and nothing of it is kept.

The download of chunk ``c`` holds ``flock`` on ``<c>.lock`` (the kernel releases it if the process
dies): another process that needs the chunk waits on the lock and then finds the file, so a host
downloads each chunk once. Threads of one process share one download (a future per chunk).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from featurestore.core.checked import damage_message
from featurestore.core.chunk_cache import PART_BYTES, ChunkCache, _unlink
from featurestore.errors import CorruptChunk, SplitChanged
from featurestore.format import chunks as chunk_codec
from featurestore.format import layout
from featurestore.format.metadata import SplitMetadata, seal_problem


def front(cache: ChunkCache, storage: Any, array_key: str, *, chunk_nbytes: int, ndim: int,
          meta: SplitMetadata | None) -> CachedArray:
    """The cache's front for one array of one generation of a split (one per process)."""
    directory = cache.entry_directory(storage.url, array_key, meta.generation if meta is not None else None)
    return cache.register(directory, lambda: CachedArray(cache, storage, array_key, directory, chunk_nbytes,
                                                         ndim, meta))


class CachedArray:
    """The cache's front for one array of one generation of a split: which chunks are here,
    fetching the others, what a loader's plan still needs."""

    def __init__(self, cache: ChunkCache, storage: Any, array_key: str, directory: str, chunk_nbytes: int,
                 ndim: int, meta: SplitMetadata | None) -> None:
        self.cache = cache
        self.storage = storage
        self.array_key = array_key
        self.directory = directory
        self.chunk_nbytes = chunk_nbytes  # payload + crc trailer
        self.ndim = ndim
        self.meta = meta
        self._last_use: np.ndarray | None = None  # per chunk: the last plan position that reads it
        self._position: Callable[[], int] = lambda: 0
        self._checked: set[tuple[int, int]] = set()  # (pid, chunk) fetched and checked by that process
        os.makedirs(directory, exist_ok=True)

    def path(self, chunk: int) -> str:
        return os.path.join(self.directory, str(chunk))

    # ------------------------------------------------------------------ plan
    def plan(self, last_use: np.ndarray | None, position: Callable[[], int] | None = None) -> None:
        """Keep chunk ``c`` while ``position() <= last_use[c]`` (a loader's epoch: the last batch
        that reads it); None forgets the plan (plain LRU)."""
        self._last_use = last_use
        if position is not None:
            self._position = position

    def needed(self, chunk: int) -> bool:
        last_use = self._last_use
        return last_use is not None and chunk < len(last_use) and last_use[chunk] >= self._position()

    # ------------------------------------------------------------------ fetching
    def present(self, chunk: int) -> bool:
        path = self.path(chunk)
        try:
            os.stat(path)
        except FileNotFoundError:
            return False
        self.cache.touch(path)
        return True

    def prefetch(self, chunks: Sequence[int]) -> list[Future[bool]]:
        """Start fetching ``chunks`` that are not here (no wait); their futures."""
        return [self.cache.submit(self.path(c), lambda c=c: self._fill(c)) for c in chunks if not self.present(c)]

    def ensure(self, chunks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Make ``chunks`` local: ``(fetched now, not cached)``. Chunks not cached (no room, a
        full disk) are for the caller to read by ranges. Storage errors propagate."""
        missing = [c for c in chunks if not self.present(c)]
        self.cache.stats["hits"] += len(chunks) - len(missing)
        if not missing:
            return [], []
        futures = [self.cache.submit(self.path(c), lambda c=c: self._fill(c)) for c in missing]
        fetched, absent = [], []
        for chunk, future in zip(missing, futures):
            (fetched if future.result() else absent).append(chunk)
        return fetched, absent

    def checked_here(self, chunk: int) -> bool:
        """Whether this process fetched (and so checked) the chunk's file itself."""
        return (os.getpid(), chunk) in self._checked

    def drop(self, chunk: int) -> None:
        """Remove a cached chunk found damaged (it is fetched again on its next read)."""
        self._checked.discard((os.getpid(), chunk))
        _unlink(self.path(chunk))

    def _fill(self, chunk: int) -> bool:
        path = self.path(chunk)
        if os.path.exists(path):
            return True
        if not self.cache.writable():
            return False
        os.makedirs(self.directory, exist_ok=True)  # the cache may have been emptied by hand
        lock_fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another process is downloading it: wait for its file
                self.cache.stats["waited"] += 1
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if os.path.exists(path):
                return True
            if not self.cache.reserve(self.chunk_nbytes):
                return False
            try:
                parts = self._download(chunk)
                # The seal's GET (after the chunk's) overlaps the write of the file; checked before the rename.
                seal = self.cache.side_submit(self._check_seal, chunk)
            except BaseException:
                self.cache.release(self.chunk_nbytes)
                raise
            stored = self.cache.store(path, parts, self.chunk_nbytes, check=seal.result)
            if stored:
                self._checked.add((os.getpid(), chunk))
            return stored
        finally:
            os.close(lock_fd)  # releases the flock

    def _download(self, chunk: int) -> list[Any]:
        key = layout.chunk_key(self.array_key, chunk, self.ndim)
        where = f"chunk {self.storage.url}/{key}"
        parts = self.storage.read_whole(key, self.chunk_nbytes, PART_BYTES)
        got = sum(len(p) for p in parts)
        if got != self.chunk_nbytes:
            raise CorruptChunk(damage_message(where, f"size {got if got <= self.chunk_nbytes else 'over'} bytes, "
                                                     f"expected {self.chunk_nbytes}"))
        reason = _check_crc(parts, self.chunk_nbytes - layout.CRC_BYTES)
        if reason is not None:
            raise CorruptChunk(damage_message(where, reason))
        return parts

    def _check_seal(self, chunk: int) -> None:
        """The chunk's statistics row, fetched after the chunk, carries this generation and index."""
        meta = self.meta
        if meta is None or meta.generation is None:
            return
        split_key = self.array_key.rpartition("/")[0]
        key = layout.chunk_key(f"{split_key}/{layout.CHUNK_STATS}", chunk, 2)
        try:
            raw = self.storage.read(key)
        except FileNotFoundError:
            raise SplitChanged(f"{split_key}: the statistics row of chunk {chunk} is gone from {self.storage.url}: "
                               "the split was deleted or overwritten since it was opened; open it again") from None
        problem = chunk_codec.check(raw, len(raw) - layout.CRC_BYTES) or seal_problem(raw, meta, chunk)
        if problem is not None:
            raise SplitChanged(f"{split_key}: chunk {chunk} at {self.storage.url} is {problem}: the split changed "
                               "since it was opened (nothing was cached from it); open it again")


def _check_crc(parts: Sequence[Any], payload_bytes: int) -> str | None:
    crc, offset, trailer = 0, 0, b""
    for part in parts:
        view = memoryview(part).cast("B")
        body = max(0, min(len(view), payload_bytes - offset))
        if body:
            crc = chunk_codec.crc32c(view[:body], crc)
        trailer += bytes(view[body:])
        offset += len(view)
    if chunk_codec.crc_trailer(crc) != trailer:
        return "crc32c mismatch (flipped or truncated bytes)"
    return None
