"""Memory maps of local chunk files: one LRU per process, shared by every array, bounded.

The mmap gather (docs/READS.md) copies page-cached rows straight out of maps of the chunk files.
A map used to be made per chunk and kept until the array was dropped, so descriptors and map-table
entries grew with the chunk count. Here every ``FeatureArray`` of the process (a server
holds many splits) shares one cache, bounded in count (:func:`open_files.max_maps`) and in mapped
bytes (half of the memory this process may use, the size below which ``auto`` keeps arrays
cached); the map least recently fetched from the cache is dropped first (an array's own lookups,
:class:`ArrayMaps`, skip the cache's lock and do not refresh that order). A map a gather is still
copying from stays valid: dropping it unmaps it only once that gather lets go of its view.

The pages a gather touches through a map count in the process's RSS (``VmRSS``, what ``top``,
SLURM and Kubernetes' working set show) for as long as they stay mapped, although they are only
page cache: kept, an epoch over a split left the whole split "resident" in the process. So the
bytes mapped in are bounded too (``FEATURESTORE_MAPPED_MIB``, core.map_budget): each
gather reports what it touched (:meth:`ChunkMaps.touched`, in whole folios: one touched row maps
its page-cache folio, up to 2 MiB), and past the budget the maps touched least recently drop
their pages with ``madvise(MADV_DONTNEED)``. On a shared file map that removes only this process's
page-table entries: the page cache keeps the bytes, and the next touch maps them again (no disk
read; a long run with one ``MADV_POPULATE_READ`` call), so reads stay warm while RSS stays bounded,
at the kernel's cost of mapping pages in again (docs/READS.md). Shuffled and large rows
(:func:`map_budget.scattered`), and long runs of rows (a bag, a row range), of an array larger than that
budget are read through the maps' descriptors instead (core.descriptor_reads): nothing mapped in.

Every copy out of a map re-checks the mapped file's size with ``fstat`` on the map's own
descriptor. A file truncated in place under a map raises SIGBUS on the first touch of a page past
its new end, which no Python code can catch (it killed servers and loaders); a size that no longer
matches is refused here instead, as ``CorruptChunk`` naming the file. What remains is the window
between that ``fstat`` and the end of the copy of that chunk's rows (microseconds): a truncation
landing exactly there still raises SIGBUS. featurestore itself never truncates a chunk in place (it
replaces files atomically, and a replaced file keeps its old inode mapped until unmapped). A read
through a descriptor cannot fault: a file cut short gives a short read, refused by name, so there
the size is checked at most every :data:`SIZE_RECHECK_S` (dozens of chunks a shuffled batch).
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from featurestore.core import descriptor_reads, open_files, pread
from featurestore.core.descriptor_reads import read_rows, read_runs
from featurestore.core.mapped_file import Descriptor, MappedFile, map_file, open_descriptor
from featurestore.core.map_budget import FOLIO, LONG_RUN, direct_rows, resident_budget, scattered
from featurestore.core.reader_ranges import SortedRows, copy_runs, is_range

_POPULATE_RUN = 256 << 10  # runs shorter than this fault in at the cost of a call or less
SIZE_RECHECK_S = 1.0  # descriptor reads: per-chunk fstats were ~1/10 of a warm [256, 384] batch


class ChunkMaps:
    """The process's chunk maps, keyed by ``(array directory, chunk)``."""

    def __init__(self, max_maps: int, max_bytes: int, max_resident: int | None = None,
                 max_descriptors: int | None = None) -> None:
        self.max_maps = max_maps
        # The maps' descriptors (mmap's own) and their reads' (one more each, on first need), together.
        self.max_descriptors = max_maps if max_descriptors is None else max_descriptors
        self._descriptors = 0  # maps holding a descriptor for reads
        self.max_bytes = max_bytes
        self.max_resident = max_bytes if max_resident is None else max_resident
        self._entries: OrderedDict[tuple[str, int], MappedFile] = OrderedDict()
        self._bytes = 0
        self._touched: OrderedDict[MappedFile, None] = OrderedDict()  # maps with pages mapped in, oldest first
        self._resident = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, owner: str, chunk: int, path_of: Callable[[int], str], *, shape: tuple[int, int],
              check_size: Callable[[str, int], None], populate: bool,
              inode: int | None = None) -> tuple[MappedFile, np.ndarray]:
        """The map of the chunk file ``path_of(chunk)`` and its rows ``[chunk_rows, sample_nbytes]``,
        mapped once and reused. ``check_size(path, size)`` raises when ``size`` is not the chunk's;
        the size is checked on every call, on the map's own descriptor. ``inode``, when given, is
        the inode the path has now: a map of an older file (a resume replaced it) is made again."""
        key = (owner, chunk)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:  # in the cache, so still open; holding its rows keeps it so
                self._entries.move_to_end(key)
                rows, mapped = entry.rows, entry.mapped
        if entry is not None:
            size = mapped.size()  # fstat on the mapped file itself
            if size == entry.nbytes and (inode is None or entry.inode == inode):
                return entry, rows
            self._drop(key, entry)
            if size != entry.nbytes:
                check_size(entry.path, size)  # raises, naming the file
        entry = map_file(path_of(chunk), shape, check_size, populate)
        with self._lock:
            current = self._entries.get(key)
            if current is not None and current.inode == entry.inode:  # another thread mapped it first
                self._entries.move_to_end(key)
                entry.close()
                entry = current
            else:
                if current is not None:
                    self._remove_locked(key)
                self._entries[key] = entry
                entry.cached = True
                self._bytes += entry.nbytes
            rows = entry.rows  # taken under the lock: no eviction can close it first
            evicted = self._evict_locked()
        for old in evicted:
            old.close()
        if populate:  # MAP_POPULATE mapped the whole file in
            self.touched([(entry, entry.nbytes)])
        return entry, rows

    def touched(self, spans: list[tuple[MappedFile, int]]) -> None:
        """Count ``(map, bytes)`` as mapped in by a gather, then release the maps touched least
        recently until the count is within ``max_resident`` (a map's count never exceeds its size)."""
        with self._lock:
            for entry, nbytes in spans:
                if entry.mapped is None:  # closed: nothing of it stays mapped
                    continue
                before = entry.resident
                entry.resident = min(entry.nbytes, before + nbytes)
                self._resident += entry.resident - before
                self._touched[entry] = None
                self._touched.move_to_end(entry)
            released = []
            while self._resident > self.max_resident and self._touched:
                entry, _ = self._touched.popitem(last=False)
                self._resident -= entry.resident
                entry.resident = 0
                released.append(entry)
        for entry in released:
            entry.release()

    @property
    def resident_bytes(self) -> int:
        """Bytes counted as mapped in now (an upper bound of what the maps add to RSS)."""
        return self._resident

    def forget(self, owner: str, chunk: int) -> None:
        """Drop the map of one chunk (its file was found damaged and is being replaced)."""
        with self._lock:
            entry = self._entries.pop((owner, chunk), None)
            if entry is not None:
                self._bytes -= entry.nbytes
                self._untouch_locked(entry)
        if entry is not None:
            entry.close()

    def clear(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
            self._entries.clear()
            self._bytes = self._resident = self._descriptors = 0
            self._touched.clear()
            for entry in entries:
                entry.cached = False
        for entry in entries:
            entry.close()

    def _drop(self, key: tuple[str, int], entry: MappedFile) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                self._remove_locked(key)
        entry.close()

    def _remove_locked(self, key: tuple[str, int]) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
        self._untouch_locked(entry)

    def descriptor(self, entry: MappedFile) -> Descriptor | None:
        """``entry``'s descriptor for reads that map nothing, opened on first need and counted in
        ``max_descriptors`` (maps evicted for it); None: copy out of the map instead."""
        descriptor = entry.descriptor
        if descriptor is not None or entry.no_descriptor:
            return descriptor
        with self._lock:
            if entry.cached and entry.descriptor is None and not entry.no_descriptor:
                entry.descriptor = open_descriptor(entry)
                entry.no_descriptor = entry.descriptor is None
                self._descriptors += entry.descriptor is not None
            descriptor = entry.descriptor
            evicted = self._evict_locked()
        for old in evicted:
            old.close()
        return descriptor

    def _untouch_locked(self, entry: MappedFile) -> None:
        """An entry leaving the cache is unmapped (now, or when its last gather lets go)."""
        entry.cached = False
        self._descriptors -= entry.descriptor is not None
        if entry in self._touched:
            del self._touched[entry]
            self._resident -= entry.resident
            entry.resident = 0

    def _evict_locked(self) -> list[MappedFile]:
        evicted = []
        while len(self._entries) > 1 and (len(self._entries) > self.max_maps or self._bytes > self.max_bytes
                                          or len(self._entries) + self._descriptors > self.max_descriptors):
            _, entry = self._entries.popitem(last=False)
            self._bytes -= entry.nbytes
            self._untouch_locked(entry)
            evicted.append(entry)
        return evicted


class ArrayMaps:
    """One array's front on the shared maps: a lock-free ``chunk -> map`` lookup for the gather.

    A hit costs a dict lookup and the ``fstat`` size check; a miss, or a map the shared cache has
    dropped since, goes to the shared cache. Dropped maps are closed there, so what is remembered
    here never holds a descriptor or a map; the forgotten ones are pruned as they pile up.
    """

    def __init__(self, owner: str, shape: tuple[int, int], path_of: Callable[[int], str],
                 check_size: Callable[[str, int], None]) -> None:
        self._owner, self._shape, self._path_of, self._check_size = owner, shape, path_of, check_size
        self._seen: dict[int, MappedFile] = {}

    def rows(self, chunk: int, populate: bool = False, inode: int | None = None) -> np.ndarray:
        """Rows of ``chunk`` (see :meth:`ChunkMaps.entry`); the file's size is checked every time."""
        return self.view(chunk, populate, inode)[0]

    def view(self, chunk: int, populate: bool = False, inode: int | None = None) -> tuple[np.ndarray, MappedFile]:
        """:meth:`rows`, and the map's entry (``opened``: when its file was opened, monotonic; what
        a gather copied from it goes to :meth:`ChunkMaps.touched`)."""
        entry = self._seen.get(chunk)
        if entry is not None and inode is None:
            rows = entry.checked_rows()
            if rows is not None:
                return rows, entry
        maps = shared()
        entry, rows = maps.entry(self._owner, chunk, self._path_of, shape=self._shape,
                                 check_size=self._check_size, populate=populate, inode=inode)
        if len(self._seen) >= 2 * maps.max_maps:
            self._seen = {c: e for c, e in self._seen.items() if e.rows is not None}
        self._seen[chunk] = entry
        return rows, entry

    def forget(self, chunk: int) -> None:
        self._seen.pop(chunk, None)
        shared().forget(self._owner, chunk)

    def cached(self, chunk: int, inode: int | None = None) -> bool:
        """Whether the whole chunk is in the page cache (mapping it first, see :meth:`view`):
        ``mincore`` on its map where that tells the truth, else a sampled probe
        (:func:`~featurestore.core.pread.sampled_cached`); False where neither can tell."""
        rows, entry = self.view(chunk, False, inode)
        if entry.mincore_truthful:
            return pread.resident(entry.address, rows.nbytes) is True
        return pread.sampled_cached(entry.path, rows.nbytes) is True

    def in_memory(self, chunk: int, rows: list[int]) -> bool:
        """Whether rows ``rows`` (ascending) of ``chunk`` can be copied now without opening a
        file or waiting on a disk: this array already holds the chunk's map (of the size it was
        mapped with) and every page of the rows is in the page cache (``mincore`` where its
        answer is truthful, :func:`~featurestore.core.mapped_file.mincore_truthful`; else a read
        that refuses to wait)."""
        entry = self._seen.get(chunk)
        if entry is None or entry.checked_rows() is None:
            return False
        width = self._shape[1]
        if not entry.mincore_truthful:
            return pread.cached_now(entry.path, entry.inode, rows, width) is True
        return pread.resident(entry.address + rows[0] * width, (rows[-1] - rows[0] + 1) * width) is True

    def gather(self, index: np.ndarray, rows: np.ndarray, populate: bool = False, array_nbytes: int = 0,
               pool: pread.ReadPool | None = None) -> float:
        """Copy rows ``index`` of the array into ``rows`` (``[len(index), row bytes]``); returns
        when the newest map it used was opened (monotonic; -inf: none).

        Rows are visited in ascending storage order and each is copied to its own output slot:
        sequential source addresses keep the page walk and prefetchers on one chunk at a time
        (measured on shuffled batches: ~11-12 GB/s, as np.memmap's gather, against 8-10 in the
        caller's order). Runs that are consecutive in both storage and output (sequential
        reads) are copied as one slice. Each chunk is so visited once: its size is checked on
        its map's descriptor right before its rows are copied (a file truncated in place since
        would raise SIGBUS on the copy). What the copies of a chunk mapped in (whole folios,
        counted once per chunk) goes to :meth:`ChunkMaps.touched` at least every quarter of the
        budget, so one long gather (a whole bag) stays within it too; a large one over several
        chunks is shared with ``pool``'s threads, a chunk's runs each. A :func:`scattered` one (a
        range too, of rows of :data:`DIRECT_ROW` or more) is read through the maps' descriptors
        instead (``preadv``, over ``pool``'s threads when large:
        :mod:`~featurestore.core.descriptor_reads`): it maps nothing in, adds nothing to RSS. So
        are runs of :data:`LONG_RUN` or more on average from such an array, a ``preadv`` per piece
        of a run (:meth:`_read_runs`)."""
        chunk_rows, width = self._shape
        nbytes = len(index) * width
        budget = shared().max_resident
        if is_range(index) and not direct_rows(width, array_nbytes, budget):
            runs, _ = copy_runs(index, chunk_rows)
        else:
            rows_of = SortedRows(index, chunk_rows)
            direct = direct_rows(width, array_nbytes, budget) or scattered(
                nbytes, rows_of.chunks, chunk_rows * width, array_nbytes, budget, rows=len(index),
                # runs >= chunks: under 2 rows a chunk, scattered has no use for their count
                runs=len(rows_of.starts) if len(index) >= 2 * rows_of.chunks else len(index))
            if direct and (opened := self._read_direct(rows_of, rows, pool)) is not None:
                return opened
            runs = rows_of.runs()
        if (array_nbytes > budget and nbytes >= len(runs) * LONG_RUN
                and (opened := self._read_runs(runs, rows, pool)) is not None):
            return opened
        if nbytes < 2 * descriptor_reads.PIECE_BYTES or runs[0][0] == runs[-1][0]:
            return self._copy(runs, rows, populate)
        # A large copy over several chunks: shared with the pool's threads, a chunk's runs each.
        bounds = [i for i in range(1, len(runs)) if runs[i][0] != runs[i - 1][0]]
        parts = [runs[lo:hi] for lo, hi in zip([0, *bounds], [*bounds, len(runs)])]
        opened: list[float] = []
        descriptor_reads.share(lambda i: opened.append(self._copy(parts[i], rows, populate)), len(parts), nbytes, pool)
        return max(opened)

    def _copy(self, runs: list[tuple[int, int, int, int]], rows: np.ndarray, populate: bool) -> float:
        """The runs' rows out of the maps (:meth:`gather`), counted; returns when the newest map
        used was opened."""
        width, maps, folio, current, newest = self._shape[1], shared(), FOLIO, -1, float("-inf")
        touched: list[tuple[MappedFile, int]] = []
        pending = mapped = mapped_to = 0
        entry = None
        for chunk, first, target, length in runs:
            if chunk != current:
                if entry is not None:
                    touched.append((entry, mapped))
                    pending += mapped
                    if pending > maps.max_resident // 4:
                        maps.touched(touched)
                        touched, pending = [], 0
                view, entry = self.view(chunk, populate)
                newest, current, mapped, mapped_to = max(newest, entry.opened), chunk, 0, 0
                released = entry.resident == 0  # nothing of it mapped in: long runs map in first
            if released and length * width >= _POPULATE_RUN:
                entry.map_in(first * width, length * width)
            if length == 1:
                rows[target] = view[first]
            else:
                rows[target : target + length] = view[first : first + length]
            low = max(first * width // folio * folio, mapped_to)
            high = -(-(first + length) * width // folio) * folio
            if high > low:
                mapped, mapped_to = mapped + high - low, high
        if entry is not None:
            touched.append((entry, mapped))
            maps.touched(touched)
        return newest

    def _read_direct(self, rows_of: SortedRows, rows: np.ndarray, pool: pread.ReadPool | None) -> float | None:
        """Shuffled rows through their chunks' descriptors (:meth:`gather`); returns when the newest
        map used was opened, or None when a chunk's map has no usable descriptor (its path names
        another file now): the gather copies every row out of the maps then. Each chunk's size is
        checked on its map, at most every :data:`SIZE_RECHECK_S` (a file of another size is mapped
        again, or refused, by :meth:`view`; one truncated in between gives a short read, refused by
        name). The descriptors are taken a group of chunks at a time
        (:func:`open_files.per_read`), held until their rows are read."""
        width = self._shape[1]
        starts = rows_of.chunk_starts.tolist()  # each chunk's first row
        chunks = rows_of.chunk[starts].tolist()
        file_of = rows_of.chunk_positions()  # each row's chunk

        def read(lo: int, hi: int, files: list[tuple[Descriptor, str]]) -> None:
            part = slice(starts[lo], starts[hi] if hi < len(chunks) else len(rows_of.order))
            read_rows(rows, rows_of.order[part], files, file_of[part] - lo, rows_of.offset[part] * width,
                      self._check_size, pool)

        return self._through_descriptors(chunks, read)

    def _read_runs(self, runs: list[tuple[int, int, int, int]], rows: np.ndarray,
                   pool: pread.ReadPool | None) -> float | None:
        """Long runs (a bag, a row range) through their chunks' descriptors, a ``preadv`` per piece
        of a run: as :meth:`_read_direct`, nothing mapped in, and no mapping back in of pages a
        release dropped (page cache warm, 8 MiB chunks: 17 GB/s against 11 through the maps)."""
        chunks = list(dict.fromkeys(run[0] for run in runs))  # ascending, as the runs
        first_run = np.searchsorted([run[0] for run in runs], chunks).tolist() + [len(runs)]

        def read(lo: int, hi: int, files: list[tuple[Descriptor, str]]) -> None:
            read_runs(rows, runs[first_run[lo] : first_run[hi]], files, dict(zip(chunks[lo:hi], range(hi - lo))),
                      self._check_size, pool)

        return self._through_descriptors(chunks, read)

    def _through_descriptors(self, chunks: list[int], read: Callable[[int, int, list[tuple[Descriptor, str]]], None]
                             ) -> float | None:
        """``read(lo, hi, files)`` for each group of ``chunks[lo:hi]`` (their descriptors and paths,
        taken a group at a time, :func:`open_files.per_read`, each chunk's size checked on its map
        at most every :data:`SIZE_RECHECK_S`); returns when the newest map used was opened, or None
        when a chunk's map has no usable descriptor (its path names another file now): the caller
        copies then."""
        maps, newest = shared(), float("-inf")
        group = open_files.per_read(maps.max_descriptors)
        stale = time.monotonic() - SIZE_RECHECK_S
        seen = self._seen
        for lo in range(0, len(chunks), group):
            files: list[tuple[Descriptor, str]] = []
            for chunk in chunks[lo : lo + group]:
                entry = seen.get(chunk)
                descriptor = None if entry is None else entry.descriptor
                if descriptor is None or (entry.size_checked < stale and entry.checked_rows() is None):
                    _, entry = self.view(chunk)
                    descriptor = maps.descriptor(entry)
                    if descriptor is None:
                        return None
                if entry.opened > newest:
                    newest = entry.opened
                files.append((descriptor, entry.path))
            try:
                read(lo, min(lo + group, len(chunks)), files)
            except Exception:  # a file cut short since: its map goes, the next read maps its path again
                for chunk in chunks[lo : lo + group]:
                    if (entry := seen.get(chunk)) is not None and entry.checked_rows() is None:
                        self.forget(chunk)
                raise
        return newest


_SHARED: ChunkMaps | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> ChunkMaps:
    """The process's cache (made on first use; a forked child starts with an empty one)."""
    global _SHARED
    if _SHARED is not None:  # the per-gather path: no lock once made
        return _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            maps = open_files.max_maps()  # FEATURESTORE_MAX_MAPS may ask for more than the share
            _SHARED = ChunkMaps(maps, pread.memory_limit() // 2, resident_budget(),
                                max(maps, open_files.descriptor_share()))
        return _SHARED


def _after_fork_in_child() -> None:
    global _SHARED, _SHARED_LOCK
    # The parent's lock may be held by a thread that did not come along: start over (its maps unmap as dropped).
    _SHARED, _SHARED_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
