"""One array's front on the chunk cache: which chunks are local, fetching the others, the plan.

A chunk a read needs and the cache does not hold is fetched whole by a fetch thread of the
process's :class:`~featurestore.core.chunk_cache.ChunkCache` (one GET streamed into the cache file
1 MiB at a time as it arrives, or concurrent ranged parts past
:data:`~featurestore.core.chunk_cache.PART_BYTES`) and checked before the file is renamed into
place: its size and its crc32c trailer (both computed as the bytes stream in), and that the split
is still the generation it was opened as, complete: its group document, requested after the
chunk's GET was answered, says so (:class:`_GenerationCheck`, one GET shared by the chunks of a
wave). An overwrite rewrites that document before it deletes the old chunks and writes new ones,
so a chunk of another generation fetched by a reader that opened the split earlier is caught
(:class:`SplitChanged`) and nothing of it is kept.

The download of chunk ``c`` holds ``flock`` on ``<c>.lock`` (the kernel releases it if the process
dies): another process that needs the chunk waits on the lock and then finds the file, so a host
downloads each chunk once. Threads of one process share one download (a future per chunk).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from featurestore.core.checked import damage_message
from featurestore.core.chunk_cache import LOCK_SUFFIX, PART_BYTES, ChunkCache
from featurestore.core.storage import unlink_quietly
from featurestore.errors import CorruptChunk, SplitChanged
from featurestore.format import chunks as chunk_codec
from featurestore.format import layout
from featurestore.format.metadata import COMPLETE, SplitMetadata


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
        # One check per split entry, shared by its arrays (features and labels, or features and
        # coords): one request of the split's document covers the chunks of both.
        self._generation = cache.generation_check(
            os.path.dirname(directory), lambda: _GenerationCheck(cache, storage, array_key.rpartition("/")[0], meta))
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
        unlink_quietly(self.path(chunk))

    def _fill(self, chunk: int) -> bool:
        path = self.path(chunk)
        if os.path.exists(path):
            return True
        if not self.cache.writable():
            return False
        os.makedirs(self.directory, exist_ok=True)  # the cache may have been emptied by hand
        lock_fd = os.open(f"{path}{LOCK_SUFFIX}", os.O_CREAT | os.O_RDWR, 0o644)
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
            answered_at: list[float] = []
            stored = self.cache.store(path, lambda write: self._download(chunk, write, answered_at.append),
                                      self.chunk_nbytes, check=lambda: self._generation.after(answered_at[0]))
            if stored:
                self._checked.add((os.getpid(), chunk))
            return stored
        finally:
            os.close(lock_fd)  # releases the flock

    def _download(self, chunk: int, write: Callable[[Any], None], answered: Callable[[float], None]) -> None:
        """Stream the chunk into ``write``, checking its size and crc32c trailer on the way
        (:class:`CorruptChunk` at the end if either is wrong: the caller keeps nothing);
        ``answered`` gets the monotonic time its GET was answered at."""
        key = layout.chunk_key(self.array_key, chunk, self.ndim)
        received = _Received(self.chunk_nbytes - layout.CRC_BYTES)

        def refuse(problem: str | None) -> None:
            if problem is not None:
                raise CorruptChunk(damage_message(f"chunk {self.storage.url}/{key}", problem))

        def sink(piece: Any) -> None:
            received.add(piece)
            if received.size > self.chunk_nbytes:  # a longer object: no need to stream the rest
                refuse(received.problem(self.chunk_nbytes))
            write(piece)

        self.storage.read_whole_into(key, self.chunk_nbytes, PART_BYTES, sink, lambda: answered(time.monotonic()))
        refuse(received.problem(self.chunk_nbytes))


class _GenerationCheck:
    """Whether the split is still the generation (complete) it was opened as, asked of its group
    document (``zarr.json``) *after* a chunk's GET was answered, one GET for many chunks.

    Why that proves the chunk: an overwrite (and a resume that repairs a complete split) rewrites
    the group document first (status "writing"), then deletes the old chunks and writes new ones,
    so a chunk of another generation was stored after the document changed. A document requested
    after the chunk's GET was answered that still shows this generation, complete, was read
    before any of that began: the chunk is this generation's. Every chunk answered before a check
    was requested is covered by it: the fetch threads share the checks in flight (a statistics
    row's GET per chunk cost SeaweedFS as much CPU as ~10 % of the chunk bytes here), and so do
    the split's arrays (one check per split entry, :meth:`ChunkCache.generation_check`).
    """

    def __init__(self, cache: ChunkCache, storage: Any, split_key: str, meta: SplitMetadata | None) -> None:
        self._cache, self._storage, self._split_key, self._meta = cache, storage, split_key, meta
        self._lock = threading.Lock()
        self._passed = float("-inf")  # monotonic time the last passed check was requested at
        self._pending: tuple[float, Future[None]] | None = None
        self._pid = os.getpid()

    def after(self, answered_at: float) -> None:
        """Return once a check requested after ``answered_at`` passed; :class:`SplitChanged` if
        the split changed since it was opened (nothing of the chunk is then kept)."""
        meta = self._meta
        if meta is None or meta.generation is None:
            return  # a split written before generations existed: nothing to compare
        if self._pid != os.getpid():  # forked (a DataLoader worker): the parent's check in flight,
            # and a lock one of its threads may have held, did not come along
            self._lock, self._pending, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._passed >= answered_at:
                return
            if self._pending is None or self._pending[0] < answered_at or self._pending[1].done():
                requested = time.monotonic()
                self._pending = (requested, self._cache.side_submit(self._check, requested))
            pending = self._pending[1]
        pending.result()

    def _check(self, requested: float) -> None:
        meta, split_key = self._meta, self._split_key
        assert meta is not None
        where = f"{split_key} at {self._storage.url}"
        try:
            doc = layout.load_document(self._storage.read(f"{split_key}/{layout.ZARR_JSON}"))
            now = ((doc.get("attributes") or {}).get("featurestore") or {})
        except FileNotFoundError:
            raise SplitChanged(f"{where} is gone (deleted or being overwritten) since it was opened (nothing was "
                               "cached from it); open it again") from None
        except (ValueError, AttributeError):
            now = {}
        if now.get("generation") != meta.generation:
            raise SplitChanged(f"{where} is now another generation of the split ({now.get('generation')!r}, "
                               f"opened as {meta.generation!r}): it was overwritten since it was opened (nothing was "
                               "cached from it); open it again")
        if now.get("status") != COMPLETE:
            raise SplitChanged(f"{where} is being rewritten (status {now.get('status')!r}) since it was opened "
                               "(nothing was cached from it); open it again when it is complete")
        with self._lock:
            self._passed = max(self._passed, requested)


class _Received:
    """A chunk's bytes as they stream in: their count, the crc32c of the payload, the trailer."""

    def __init__(self, payload_bytes: int) -> None:
        self.payload_bytes = payload_bytes
        self.size = 0
        self.crc = 0
        self.trailer = b""

    def add(self, piece: Any) -> None:
        view = memoryview(piece).cast("B")
        body = max(0, min(len(view), self.payload_bytes - self.size))
        if body:
            self.crc = chunk_codec.crc32c(view[:body], self.crc)
        if len(self.trailer) <= layout.CRC_BYTES:  # past that the size is wrong anyway
            self.trailer += bytes(view[body : body + layout.CRC_BYTES + 1])
        self.size += len(view)

    def problem(self, expected: int) -> str | None:
        if self.size != expected:
            return f"size {self.size if self.size <= expected else 'over'} bytes, expected {expected}"
        if chunk_codec.crc_trailer(self.crc) != self.trailer:
            return "crc32c mismatch (flipped or truncated bytes)"
        return None
