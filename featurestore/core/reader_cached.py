"""The ``cached`` read path of :class:`~featurestore.core.reader.FeatureArray`: object storage
through the local chunk cache (:mod:`featurestore.core.storage.chunk_cache`).

A read makes the chunks it touches local (whole GETs, checked, :mod:`featurestore.core.cached_array`),
then gathers them with the local path (mmap or pread) from the cache directory. Chunks the cache
does not take (no room, a full disk) are read by ranged GETs, as without a cache. A cached file
found damaged by the first-read check of this process is removed and fetched again; one removed by
another process's eviction between the fetch and the read is fetched again too.

The first-read check of a file this process did not fetch itself is its crc32c against its own
trailer *and* against the split's seal for its position: a file replaced by another chunk's (its
own crc32c valid) is not the chunk its path promises: the trailer against the split's
``chunk_seals`` (either kind, :class:`featurestore.core.seals.SealTable`: no request per chunk).
Where the table seals nothing for the array (a dense split committed before it existed, an older
int8 split's scales): against the trailer of the object at that position on storage, of the
opened generation (4 bytes per chunk, one batch of ranged GETs, then the generation check).
docs/READS.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.core import cached_array, checked, pread
from featurestore.core.storage.cached import chunk_cache_of
from featurestore.errors import MissingChunks
from featurestore.format import layout
from featurestore.format.metadata import SplitMetadata

_CACHE_ATTEMPTS = 3  # fetch-and-read rounds of a cached read before it goes to ranged GETs


class CachedPath:
    """The cached path's part of ``FeatureArray`` (it uses the array's local and ranged gathers)."""

    # Provided by FeatureArray.
    _front: Any
    _verified: checked.Verified
    _storage: Any
    _key: str
    _split_key: str
    _ndim: int
    _warm_since: float
    chunk_rows: int
    num_chunks: int
    sample_nbytes: int
    metadata: dict[str, Any]
    path: str
    verify_reads: str
    read_pool: Any
    seals: tuple[Any, str] | None
    _generation: Callable[[], Any]

    def _chunk_path(self, chunk: int) -> str: ...
    def _array_maps(self) -> Any: ...
    def _gather_local(self, index: np.ndarray, rows: np.ndarray) -> None: ...
    # (RangesPath's, through FeatureArray: declared, not defined, so no stub shadows it)
    _gather_ranges_checked: Callable[[np.ndarray, np.ndarray, np.ndarray | None], None]

    def _cache_front(self) -> cached_array.CachedArray:
        if self._front is None:
            meta = SplitMetadata.from_json(self.metadata, self._split_key)
            nbytes = self.chunk_rows * self.sample_nbytes + layout.CRC_BYTES
            cache = chunk_cache_of(self._storage)
            assert cache is not None  # the "cached" path is chosen only for a storage with one
            self._front = cached_array.front(cache, self._storage, self._key,
                                             chunk_nbytes=nbytes, ndim=self._ndim, meta=meta)
        return self._front

    @property
    def chunk_cache(self) -> cached_array.CachedArray | None:
        """This array's front on the storage's chunk cache (``cache_dir``), or None."""
        return self._cache_front() if self.path == "cached" else None

    def _gather_cached(self, index: np.ndarray, rows: np.ndarray) -> None:
        """Make the touched chunks local (whole GETs, checked), then gather them with the local
        path; chunks the cache does not take are read by ranges. A cached file found damaged
        (first read per process, crc32c) is dropped and fetched again; one removed by another
        process's eviction between the fetch and the read is fetched again."""
        front = self._cache_front()
        wanted = np.unique(index // self.chunk_rows).tolist()
        for _ in range(_CACHE_ATTEMPTS):
            fetched, absent = front.ensure(wanted)
            self._verified.add(fetched)  # checked (size, crc32c, seal) as they came in
            if self.verify_reads != "off":
                damaged = self._check_cached(wanted, absent)
                if damaged:
                    for chunk in damaged:
                        front.drop(chunk)
                        self._array_maps().forget(chunk)
                    continue
            if absent:
                remote = np.isin(index // self.chunk_rows, absent)
                self._gather_ranges_checked(index[remote], rows, np.flatnonzero(remote))
                local = np.flatnonzero(~remote)
                if len(local):
                    part = np.empty((len(local), self.sample_nbytes), np.uint8)
                    if not self._local_attempt(index[local], part):
                        continue
                    rows[local] = part
                return
            if self._local_attempt(index, rows):
                return
        self._gather_ranges_checked(index, rows, None)  # evicted under us every time: read by ranges

    def _check_cached(self, wanted: list[int], absent: list[int]) -> list[int]:
        front = self._cache_front()
        skip = set(absent)
        pending = self._verified.pending([c for c in wanted if c not in skip])
        mine = [c for c in pending if front.checked_here(c)]  # fetched by this process's threads: checked then
        if mine:
            self._verified.add(mine, self.num_chunks)
            pending = [c for c in pending if not front.checked_here(c)]
        payload = self.chunk_rows * self.sample_nbytes

        paths = [self._chunk_path(c) for c in pending]
        sealed = self._sealed(pending) if pending else None
        try:
            reasons = checked.check_files(paths, payload, (self.read_pool or pread.default_pool()).executor(),
                                          sealed)
        except (FileNotFoundError, IsADirectoryError):  # evicted (or damaged) under us: one file at a time
            reasons = [_check_one(path, payload, k, sealed) for k, path in enumerate(paths)]
        damaged = {c: r for c, r in zip(pending, reasons) if r is not None}
        self._verified.add([c for c in pending if c not in damaged], self.num_chunks)
        return sorted(damaged)

    def _sealed(self, pending: list[int]) -> Callable[[int, memoryview], str | None] | None:
        """Whether the cached file of ``pending[k]`` is the chunk the split sealed for that
        position (``inspect`` of :func:`checked.check_files`), or None where nothing is sealed."""
        payload = self.chunk_rows * self.sample_nbytes
        crcs = None
        if self.seals is not None:  # the split's chunk_seals (either kind), read on first use
            table, name = self.seals
            crcs = table.crcs(name)
        if crcs is not None:
            def against_seal(k: int, chunk: memoryview) -> str | None:
                found, at = int.from_bytes(chunk[payload:], "little"), pending[k]
                want = int(crcs[at]) if at < len(crcs) and crcs[at] >= 0 else None
                if found == want:
                    return None
                return (f"crc32c {found:08x}, but the split's chunk_seals sealed "
                        f"{'nothing' if want is None else f'{want:08x}'} for chunk {at}: another chunk's file")
            return against_seal
        # Nothing sealed in a table (a dense split committed before chunk_seals existed, an older
        # int8 split's scales, an array opened without the split's seals): the crc32c trailer of
        # the object at that position on storage, this generation's (checked after), 4 bytes per
        # chunk in one batch of ranged GETs.
        keys = [layout.chunk_key(self._key, c, self._ndim) for c in pending]
        try:
            trailers = self._storage.read_ranges(keys, [payload] * len(keys), [payload + layout.CRC_BYTES] * len(keys))
        except FileNotFoundError:
            return None  # a chunk gone from storage: its read says so
        self._generation().after(time.monotonic())
        sealed_crcs = [bytes(t) for t in trailers]

        def against_storage(k: int, chunk: memoryview) -> str | None:
            found, want = bytes(chunk[payload:]), sealed_crcs[k]
            if found == want:
                return None
            return (f"crc32c {found[::-1].hex()}, but the store holds {want[::-1].hex()} for chunk {pending[k]}: "
                    "another chunk's file")
        return against_storage

    def _local_attempt(self, index: np.ndarray, rows: np.ndarray) -> bool:
        try:
            self._gather_local(index, rows)
        except (FileNotFoundError, IsADirectoryError, MissingChunks):
            self._warm_since = float("-inf")  # a chunk file left (evicted): check page-cache residency again
            return False
        return True


def _check_one(path: str, payload: int, k: int, sealed: Callable[[int, memoryview], str | None] | None
               ) -> str | None:
    inspect = None if sealed is None else (lambda _, chunk: sealed(k, chunk))
    try:
        return checked.check_files([path], payload, None, inspect)[0]
    except (FileNotFoundError, IsADirectoryError):
        return "gone"
