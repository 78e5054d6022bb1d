"""A bounded local cache of whole chunks of object-storage arrays, shared by one host's processes.

A shuffled epoch over object storage costs one ranged GET per row; whole chunk objects come at
several times the bytes per second (docs/STORAGE.md "Chunk cache"). With ``cache_dir``
set (storage option, ``--cache-dir``, ``FEATURESTORE_CACHE_DIR``), a chunk a read needs is fetched
whole (one GET, or concurrent ranged parts past :data:`PART_BYTES`), checked, written into the
directory and read from there by the local read path (mmap or pread), so later epochs run at
local speed.

What a chunk goes through before it is kept (size, crc32c, the generation seal) and how a host
downloads it once are in :mod:`featurestore.core.cached_array` (one front per array).

Layout: ``<dir>/v1/<hash of the store URL>/<split key>/<generation>/<array>/<chunk>``, the stored
bytes as they are (payload and crc trailer), so the local read path and its checks apply
unchanged. Another generation of a split lives in another directory: it is never read for this
one. Several processes (DDP ranks, DataLoader workers, a server) share one directory; no file is
ever torn: a chunk is written to a temporary name (``core.leftovers``' naming: the writer's pid
in it) and renamed. A SIGKILLed download leaves only a temporary file, which nothing reads and
the next process to open the cache removes once its writer is dead.

Size: at most ``cache_bytes`` (default: 75 % of the free space of the cache's file system when
opened, plus what it already holds). Room is made by removing the least recently used chunks
(a chunk's mtime is its last use; a process touches it at most every :data:`TOUCH_S`), except
those used in the last :data:`RECENT_S` and those a loader's plan in this process still needs
this epoch (``CachedArray.plan``): a chunk that would need one of them removed is not admitted,
and its rows are read by ranged GETs. The bytes held are counted by the host's processes
together (:data:`USED_FILE`: each stored chunk adds its size, each eviction's scan sets the
count); each process adds its own downloads in flight, so those of other processes can pass the
limit by at most :data:`FETCH_THREADS` chunks each.

A full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG``) is one warning naming the directory; the process
then reads by ranged GETs, as without a cache, and tries the disk again after :data:`FULL_RETRY_S`.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from featurestore.core import chunk_maps
from featurestore.core.storage.files import preallocate, stream_parts, temp_path, unlink_quietly
from featurestore.core.storage.lock_files import lock_file
from featurestore.core.storage.process import pid_alive
from featurestore.errors import InvalidStorageOptions
from featurestore.format.names import TMP_SUFFIX, tmp_writer_pid

#: Whole chunks larger than this are fetched as concurrent ranged parts of this size.
PART_BYTES = 8 << 20
#: Chunk downloads in flight per process (each also writes its file).
FETCH_THREADS = 8
#: A process refreshes a cached chunk's mtime (its last use, for LRU) at most this often.
TOUCH_S = 30.0
#: A chunk used this recently is not evicted: under a shuffle every chunk is touched all the time, so a
#: smaller cache keeps a stable set (the rest by ranged GETs), not whole chunks replaced every batch.
RECENT_S = 2 * TOUCH_S
#: After a full disk, the process reads by ranges and tries the disk again after this long.
FULL_RETRY_S = 60.0
DEFAULT_FREE_SHARE = 0.75
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_LAYOUT = "v1"
#: A chunk's download lock is ``<chunk>.lock`` beside it (cached_array).
LOCK_SUFFIX = ".lock"
#: The bytes the chunk files hold, one int64 shared by the host's processes (under flock): a
#: process counting only its own stores let N processes fill N times the limit.
USED_FILE = ".used"


class ChunkCache:
    """One cache directory as this process sees it (its limit, its downloads in flight, its counts);
    the fetch threads are the process's, shared by its caches."""

    def __init__(self, directory: str, max_bytes: int | None = None) -> None:
        self.directory = os.path.abspath(os.path.expanduser(directory))
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            raise InvalidStorageOptions(f"cache_dir {self.directory!r} cannot be created ({error.strerror}): pass a "
                                        "writable directory (--cache-dir / FEATURESTORE_CACHE_DIR)") from None
        self._root = os.path.join(self.directory, _LAYOUT)
        try:
            os.makedirs(self._root, exist_ok=True)
            _probe_write(self._root)
        except OSError as error:
            raise CacheUnwritable(f"chunk cache {self.directory} cannot be written ({error.strerror or error}): "
                                  "reading by ranged GETs instead; pass a writable directory (--cache-dir / "
                                  "FEATURESTORE_CACHE_DIR) to cache chunks there") from None
        used = self._scan()[1]
        if max_bytes is None:
            stat = os.statvfs(self.directory)
            max_bytes = int(stat.f_bavail * stat.f_frsize * DEFAULT_FREE_SHARE) + used
        self.max_bytes = int(max_bytes)
        self.stats = {"hits": 0, "fetched": 0, "fetched_bytes": 0, "waited": 0, "not_admitted": 0, "evicted": 0}
        self._used_path = os.path.join(self._root, USED_FILE)
        if self._shared_used() is None:  # the first process here (others' counts are kept)
            self._shared_used(set_to=used)
        self._rescan = False  # the count is not to be trusted (a full disk): scan before admitting
        self._pending = 0  # bytes reserved by this process's downloads not written yet
        self._lock = threading.Lock()
        self._reserving = threading.Lock()
        self._inflight: dict[str, Future[bool]] = {}
        self._pid = os.getpid()
        self._full_until = 0.0  # monotonic time until which the disk is taken as full
        self._no_room_until = 0.0  # everything held is kept by a plan: admit nothing until then
        self._arrays: dict[str, Any] = {}  # array directory -> its front (cached_array.CachedArray)
        self._touched: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"ChunkCache({self.directory!r}, max_bytes={self.max_bytes})"

    # ------------------------------------------------------------------ per array
    def register(self, directory: str, make: Callable[[], Any]) -> Any:
        """The process's one front for the array directory ``directory`` (``make()`` builds it):
        eviction asks it which of its chunks a plan still needs."""
        with self._lock:
            front = self._arrays.get(directory)
            if front is None:
                front = self._arrays[directory] = make()
        return front

    def entry_directory(self, store_url: str, array_key: str, generation: str | None) -> str:
        """``<dir>/v1/<hash of the store URL>/<split key>/<generation>/<array>``."""
        store_id = hashlib.sha256(store_url.encode()).hexdigest()[:16]
        split_key, _, name = array_key.rpartition("/")
        return os.path.join(self._root, store_id, *split_key.split("/"), generation or "no-generation", name)

    # ------------------------------------------------------------------ threads
    def submit(self, key: str, fn: Callable[[], bool]) -> Future[bool]:
        """``fn`` on a fetch thread, once per ``key`` at a time in this process."""
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's threads and downloads are not ours
                self._inflight, self._pid = {}, os.getpid()
            future = self._inflight.get(key)
            if future is not None:
                return future
            future = _pool(_FETCH_POOL).submit(fn)
            self._inflight[key] = future
        future.add_done_callback(lambda _: self._forget(key, future))
        return future

    def _forget(self, key: str, future: Future[bool]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def inflight(self) -> int:
        with self._lock:
            return len(self._inflight)

    # ------------------------------------------------------------------ writes and room
    def writable(self) -> bool:
        return time.monotonic() >= max(self._full_until, self._no_room_until)

    def reserve(self, nbytes: int) -> bool:
        """Room for a chunk of ``nbytes``, made by eviction if needed, counted as used; False when
        the chunks held may not be removed yet (then it is not admitted: read by ranges)."""
        # Room found and counted as one step: two fetch threads that both saw room for one chunk
        # would otherwise both be admitted, and the cache would pass its limit.
        with self._reserving:
            if self._make_room(nbytes):
                with self._lock:
                    self._pending += nbytes
                return True
        self.stats["not_admitted"] += 1
        return False

    def release(self, nbytes: int, written: bool = False) -> None:
        """A reservation ends, its chunk ``written`` or not; used before not pending (else one between passes)."""
        if written:
            self._shared_used(add=nbytes)
        with self._lock:
            self._pending -= nbytes

    def store(self, path: str, fill: Callable[[Callable[[Any], None]], None], nbytes: int,
              check: Callable[[], None] = lambda: None) -> bool:
        """Write into ``path`` atomically what ``fill(write)`` passes to ``write`` (room reserved);
        False if the disk is full (warned once per :data:`FULL_RETRY_S`). ``check()`` runs between
        the write and the rename. If ``fill`` or ``check`` raises, nothing is kept and the error
        goes on; an error of the cache's own file goes on too, unless the disk is full."""
        tmp = temp_path(path)
        try:
            try:
                f = open(tmp, "wb")
            except OSError as error:
                raise _CacheFileError(error) from error
            with f:
                _disk(lambda: preallocate(f.fileno(), nbytes))  # a full disk shows before the GET
                fill(lambda data: _write(f, data))
                _disk(f.flush)
            check()
            _disk(lambda: os.replace(tmp, path))
        except _CacheFileError as wrapped:
            unlink_quietly(tmp)
            self.release(nbytes)
            return self._cache_file_failed(wrapped.error)
        except BaseException:
            unlink_quietly(tmp)
            self.release(nbytes)
            raise
        self.release(nbytes, written=True)
        with self._lock:
            self.stats["fetched"] += 1
            self.stats["fetched_bytes"] += nbytes
        return True

    def _cache_file_failed(self, error: OSError) -> bool:
        """False for a full disk (warned) or a temporary file swept away meanwhile; else raises."""
        if isinstance(error, FileNotFoundError):  # swept (a writer in another pid namespace?) or emptied by hand
            return False
        if error.errno not in _FULL_ERRNOS:
            raise error
        with self._lock:
            self._rescan = True
            first = time.monotonic() >= self._full_until
            self._full_until = time.monotonic() + FULL_RETRY_S
        if first:
            warnings.warn(f"chunk cache {self.directory} is full ({error.strerror}): reading by ranged GETs "
                          f"instead for {FULL_RETRY_S:.0f} s; free space there or lower cache_bytes "
                          f"(now {self.max_bytes} bytes)", RuntimeWarning, stacklevel=3)
        return False

    def _make_room(self, nbytes: int) -> bool:
        with self._lock:
            pending, rescan = self._pending, self._rescan
        used = None if rescan else self._shared_used()
        if used is not None and used + pending + nbytes <= self.max_bytes:
            return True
        if time.monotonic() < self._no_room_until:
            return False
        with lock_file(os.path.join(self._root, ".evict.lock")) as lock_fd:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # one evictor at a time across the host
            before = self._shared_used()
            # This process's downloads in flight hold room too, as they stand before the scan: one
            # renamed in while the scan lists the directory is missed by it and may be released by now.
            pending = self._pending
            entries, used = self._scan()
            target = self.max_bytes - nbytes - pending
            if used > target:
                used = self._evict(entries, used, target)
            self._shared_used(rebase=(used, before or 0))  # + what was stored meanwhile, in one locked step
            with self._lock:
                self._rescan = False
                if used > target:
                    self._no_room_until = time.monotonic() + 2.0
                    return False
            return True

    def _evict(self, entries: list[tuple[float, int, str]], used: int, target: int) -> int:
        # Below the target by a twentieth: the next few chunks need no scan.
        target -= self.max_bytes // 20
        for mtime, size, path in sorted(entries):
            if used <= target:
                break
            if self._kept(path, mtime):
                continue
            unlink_quietly(path)
            # And its download lock (cached_array), or one empty file per chunk ever cached would stay.
            # A process that found the chunk gone a moment ago may hold that lock, and one that comes
            # later makes a new one: at worst the chunk is downloaded twice, each renamed in whole.
            unlink_quietly(f"{path}{LOCK_SUFFIX}")
            directory, name = os.path.split(path)
            # This process's map of it would keep its pages and disk blocks (maps keyed by directory).
            chunk_maps.shared().forget(directory, int(name))
            used -= size
            self.stats["evicted"] += 1
        return used

    def _shared_used(self, *, add: int = 0, set_to: int | None = None,
                     rebase: tuple[int, int] | None = None) -> int | None:
        """The bytes the chunk files hold as the host's processes count them (:data:`USED_FILE`),
        after ``add``, ``set_to`` or ``rebase=(a scan's count, the count before it)`` plus the adds
        since (a separate read and set lost them); None when unreadable (room is made by a scan)."""
        writes = bool(add) or set_to is not None or rebase is not None
        try:
            with lock_file(self._used_path) as fd:
                fcntl.flock(fd, fcntl.LOCK_EX if writes else fcntl.LOCK_SH)
                raw = os.pread(fd, 8, 0)
                value = int.from_bytes(raw, "little", signed=True) if len(raw) == 8 else None
                if rebase is not None:
                    set_to = rebase[0] + max(0, (value or 0) - rebase[1])
                if value is None and set_to is None:  # a count lost (emptied by hand): the next scan sets it
                    return None
                if writes:
                    value = set_to if set_to is not None else value + add
                    os.pwrite(fd, value.to_bytes(8, "little", signed=True), 0)
                return value
        except OSError:  # the directory went (the next store or scan says why), or a full disk (the
            return None  # pwrite: the store's to report)

    def _kept(self, path: str, mtime: float) -> bool:
        """A chunk a loader's plan in this process still needs this epoch, or one used in the last
        :data:`RECENT_S` (by any process: the plans of others are not known here)."""
        if time.time() - mtime < RECENT_S:
            return True
        directory, name = os.path.split(path)
        front = self._arrays.get(directory)
        return front is not None and name.isdigit() and front.needed(int(name))

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        """``[(mtime, size, path)]`` of every cached chunk and their total size; removes the
        temporary files of dead writers on the way (``core.leftovers``' rule)."""
        entries, used = [], 0
        for directory, _, names in os.walk(self._root):
            present = set(names)
            for name in names:
                path = os.path.join(directory, name)
                stem = name.removesuffix(LOCK_SUFFIX)
                if stem != name and stem.isdigit():  # a chunk's download lock
                    if stem not in present:  # the chunk was evicted (or never stored)
                        _remove_idle_lock(path)
                    continue
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                if name.endswith(TMP_SUFFIX):
                    pid = tmp_writer_pid(name)
                    if pid is None or not pid_alive(pid) or time.time() - st.st_mtime > 600:
                        unlink_quietly(path)
                    continue
                if name.isdigit():
                    entries.append((st.st_mtime, st.st_size, path))
                    used += st.st_size
        return entries, used

    def touch(self, path: str) -> None:
        """Record a use of ``path`` (its mtime), at most every :data:`TOUCH_S` per process."""
        now = time.monotonic()
        if now - self._touched.get(path, -TOUCH_S) >= TOUCH_S:
            self._touched[path] = now
            try:
                os.utime(path)
            except OSError:
                pass

    def used_bytes(self) -> int:
        return self._scan()[1]


_shared: dict[tuple[str, int | None], ChunkCache | None] = {}  # None: a directory that cannot be written
_shared_lock = threading.Lock()

_FETCH_POOL = "featurestore-cache"
# The process's fetch threads, shared by all its caches (FETCH_THREADS bounds its downloads in
# flight): a pool per cache directory left FETCH_THREADS idle threads behind for each directory
# ever opened (``bench s3``, which opens one per repeat, held 146 threads after ten).
_pools: dict[str, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(name: str) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(name)
        if pool is None:
            pool = _pools[name] = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix=name)
        return pool


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) keeps the caches but none of the parent's threads,
    # downloads in flight or held locks.
    global _shared_lock, _pools_lock
    _shared_lock, _pools_lock = threading.Lock(), threading.Lock()
    _pools.clear()
    for cache in filter(None, _shared.values()):  # None: a directory that could not be written
        cache._lock, cache._reserving = threading.Lock(), threading.Lock()  # a fetch thread may have held them
        cache._inflight, cache._pending = {}, 0
        cache._pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def shared(directory: str, max_bytes: int | None) -> ChunkCache | None:
    """The process's one :class:`ChunkCache` for ``directory`` (every store opened with it shares
    its downloads in flight and its loaders' plans); None, after one warning naming it, when the
    directory exists but cannot be written: then the stores read by ranged GETs, as without a
    cache (the process does not try it again: permissions and mounts rarely change under it)."""
    key = (os.path.abspath(os.path.expanduser(directory)), max_bytes)
    with _shared_lock:
        if key in _shared:
            return _shared[key]
        try:
            cache: ChunkCache | None = ChunkCache(directory, max_bytes)
        except CacheUnwritable as error:
            warnings.warn(str(error), RuntimeWarning, stacklevel=3)
            cache = None
        _shared[key] = cache
        return cache


class CacheUnwritable(Exception):
    """The cache directory exists but no file can be created in it (read-only mount, no permission)."""


def _probe_write(root: str) -> None:
    """Create and remove a temporary file in ``root`` (only a write shows a read-only mount or an
    immutable directory; named as the cache's temporary files: a kill leaves one the sweep removes)."""
    path = temp_path(os.path.join(root, ".probe"))
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    os.unlink(path)


class _CacheFileError(Exception):
    """An ``OSError`` of a cache file, told apart from those of the fill (a GET's ``FileNotFoundError``)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _disk(operation: Callable[[], Any]) -> Any:
    try:
        return operation()
    except OSError as error:
        raise _CacheFileError(error) from error


def _write(f: Any, data: Any) -> None:
    # In pieces: see files.PIECE_BYTES (a write of 2 MiB or more costs ~12x the CPU here).
    _disk(lambda: stream_parts(f, [data]))


def _remove_idle_lock(path: str) -> None:
    """Remove a download lock no process holds (one held is a download in progress)."""
    try:
        with lock_file(path, os.O_RDWR) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            unlink_quietly(path)
    except OSError:  # gone already, or held (BlockingIOError): a download in progress
        pass
