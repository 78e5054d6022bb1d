"""FeatureArray: gather any list of rows of one stored array into one preallocated buffer.

Three paths behind one interface, chosen when the array is opened, all returning the same bytes:

* ``mmap`` (local, uncompressed): chunk files are memory-mapped and rows are copied straight from
  the page cache into the output. The maps live in one bounded LRU per process
  (:mod:`featurestore.core.chunk_maps`), shared by every array, so descriptors and maps stay
  bounded whatever the chunk count; a forked DataLoader worker starts with its own. Rows that are
  not page-cached are read with concurrent preads instead (:mod:`featurestore.core.pread`).
* ``ranges`` (object storage / any fsspec URL, uncompressed): one byte range per run of adjacent
  requested rows, all fetched in one ``cat_ranges`` call, which s3fs and gcsfs issue concurrently.
* ``cached`` (object storage with a chunk cache, uncompressed): the chunks a read touches are
  fetched whole into the local cache directory (:mod:`featurestore.core.storage.chunk_cache`), then
  gathered from there by the local path (mmap or pread); chunks the cache cannot take (no room,
  a full disk) are read by ranges.
* ``zarr`` (compressed arrays): zarr-python decodes the touched chunks.

Every path returns rows of the generation the array was opened as, or raises ``SplitChanged``
naming the split (featurestore.core.generation: one check shared by every path); a chunk found
missing or damaged is first asked whether the split changed, so an overwrite is never reported
as a damaged store.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
# np.unique imports numpy.ma lazily on its first call; made by several read threads at once (or in
# a child forked while a thread imported it) that import can recurse until RecursionError. Import
# it here, once, in the importing thread.
import numpy.ma  # noqa: F401

from featurestore.core import checked, chunk_maps, generation, pread, quantize_int8
from featurestore.core.buffers import aligned_empty, anonymous
from featurestore.core.reader_blocks import BlocksPath
from featurestore.core.reader_cached import CachedPath
from featurestore.core.reader_memory import MemoryPath
from featurestore.core.reader_ranges import RangesPath, chunks_of
from featurestore.core.storage import Storage
from featurestore.core.storage.cached import chunk_cache_of
from featurestore.errors import (
    REPAIR_ADVICE,
    CorruptChunk,
    IndexOutOfRange,
    InvalidOption,
    MissingChunks,
    SampleNotFound,
    ShapeMismatch,
)
from featurestore.format import chunks, dtypes, layout, sample_ids
from featurestore.format.wire import as_index_array, check_bounds


#: A read converted to another dtype passes its stored rows through a buffer of at most this size.
CONVERT_PIECE_BYTES = 4 << 20


class FeatureArray(CachedPath, RangesPath, BlocksPath, MemoryPath):
    """One stored array (``features`` or ``labels``) of a split."""

    def __init__(
        self,
        storage: Storage,
        split_key: str,
        name: str,
        array_doc: dict[str, Any],
        *,
        logical_dtype: str,
        metadata: dict[str, Any],
        labels: FeatureArray | None = None,
    ) -> None:
        self._storage = storage
        self._split_key = split_key
        self._key = f"{split_key}/{name}"
        self.name = name
        self.shape: tuple[int, ...] = tuple(int(s) for s in array_doc["shape"])
        self.sample_shape = self.shape[1:]
        self.dtype = logical_dtype
        self.numpy_dtype = dtypes.storage_dtype(logical_dtype)
        self.chunk_rows = layout.array_chunk_rows(array_doc)
        self.sample_nbytes = int(np.prod(self.sample_shape, dtype=np.int64)) * self.numpy_dtype.itemsize
        self.metadata = metadata
        self.labels = labels
        self._ndim = len(self.shape)
        self._compressed = layout.is_compressed(array_doc)
        if self._compressed:
            self.path = "zarr"
        elif storage.local_path(self._key) is not None:
            self.path = "mmap"
        elif chunk_cache_of(storage) is not None and metadata.get("status") == "complete":
            self.path = "cached"
        else:
            self.path = "ranges"
        self._front = None  # this array's front on the chunk cache (CachedPath), made on first use
        # Local uncompressed arrays: which gather ("auto", "mmap", "pread") and what the page cache
        # does with pread's bytes ("keep", "drop", "direct"); docs/READS.md has the figures.
        self.local_read = _setting("FEATURESTORE_LOCAL_READ", "auto", LOCAL_READS)
        self.cache = _setting("FEATURESTORE_READ_CACHE", "auto", pread.CACHE_MODES)
        self._auto_cache: tuple[int, str] | None = None
        self.verify_reads = _setting("FEATURESTORE_VERIFY_READS", "auto", checked.VERIFY_MODES)
        self._verified = checked.Verified()
        self._verified_blocks = checked.Verified()  # by block, on a split with block seals (reader_blocks)
        self._blocks: Any = None  # its block seals, read on the first checked read
        self.read_pool: pread.ReadPool | None = None  # None: the process's default pool
        self.read_counts = {"mmap": 0, "inline": 0, "pool": 0}
        self._warm: np.ndarray | None = None  # chunks found wholly page-cached (see _cached)
        self._warm_since = 0.0
        self._pid = os.getpid()
        self._zarr: Any = None
        self._maps: chunk_maps.ArrayMaps | None = None
        self._gen: generation.GenerationCheck | None = None
        # The split's chunk_seals for this array (featurestore.core.seals.SealTable, name), set by
        # whoever opens the split: the cached path checks a cached file against its position's seal.
        self.seals: tuple[Any, str] | None = None
        self._id_table: dict[str, int] | None = None
        # int8 dense splits: scales per chunk (a bag split's are per bag: core.bag_array dequantizes)
        self.scales = (quantize_int8.ScalesTable(storage, split_key, complete=metadata.get("status") == "complete")
                       if dtypes.is_int8(logical_dtype) and "kind" not in metadata else None)

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.sample_nbytes

    @property
    def num_chunks(self) -> int:
        return layout.num_chunks(self.shape[0], self.chunk_rows)

    @property
    def storage(self) -> Any:
        """The storage this array reads through (on object storage its ``bytes_read`` counts the
        bytes of GET responses, and ``obstore`` is its client: tools and benches use both)."""
        return self._storage

    def chunk_keys(self) -> list[str]:
        """The storage keys of this array's chunk objects, in order (to fetch them whole)."""
        return [layout.chunk_key(self._key, c, len(self.shape)) for c in range(self.num_chunks)]

    @property
    def ids(self) -> list[str] | None:
        if not self._storage.exists(f"{self._split_key}/{layout.IDS}/{layout.ZARR_JSON}"):
            return None
        import zarr

        array = zarr.open_array(store=self._storage.zarr_store(), path=f"{self._split_key}/{layout.IDS}", mode="r")
        return [str(v) for v in array[:]]

    def positions_of(self, ids: Any) -> np.ndarray:
        """int64 positions of the samples named by ``ids`` (any order, repeats allowed); an unknown
        id is :class:`SampleNotFound` naming it."""
        if self._id_table is None:
            held = self.ids
            if held is None:
                raise SampleNotFound(f"split {self._split_key} has no sample ids: read it by position")
            self._id_table = sample_ids.id_positions(held)
        return sample_ids.positions_of(ids, self._id_table, f"split {self._split_key}")

    def __repr__(self) -> str:
        return f"FeatureArray({self._key!r}, shape={self.shape}, dtype={self.dtype!r}, path={self.path!r})"

    # ------------------------------------------------------------------ reads
    def read(self, indices: Any) -> Any:
        """Rows ``indices`` as a torch tensor of the stored dtype (torch.bfloat16 for bfloat16;
        float32 values for an int8 split, whose stored codes are not features)."""
        if self.scales is not None:
            return dtypes.to_torch(self.read_numpy(indices, dtype="float32"), "float32")
        return dtypes.to_torch(self.read_numpy(indices), self.dtype)

    def read_range(self, start: int, stop: int) -> np.ndarray:
        if not (0 <= start <= stop <= len(self)):
            raise IndexOutOfRange(f"range [{start}, {stop}) is outside [0, {len(self)}]: use 0 <= start <= stop <= {len(self)}")
        return self.read_numpy(np.arange(start, stop, dtype=np.int64))

    def read_numpy(self, indices: Any, out: np.ndarray | None = None, dtype: str | None = None) -> np.ndarray:
        """Rows ``indices`` (any order, duplicates allowed) in the storage dtype (uint16 bits for
        bfloat16, int8 codes for int8: values are ``codes * self.scales.table()[row // chunk_rows]``),
        or as ``dtype`` ("float32" or "float16": an int8 split dequantized into ``out``).
        ``out``, if given, must be a C-contiguous array of that shape and dtype; make it with
        :func:`aligned_empty` for full copy speed."""
        want = quantize_int8.check_read_dtype(dtype, self.dtype)
        if want is not None and (self.scales is not None or np.dtype(want) != self.numpy_dtype):
            return self._read_as(indices, out, want)
        index = self._normalize(indices)
        shape = (len(index), *self.sample_shape)
        if out is None:
            out = aligned_empty(shape, self.numpy_dtype)
        elif out.shape != shape or out.dtype != self.numpy_dtype or not out.flags.c_contiguous:
            raise ShapeMismatch(
                f"out has shape {out.shape} and dtype {out.dtype}; this read needs a C-contiguous "
                f"{shape} array of {self.numpy_dtype}"
            )
        if len(index):
            rows = out.reshape(len(index), -1).view(np.uint8)
            try:
                if self.path == "mmap":
                    opened = self._gather_local_checked(index, rows)  # None: no block seals
                    if opened is None:
                        self._verify(index)
                        opened = self._gather_local(index, rows)
                    # after the files this read opened (none: maps already checked)
                    self._generation().after(opened)
                elif self.path == "cached":
                    self._gather_cached(index, rows)
                elif self.path == "ranges":
                    self._gather_ranges_checked(index, rows, None)
                else:
                    since = time.monotonic()
                    self._gather_zarr(index, out)
                    self._generation().after(since)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError, MissingChunks, CorruptChunk) as error:
                # An overwrite deletes and rewrites chunks: that is SplitChanged, not damage.
                if (changed := self._generation().changed()) is not None:
                    raise changed from None
                if isinstance(error, (MissingChunks, CorruptChunk)):
                    raise
                raise self._missing(error.filename) from None
        return out

    def _read_as(self, indices: Any, out: np.ndarray | None, want: str) -> np.ndarray:
        index = self._normalize(indices)
        shape = (len(index), *self.sample_shape)
        if out is None:
            out = aligned_empty(shape, np.dtype(want))
        elif out.shape != shape or out.dtype != np.dtype(want) or not out.flags.c_contiguous:
            raise ShapeMismatch(f"out has shape {out.shape} and dtype {out.dtype}; this read needs a "
                                f"C-contiguous {shape} array of {want}")
        # Stored rows pass through one buffer of its own map, piece by piece: a whole stored copy
        # (and a float32 one) per read held a server at 1.5x each converted response, kept by
        # malloc (a walk: 491 MB idle). Remote pieces are larger: their requests go together.
        piece_bytes = CONVERT_PIECE_BYTES * (1 if self.path == "mmap" else 16)
        rows = max(1, min(len(index), piece_bytes // max(self.sample_nbytes, 1)))
        piece = anonymous(rows * self.sample_nbytes).view(self.numpy_dtype).reshape(rows, *self.sample_shape)
        for lo in range(0, len(index), rows):
            part = index[lo : lo + rows]
            stored = self.read_numpy(part, out=piece[: len(part)])
            if self.scales is not None:
                self.scales.dequantize(stored, part, self.chunk_rows, out[lo : lo + len(part)])
            else:  # cast on assignment (numpy's buffered loop): no temporary of the piece's size
                out[lo : lo + len(part)] = stored.view(dtypes.BFLOAT16) if self.dtype == "bfloat16" else stored
        return out

    def _generation(self) -> generation.GenerationCheck:
        """The process's check that the split is still the generation this array was opened as."""
        if self._gen is None:
            self._gen = generation.for_split(self._storage, self._split_key, self.metadata)
        return self._gen

    # ------------------------------------------------------------------ checked reads
    def _verify(self, index: np.ndarray, path: str | None = None) -> dict[int, Any]:
        """crc32c of every chunk this read touches that this process has not verified yet
        (featurestore.core.checked has the policy and its cost). On object storage the chunks
        checked are fetched whole: returns them, ``{chunk: bytes}``, for the caller to take this
        read's rows from (no second request for them)."""
        mode = self.verify_reads
        if mode not in checked.VERIFY_MODES:
            raise InvalidOption(f"verify_reads must be one of {', '.join(checked.VERIFY_MODES)}, got {mode!r}")
        path = path or self.path
        # zarr's codec checks itself; cached: _gather_cached
        if path in ("zarr", "cached") or not self._checks_reads(path) or self._verified.complete(self.num_chunks):
            return {}
        wanted = chunks_of(index, self.chunk_rows).tolist()
        fresh: dict[int, Any] = {}
        while True:  # chunks another thread is checking: wait for it, then whatever it failed on
            pending, others = self._verified.claim(wanted)
            if pending:
                try:
                    fresh.update(self._verify_chunks(pending, path))
                except BaseException:
                    self._verified.release(pending)
                    raise
                self._verified.add(pending, self.num_chunks)
            if not others:
                return fresh
            for event in others:
                event.wait()

    def _verify_chunks(self, pending: list[int], path: str) -> dict[int, Any]:
        fresh: dict[int, Any] = {}
        payload = self.chunk_rows * self.sample_nbytes
        if path == "mmap":
            executor = (self.read_pool or pread.default_pool()).executor()
            try:
                reasons = checked.check_files([self._chunk_path(c) for c in pending], payload, executor)
            except FileNotFoundError as error:
                raise self._missing(error.filename) from None
            damaged = {c: r for c, r in zip(pending, reasons) if r is not None}
            where = self._chunk_path
        else:
            keys = [layout.chunk_key(self._key, c, self._ndim) for c in pending]
            try:
                blobs = self._storage.read_many(keys)
            except FileNotFoundError:
                gone = next((k for k in keys if not self._storage.exists(k)), None)
                raise self._missing(gone) from None
            damaged = {c: r for c, blob in zip(pending, blobs) if (r := chunks.check(blob, payload)) is not None}
            fresh = dict(zip(pending, blobs))

            def where(chunk: int) -> str:
                return f"{self._storage.url}/{layout.chunk_key(self._key, chunk, self._ndim)}"
        if damaged:
            chunk, reason = next(iter(sorted(damaged.items())))
            more = f" (and {len(damaged) - 1} more chunk(s) read by the same batch)" if len(damaged) > 1 else ""
            raise CorruptChunk(checked.damage_message(f"chunk {chunk} of {self._key} ({where(chunk)}){more}", reason))
        return fresh

    def _missing(self, chunk: str | None) -> MissingChunks:
        where = f"chunk {chunk}" if chunk else "some requested rows' chunks"
        if self.metadata.get("status") != "complete":  # opened with allow_incomplete=True
            return MissingChunks(f"{self._key}: {where} has not been written yet (status "
                                 f"{self.metadata.get('status')!r}): read only written rows, or resume the split first")
        return MissingChunks(f"{self._key}: {where} is missing from a complete split (damaged store): "
                             f"{REPAIR_ADVICE}")

    def _normalize(self, indices: Any) -> np.ndarray:
        index = as_index_array(indices)
        check_bounds(index, len(self), self._key)
        return index

    # ------------------------------------------------------------------ local paths
    def _check_size(self, path: str, size: int) -> None:
        expected = self.chunk_rows * self.sample_nbytes + layout.CRC_BYTES
        if size != expected:
            raise CorruptChunk(f"chunk file {path} has {size} bytes, expected {expected} (truncated or "
                               f"overwritten): {REPAIR_ADVICE}")

    def _gather_local(self, index: np.ndarray, rows: np.ndarray) -> float:
        """Rows ``index`` from local chunk files into ``rows``; returns by when the files it
        read were opened (monotonic; -inf: only maps whose generation was checked already)."""
        mode = self.local_read
        if mode not in LOCAL_READS:
            raise InvalidOption(f"local_read must be one of {', '.join(LOCAL_READS)}, got {mode!r}")
        if os.getpid() != self._pid:  # forked: what was found page-cached is the parent's news
            self._warm, self._maps = None, None
            self._pid = os.getpid()
        if mode == "mmap" or (mode == "auto" and self._cached(index)):
            opened = self._gather_mmap(index, rows, populate=mode == "mmap")
            self.read_counts["mmap"] += 1
            return opened
        counts = pread.gather(index, rows, chunk_rows=self.chunk_rows, path_of=self._chunk_path,
                              expected_size=self.chunk_rows * self.sample_nbytes + layout.CRC_BYTES,
                              pool=self.read_pool, cache=self._resolved_cache())
        self.read_counts["inline"] += counts["inline"]
        self.read_counts["pool"] += counts["pool"]
        return time.monotonic()  # every descriptor was opened by this gather

    def _resolved_cache(self) -> str:
        if self.cache != "auto":
            return self.cache
        if self._auto_cache is None or self._auto_cache[0] != os.getpid():  # a forked worker: re-check
            self._auto_cache = (os.getpid(), pread.resolve_cache("auto", self.nbytes))
        return self._auto_cache[1]

    def _cached(self, index: np.ndarray) -> bool:
        """Whether every chunk the rows lie in is in the page cache: then the mmap gather is the
        fastest path; otherwise concurrent preads keep the disk busy.

        A chunk is checked whole (``mincore`` on a lazily made map, one call; sampled reads that
        refuse to wait for a disk where ``mincore`` does not tell the truth: a file this process
        may not write) the first time it is touched and then remembered as warm, so a page-cached
        epoch pays one numpy lookup per batch. The memory is dropped every ``_RECHECK_S`` seconds:
        a chunk evicted since is found cold again (until then the mmap gather only faults it back
        in: right bytes, slower).
        The same check stats each chunk file: a chunk deleted or truncated fails here with its
        name, and one replaced (a resume rewrote it) is mapped again. A read touching more chunks
        than the process keeps maps of goes to pread: its maps would not survive to the gather."""
        now = time.monotonic()
        if self._warm is None or now - self._warm_since > _RECHECK_S:
            self._warm = np.zeros(-(-len(self) // self.chunk_rows), bool)
            self._warm_since = now
        warm = self._warm
        if warm[index // self.chunk_rows].all():  # a warm epoch's answer, without np.unique's sort
            return True
        chunks, maps = chunks_of(index, self.chunk_rows), chunk_maps.shared()
        if len(chunks) > maps.max_maps:
            return False
        for chunk in chunks[~warm[chunks]].tolist():
            path = self._chunk_path(chunk)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise self._missing(path) from None
            self._check_size(path, st.st_size)
            if self._array_maps().cached(chunk, inode=st.st_ino):
                warm[chunk] = True
            else:
                return False
        return True

    def _array_maps(self) -> chunk_maps.ArrayMaps:
        """This array's front on the process's shared chunk maps (a forked or unpickled copy
        makes its own: the parent's maps are not in this process's bound)."""
        if self._maps is None:
            # one key per split, shared by reopens (a cached array: its generation's cache directory)
            # (a local array: its generation too, so a reader of a new generation never gets a map
            # an older one's reader made)
            owner = (self._cache_front().directory if self.path == "cached"
                     else f"{self._storage.local_path(self._key) or self._key}@{self.metadata.get('generation')}")
            self._maps = chunk_maps.ArrayMaps(owner, (self.chunk_rows, self.sample_nbytes), self._chunk_path,
                                              self._check_size)
        return self._maps

    def _chunk_path(self, chunk: int) -> str:
        if self.path == "cached":
            return self._cache_front().path(chunk)
        path = self._storage.local_path(layout.chunk_key(self._key, chunk, self._ndim))
        assert path is not None
        return path

    def _gather_mmap(self, index: np.ndarray, rows: np.ndarray, populate: bool = True) -> float:
        return self._array_maps().gather(index, rows, populate, array_nbytes=self.nbytes, pool=self.read_pool)

    # ------------------------------------------------------------------ zarr path
    def _gather_zarr(self, index: np.ndarray, out: np.ndarray) -> None:
        if self._zarr is None:
            import zarr

            self._zarr = zarr.open_array(store=self._storage.zarr_store(), path=self._key, mode="r")
        unique, inverse = np.unique(index, return_inverse=True)
        values = np.asarray(self._zarr.get_orthogonal_selection((unique,)))
        np.take(values.view(self.numpy_dtype), inverse.reshape(-1), axis=0, out=out)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_warm"] = None  # page-cache news are per process
        state["_maps"] = None  # memory maps are per process: reopened lazily after unpickling
        state["_zarr"] = None
        state["read_pool"] = None  # threads are per process
        state["_front"] = None  # the cache's front is per process (its threads, its plan)
        state["_gen"] = None  # the process's own check (its lock, its last document)
        return state


LOCAL_READS = ("auto", "mmap", "pread")
_RECHECK_S = 2.0  # how long "this chunk is page-cached" is trusted before mincore is asked again


def _setting(name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(name, default).strip().lower()
    if value not in allowed:
        raise InvalidOption(f"{name}={value!r} is not one of {', '.join(allowed)}: unset it or pick one of those")
    return value

