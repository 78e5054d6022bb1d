"""Block-checked reads of :class:`~featurestore.core.reader.FeatureArray`: on a split with
``block_seals`` (featurestore.format.block_seals) a read checks exactly the row blocks covering
its rows, not whole chunks.

The first read of a block in this process fetches the block's bytes (a positional read of the
local chunk file, or one ranged GET on object storage), checks them against the block's seal and
copies the requested rows out of those same bytes: one pass, where the whole-chunk check read an
int8 chunk of hundreds of MiB to deliver a few rows, and read the rows again after it. Rows of
blocks checked before are gathered by the array's usual path. The claims are
:class:`~featurestore.core.checked.Verified`'s, per block: one thread checks a block while the
others wait for it. Splits without block seals (written before them, compressed, or whose rows
are not linked to the split's ``chunk_seals``) keep the whole-chunk check.

Chunks smaller than :func:`block_check_bytes` (64 MiB unless ``FEATURESTORE_BLOCK_CHECK_MIB``
says otherwise) keep the whole-chunk path too: there the whole-chunk read is a sequential
read-ahead (a whole-object GET) whose bytes serve the chunk's later rows, and measured faster
than block by block locally (~3x over 48 MiB chunks) and no slower on S3 (8 MiB objects,
docs/READS.md); a chunk of hundreds of MiB (an int8 chunk of a wide shape) is not read whole for
a few rows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.core import block_seals, checked, pread
from featurestore.errors import CorruptChunk, InvalidOption
from featurestore.format import layout
from featurestore.format.block_seals import block_ok
from featurestore.format.metadata import BAGS

BLOCK_CHECK_MIB = 64  # default of FEATURESTORE_BLOCK_CHECK_MIB


def block_check_bytes() -> int:
    """Features chunks of at least this many payload bytes are checked by block."""
    raw = os.environ.get("FEATURESTORE_BLOCK_CHECK_MIB", "").strip()
    try:
        mib = float(raw) if raw else BLOCK_CHECK_MIB
    except ValueError:
        raise InvalidOption(f"FEATURESTORE_BLOCK_CHECK_MIB must be a number of MiB (e.g. 64), got {raw!r}") from None
    if mib < 0:
        raise InvalidOption(f"FEATURESTORE_BLOCK_CHECK_MIB must be >= 0, got {raw!r}")
    return int(mib * (1 << 20))


class BlocksPath:
    """The block-checked part of ``FeatureArray``."""

    # Provided by FeatureArray.
    _storage: Any
    _key: str
    _split_key: str
    _ndim: int
    name: str
    shape: tuple[int, ...]
    metadata: dict[str, Any]
    chunk_rows: int
    sample_nbytes: int
    num_chunks: int
    verify_reads: str
    read_pool: Any
    seals: tuple[Any, str] | None
    _blocks: Any
    _verified_blocks: checked.Verified

    # FeatureArray's (declared, not defined: no stub may shadow them in the method order)
    _chunk_path: Callable[[int], str]
    _check_size: Callable[[str, int], None]
    _resolved_cache: Callable[[], str]
    _gather_local: Callable[[np.ndarray, np.ndarray], float]
    _missing: Callable[[str | None], Exception]

    def _checks_reads(self, path: str) -> bool:
        """Whether reads by ``path`` are checked on their first touch (featurestore.core.checked):
        none with ``verify_reads="off"``; under "auto" no local read that bypasses the page cache."""
        if self.verify_reads == "off":
            return False
        return not (path == "mmap" and self.verify_reads == "auto" and self._resolved_cache() == "direct")

    def _block_table(self, path: str) -> block_seals.BlockTable | None:
        """The split's block seals where this read checks by block, else None."""
        if self.verify_reads not in checked.VERIFY_MODES:
            raise InvalidOption(f"verify_reads must be one of {', '.join(checked.VERIFY_MODES)}, "
                                f"got {self.verify_reads!r}")
        if path not in ("mmap", "ranges") or not self._checks_reads(path):
            return None
        # Small chunks keep the whole-chunk check, a read-ahead for a shuffled epoch's later rows;
        # local reads of a bag split read whole bags (runs of rows), whose blocks are just the
        # bytes they need: checked by block whatever the chunk's size.
        whole_runs = path == "mmap" and self.metadata.get("kind") == BAGS
        if self._blocks is None and self.chunk_rows * self.sample_nbytes < block_check_bytes() and not whole_runs:
            self._blocks = False
        if self._blocks is None:
            sealed = None
            if self.seals is not None and self.name == layout.FEATURES:
                table, name = self.seals
                sealed = table.crcs(name)
            found = block_seals.load(self._storage, self._split_key, chunk_rows=self.chunk_rows,
                                     sample_nbytes=self.sample_nbytes, num_chunks=self.num_chunks, sealed=sealed)
            self._blocks = False if found is None else found  # False: none usable
        return None if self._blocks is False else self._blocks

    def _gather_local_checked(self, index: np.ndarray, rows: np.ndarray) -> float | None:
        """Rows ``index`` of local chunk files into ``rows``, blocks checked on first read;
        returns by when the files were opened (the generation check's ``since``), or None where
        the split has no block seals (the caller checks whole chunks)."""
        table = self._block_table("mmap")
        if table is None:
            return None
        if self._verified_blocks.all_of(self._blocks_with_rows(table)):
            return self._gather_local(index, rows)
        rest, opened = self._read_blocks(index, rows, table, "mmap")
        if len(rest) == len(index):
            opened = max(opened, self._gather_local(index, rows))
        elif len(rest):
            part = np.empty((len(rest), self.sample_nbytes), np.uint8)
            opened = max(opened, self._gather_local(index[rest], part))
            rows[rest] = part
        return opened

    def _read_blocks(self, index: np.ndarray, rows: np.ndarray, table: block_seals.BlockTable,
                     path: str) -> tuple[np.ndarray, float]:
        """Rows of ``index`` in blocks this process has not checked: their blocks fetched, checked
        and the rows copied into ``rows``. Returns the positions of ``index`` left to gather (their
        blocks were checked before) and by when the files read were opened (local)."""
        chunk_of, offset = np.divmod(index, self.chunk_rows)
        block_of = offset // table.block_rows
        unit = chunk_of * table.per_chunk + block_of
        wanted = np.unique(unit).tolist()
        filled = np.zeros(len(index), bool)
        opened = float("-inf")
        total = self._blocks_with_rows(table)
        while True:  # blocks another thread is checking: wait for it, then whatever it failed on
            pending, others = self._verified_blocks.claim(wanted)
            if pending:
                # CHECK_BYTES of blocks at a time: scattered small rows of a cold epoch touch
                # a block each, and the ranged GETs' bytes would otherwise grow with the batch
                step = max(1, checked.CHECK_BYTES // (table.block_rows * self.sample_nbytes))
                try:
                    for first in range(0, len(pending), step):
                        part = pending[first : first + step]
                        opened = max(opened, self._copy_blocks(part, table, path, unit, offset, block_of, rows))
                except BaseException:
                    self._verified_blocks.release(pending)
                    raise
                filled[np.isin(unit, pending)] = True
                self._verified_blocks.add(pending, total)
            if not others:
                return np.flatnonzero(~filled), opened
            for event in others:
                event.wait()

    def _copy_blocks(self, part: list[int], table: block_seals.BlockTable, path: str, unit: np.ndarray,
                     offset: np.ndarray, block_of: np.ndarray, rows: np.ndarray) -> float:
        """Blocks ``part`` fetched and checked, the rows of the read in them copied out of the
        same bytes; returns by when the files were opened."""
        at = np.flatnonzero(np.isin(unit, part))
        order = at[np.argsort(unit[at], kind="stable")]
        groups = {int(unit[g[0]]): g for g in np.split(order, np.flatnonzero(np.diff(unit[order])) + 1)}

        def copy(u: int, blob: Any) -> None:
            group = groups[u]
            data = np.frombuffer(blob, np.uint8).reshape(-1, self.sample_nbytes)
            rows[group] = data[offset[group] - block_of[group] * table.block_rows]

        def whole(u: int) -> np.ndarray | None:
            """Where the read wants block ``u``'s rows all, in order, one after another (a bag's
            block): that part of ``rows``, which the block is read straight into."""
            group = groups[u]
            chunk, j = divmod(u, table.per_chunk)
            count = min(self.chunk_rows, (j + 1) * table.block_rows) - j * table.block_rows
            if len(group) != count or int(group[-1]) - int(group[0]) != count - 1:
                return None
            if not np.array_equal(offset[group] - block_of[group] * table.block_rows, np.arange(count)):
                return None
            return rows[int(group[0]) : int(group[0]) + count].reshape(-1)

        if path != "ranges":
            return self._copy_local_blocks(part, table, copy, whole)
        blobs = self._fetch_blocks(part, table)
        opened = time.monotonic()
        self._check_blocks([u for u, blob in blobs.items() if not self._block_ok(u, blob, table)], table, path)
        for u, blob in blobs.items():
            copy(u, blob)
        return opened

    def _block_ok(self, u: int, blob: Any, table: block_seals.BlockTable) -> bool:
        chunk, j = divmod(u, table.per_chunk)
        return block_ok(blob, table.table[chunk], j)

    def _copy_local_blocks(self, part: list[int], table: block_seals.BlockTable,
                           copy: Callable[[int, Any], None], whole: Callable[[int], np.ndarray | None]) -> float:
        """Each block read by a pool thread into a block-sized buffer of the checked reads' pool,
        checked, and its rows copied out (memory: a block per thread in flight, whatever the
        read's size); a block the read wants whole (``whole``: where in the output) is read
        straight into its place and checked there. Returns by when the files were opened."""
        fds: dict[int, int] = {}
        drop = self._resolved_cache() in ("drop", "direct")
        spans = {u: self._span(u, table) for u in part}
        try:
            for c in dict.fromkeys(c for c, _, _ in spans.values()):
                where = self._chunk_path(c)
                try:
                    fd = os.open(where, os.O_RDONLY)
                except FileNotFoundError:
                    raise self._missing(where) from None
                fds[c] = fd
                self._check_size(where, os.fstat(fd).st_size)
            opened = time.monotonic()

            def one(u: int) -> bool:
                c, lo, hi = spans[u]
                target = whole(u)
                view = memoryview(checked.lease(hi - lo) if target is None else target)
                done = 0
                while done < len(view):
                    got = os.preadv(fds[c], [view[done:]], lo + done)
                    if got <= 0:  # the file shrank under us
                        raise CorruptChunk(checked.damage_message(
                            f"chunk {c} of {self._key} ({self._chunk_path(c)})",
                            "ended before its rows (truncated while reading)"))
                    done += got
                if drop:  # an array larger than the page cache: its blocks do not stay there
                    os.posix_fadvise(fds[c], lo, hi - lo, os.POSIX_FADV_DONTNEED)
                if not self._block_ok(u, view, table):
                    return False  # the caller raises: the rows already in the output are not served
                if target is None:
                    copy(u, view)
                return True  # the buffer goes back to the pool with this frame

            executor = (self.read_pool or pread.default_pool()).executor() if len(part) > 1 else None
            ok = list(executor.map(one, part)) if executor is not None else [one(u) for u in part]
        finally:
            for fd in fds.values():
                os.close(fd)
        self._check_blocks([u for u, good in zip(part, ok) if not good], table, "mmap")
        return opened

    def _blocks_with_rows(self, table: block_seals.BlockTable) -> int:
        """How many blocks hold rows of the array (a last chunk's blocks past its rows hold none:
        no read checks them)."""
        if not self.num_chunks:
            return 0
        last = self.shape[0] - (self.num_chunks - 1) * self.chunk_rows
        return (self.num_chunks - 1) * table.per_chunk + -(-last // table.block_rows)

    def _span(self, unit: int, table: block_seals.BlockTable) -> tuple[int, int, int]:
        chunk, j = divmod(unit, table.per_chunk)
        lo = j * table.block_rows
        hi = min(self.chunk_rows, lo + table.block_rows)
        return chunk, lo * self.sample_nbytes, hi * self.sample_nbytes

    def _fetch_blocks(self, pending: list[int], table: block_seals.BlockTable) -> dict[int, Any]:
        """Blocks ``pending`` from object storage: one ranged GET each, all at once."""
        spans = [self._span(u, table) for u in pending]
        keys = [layout.chunk_key(self._key, c, self._ndim) for c, _, _ in spans]
        try:
            blobs = self._storage.read_ranges(keys, [lo for _, lo, _ in spans], [hi for _, _, hi in spans])
        except FileNotFoundError:
            gone = next((k for k in dict.fromkeys(keys) if not self._storage.exists(k)), None)
            if gone is None:  # all there: a range past the end of an object shorter than its rows
                self._sizes_checked(keys)
            raise self._missing(gone) from None
        except OSError:  # e.g. S3 "range not satisfiable": an object shorter than its rows
            self._sizes_checked(keys)
            raise
        for (c, lo, hi), blob, key in zip(spans, blobs, keys):
            if len(blob) != hi - lo:
                raise CorruptChunk(checked.damage_message(
                    f"chunk {c} of {self._key} ({self._storage.url}/{key})",
                    f"{len(blob)} bytes where {hi - lo} were requested (truncated object)"))
        return dict(zip(pending, blobs))

    def _check_blocks(self, damaged_units: list[int], table: block_seals.BlockTable, path: str) -> None:
        """:class:`CorruptChunk` naming the first of ``damaged_units`` (blocks whose bytes did not
        match their seals), if any."""
        if not damaged_units:
            return
        chunk, j = divmod(min(damaged_units), table.per_chunk)
        lo, hi = j * table.block_rows, min(self.chunk_rows, (j + 1) * table.block_rows)
        first = chunk * self.chunk_rows
        where = (self._chunk_path(chunk) if path == "mmap"
                 else f"{self._storage.url}/{layout.chunk_key(self._key, chunk, self._ndim)}")
        more = (f" (and {len(damaged_units) - 1} more block(s) read by the same batch)"
                if len(damaged_units) > 1 else "")
        raise CorruptChunk(checked.damage_message(
            f"block {j} (rows {first + lo}-{first + hi - 1}) of chunk {chunk} of {self._key} ({where}){more}",
            "crc32c mismatch against its block seal (flipped or truncated bytes)"))

    def _sizes_checked(self, keys: list[str]) -> None:
        """``CorruptChunk`` for the first of ``keys`` whose size is not a chunk's (payload and trailer)."""
        expected = self.chunk_rows * self.sample_nbytes + layout.CRC_BYTES
        for key in dict.fromkeys(keys):
            size = self._storage.size(key)
            if size is not None and size != expected:
                raise CorruptChunk(checked.damage_message(
                    f"chunk {self._storage.url}/{key}", f"size {size} bytes, expected {expected}")) from None
