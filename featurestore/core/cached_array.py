"""One array's front on the chunk cache: which chunks are local, fetching the others, the plan.

A chunk a read needs and the cache does not hold is fetched whole by a fetch thread of the
process's :class:`~featurestore.core.storage.chunk_cache.ChunkCache` (one GET streamed into the cache file
1 MiB at a time as it arrives, or concurrent ranged parts past
:data:`~featurestore.core.storage.chunk_cache.PART_BYTES`) and checked before the file is renamed into
place: its size and its crc32c trailer (both computed as the bytes stream in), and that the split
is still the generation it was opened as, complete: its group document, requested after the
chunk's GET was answered, says so (:mod:`featurestore.core.generation`, the check every read path
shares: one GET covers the chunks of a wave, and the split's arrays). An overwrite rewrites that
document before it deletes the old chunks and writes new ones, so a chunk of another generation
fetched by a reader that opened the split earlier is caught (``SplitChanged``) and nothing of it
is kept.

A cache entry that is not a regular file (a directory left at a chunk's path) is a damaged entry:
removed when it is the cache's own (a real directory or a link inside the entry's directory) and
fetched again, else the chunk is read by ranges; one warning per process.

The download of chunk ``c`` holds ``flock`` on ``<c>.lock`` (the kernel releases it if the process
dies): another process that needs the chunk waits on the lock and then finds the file, so a host
downloads each chunk once. The wait is bounded (:data:`LOCK_WAIT_S`): a holder that is stopped
(Ctrl-Z, a suspended job, a debugger) or wedged would otherwise hang every other process of the
host that needs the chunk; past it, the rows are read by ranged GETs (one warning per process),
without waiting again for :data:`LOCKED_OUT_S`.
Threads of one process share one download (a future per chunk).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from featurestore.core import generation
from featurestore.core.checked import damage_message
from featurestore.core.storage.chunk_cache import LOCK_SUFFIX, PART_BYTES, ChunkCache
from featurestore.core.storage.files import unlink_quietly
from featurestore.core.storage.lock_files import lock_file
from featurestore.errors import CorruptChunk
from featurestore.format import chunks as chunk_codec
from featurestore.format import layout
from featurestore.format.metadata import COMPLETE, SplitMetadata

_log = logging.getLogger(__name__)
_warned_odd_entry = False
_warned_lock = False
#: The longest a process waits for another's download of a chunk before reading its rows by ranges.
LOCK_WAIT_S = 30.0
#: After such a wait, the chunk is read by ranges without waiting for this long, then tried again.
LOCKED_OUT_S = 300.0


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
        self._locked_out: dict[int, float] = {}  # chunk -> until when another's stuck download is not waited for
        # The process's one check of this generation of the split, shared by its arrays (features
        # and labels, or features and coords) and its ranged reads: one document GET covers all.
        self._generation = generation.for_split(storage, array_key.rpartition("/")[0], {
            "generation": meta.generation if meta is not None else None, "status": COMPLETE})
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
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            self._clear(path)
            return False
        self.cache.touch(path)
        return True

    def _here(self, chunk: int) -> bool | None:
        """True: the chunk's file is here; None: nothing is (fetch it); False: an entry that is
        no chunk file and cannot be removed (the caller reads the chunk by ranges)."""
        if self.present(chunk):
            return True
        return False if os.path.lexists(self.path(chunk)) else None

    def _clear(self, path: str) -> bool:
        """Remove what is at a chunk's path when it is not a regular file (a damaged entry);
        False if that is not possible (then the chunk is read by ranges)."""
        global _warned_odd_entry
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                return True
            # Only the cache's own: a real directory here (rmtree never follows links out of it),
            # or any other non-file entry, itself unlinked.
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            problem = None
        except FileNotFoundError:
            return True
        except OSError as error:
            problem = error
        if not _warned_odd_entry:
            _warned_odd_entry = True
            _log.warning("chunk cache: %s was not a chunk file (%s); %s", path,
                         "a directory or other entry" if problem is None else problem,
                         "removed, the chunk is fetched again" if problem is None
                         else "the chunk is read from storage by ranges instead")
        return problem is None

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
        if not self._clear(self.path(chunk)):
            return
        unlink_quietly(self.path(chunk))

    def _fill(self, chunk: int) -> bool:
        path = self.path(chunk)
        if (here := self._here(chunk)) is not None:
            return here
        if not self.cache.writable():
            return False
        if time.monotonic() < self._locked_out.get(chunk, 0.0):  # its holder still stuck: ranges, no wait
            return False
        os.makedirs(self.directory, exist_ok=True)  # the cache may have been emptied by hand
        with lock_file(f"{path}{LOCK_SUFFIX}") as lock_fd:  # closing it releases the flock
            if not _locked(lock_fd, self.cache.stats):
                _warn_lock(f"{path}{LOCK_SUFFIX}")
                # A shuffled epoch reads the chunk again and again: one wait, then ranges for a while.
                self._locked_out[chunk] = time.monotonic() + LOCKED_OUT_S
                return False
            if (here := self._here(chunk)) is not None:
                return here
            if not self.cache.reserve(self.chunk_nbytes):
                return False
            answered_at: list[float] = []
            stored = self.cache.store(path, lambda write: self._download(chunk, write, answered_at.append),
                                      self.chunk_nbytes, check=lambda: self._generation.after(answered_at[0]))
            if stored:
                self._checked.add((os.getpid(), chunk))
            return stored

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


def _locked(lock_fd: int, stats: dict[str, int]) -> bool:
    """The chunk's download lock taken, waiting at most :data:`LOCK_WAIT_S` for another
    process's download (polled: a blocking flock cannot be given up, nor interrupted)."""
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:  # another process is downloading it: wait for its file
        stats["waited"] += 1
    deadline, pause = time.monotonic() + LOCK_WAIT_S, 0.002
    while time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.02)  # a download usually ends within ms: seen within 20 ms of it
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
    return False


def _warn_lock(lock: str) -> None:
    global _warned_lock
    if not _warned_lock:
        _warned_lock = True
        _log.warning("chunk cache: another process has held %s for over %.0f s (stopped or stuck?): reading "
                     "that chunk's rows by ranged GETs instead", lock, LOCK_WAIT_S)


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
