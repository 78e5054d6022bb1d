"""SplitWriter: buffers batches into whole chunks and writes each chunk once, atomically.

Chunk ownership (what makes several writers of one split safe): chunk ``i`` covers rows
``[i * chunk_rows, (i + 1) * chunk_rows)``, and a chunk is written only by the process that holds
all of its rows. Writers that share a split must give each chunk's rows to one process only
(``featurestore extract`` under torchrun gives chunk ``i`` to rank ``i % world_size``). Every
chunk is its own key, written with one atomic put, so disjoint writers never touch the same
bytes; the split's metadata is written by ``create_split`` (once, before the others attach with
``resume=True``) and by the one ``commit()`` at the end, which writes ``chunk_seals`` (each
chunk's crc32c at its place, featurestore.core.seals) right before it, and ``block_seals``
(each chunk's crc32c per row block, featurestore.core.block_seals: a read checks only the
blocks it reads) before that.

For chunk ``i`` the writer stores the labels chunk and the statistics row (together on object
storage), then the features chunk. The features chunk comes last, so its presence with a valid crc32c means the
whole chunk is done; a SIGKILL at any moment leaves either a done chunk or one that ``resume``
rewrites, and never a split marked complete.

Where the work happens: each ``write()`` is checked, cast and measured per sample where the
features are (featurestore.core.device_stats: on the encoder's device for a torch tensor, with
torch's CPU threads for host arrays; featurestore.core.batch without torch), so only stored-dtype
bytes and small per-sample statistics reach the chunk buffers. crc32c and the atomic puts of
finished chunks run in a small pool of put threads (featurestore.core.chunk_puts); ``flush``,
``close``, ``commit`` and ``report`` wait for them.

This module is the chunk assembly; what a ``write()`` accepts and how it is measured is
featurestore.core.intake, and the protocol's checks against storage (generation, commit,
report) are featurestore.core.split_protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.core import (
    block_seals,
    intake,
    lifecycle,
    quantize_int8,
    seals,
    split_protocol,
)
from featurestore.core.batch import Prepared
from featurestore.core.buffers import BufferPool
from featurestore.core.chunk_puts import ChunkPuts
from featurestore.core.storage import Storage
from featurestore.errors import (
    DtypeMismatch,
    IndexOutOfRange,
    MissingChunks,
    ShapeMismatch,
    SplitExists,
    SplitTakenOver,
    WriterClosed,
)
from featurestore.format import dtypes, layout
from featurestore.format.metadata import SplitMetadata, seal
from featurestore.format.stats import SOURCE_CODES, RowStats, fold_rows


@dataclass
class _Buffer:
    """The rows of one chunk gathered so far, with their per-sample statistics."""

    data: np.ndarray
    filled: np.ndarray
    labels: np.ndarray | None
    # Per-sample figures, folded per chunk only when it is written: a chunk's statistics row then
    # depends on its rows alone, never on how the batches were cut (resume gives equal bytes).
    rows: RowStats
    source_code: int = 0  # stats.SOURCE_CODES of the values written into this chunk


class SplitWriter(split_protocol.SplitSession):
    """Created by :meth:`featurestore.FeatureStore.create_split`; see docs/FORMAT.md."""

    def __init__(
        self,
        storage: Storage,
        key: str,
        metadata: SplitMetadata,
        *,
        done_chunks: set[int],
        label_dtype: np.dtype | None,
    ) -> None:
        self._storage = storage
        self._key = key
        self._meta = metadata
        self.num_samples: int = metadata.num_samples
        self.sample_shape: tuple[int, ...] = tuple(metadata.sample_shape)
        self.dtype: str = metadata.logical_dtype
        self.chunk_rows: int = metadata.chunk_rows
        self.num_chunks: int = metadata.num_chunks
        self.compressor: str | None = metadata.compressor
        self.channels = self.sample_shape[-1]
        self.label_shape: tuple[int, ...] | None = metadata.labels.shape if metadata.labels else None
        self._label_dtype = label_dtype
        # int8: rows wait as float32 until their chunk is complete (scales are per chunk)
        self._work_dtype = quantize_int8.working_dtype(self.dtype)
        self._storage_dtype = dtypes.storage_dtype(self._work_dtype)
        self._done = set(done_chunks)  # valid on storage (found there, or put by this writer)
        self._submitted = set(done_chunks)  # handed to the put pool (or found on storage)
        self._buffers: dict[int, _Buffer] = {}
        self._source_dtype: str | None = None
        self._tokens = int(np.prod(self.sample_shape[:-1], dtype=np.int64))  # values per channel per sample
        self._puts = ChunkPuts(storage, key, on_done=self._done.add, block_nbytes=block_seals.block_nbytes(metadata))
        # Cast batches and chunk buffers are leased: a buffer comes back when its chunk is on
        # storage. Fresh memory costs a page fault per 4 KiB on first touch, measured 3-20x a
        # copy into a reused buffer. At most 2 idle buffers and 512 MiB are kept on top of the
        # chunks in flight (docs/EXTRACT.md: the memory bound).
        self._pool = BufferPool(keep=2, max_free_bytes=512 << 20)
        self._closed = False
        intake.warm_up_soon(self._work_dtype)  # numba loads while the caller makes its first batch

    # ------------------------------------------------------------------ public API
    def pending_chunks(self) -> list[int]:
        """Chunks this writer has not seen valid on storage nor written itself."""
        return [i for i in range(self.num_chunks) if i not in self._submitted]

    def chunk_range(self, index: int) -> tuple[int, int]:
        start = index * self.chunk_rows
        return start, min(start + self.chunk_rows, self.num_samples)

    def write(self, start: int, features: Any, labels: Any = None, *, donate: bool = False) -> None:
        """Write rows ``[start, start + len(features))``; any order, any batch size.

        ``features``: a torch tensor (on any device: the checks, the cast and the statistics run
        there) or an array-like. The precision policy runs on the whole batch before any of it is
        buffered, so a refused batch leaves nothing behind. Chunk puts finish in the background;
        ``donate=True`` says the caller will not modify ``features`` afterwards, which saves a
        copy when no cast is needed (stored dtype == input dtype).
        """
        self._check_open()
        self._put_failures(self._puts.raise_error)
        source = intake.as_source(features)
        if source.ndim != len(self.sample_shape) + 1 or tuple(source.shape[1:]) != self.sample_shape:
            raise ShapeMismatch(
                f"features of shape {tuple(source.shape)} do not match this split's samples "
                f"{self.sample_shape}: pass a batch shaped [B, {', '.join(map(str, self.sample_shape))}]"
            )
        count = int(source.shape[0])
        if not isinstance(start, (int, np.integer)) or start < 0 or start + count > self.num_samples:
            raise IndexOutOfRange(
                f"rows [{start}, {start + count}) are outside this split's {self.num_samples} "
                f"samples: start must be an int in [0, {self.num_samples - count}]"
            )
        label_rows = self._check_labels(labels, count)
        if count == 0:
            return
        batch = self._prepare(source, int(start), private=not donate)
        self._source_dtype = self._source_dtype or batch.kind
        self._scatter(int(start), batch, label_rows, copy=batch.aliases_source and not donate)

    def _prepare(self, source: Any, start: int, *, private: bool) -> Prepared:
        return intake.prepare(source, self._work_dtype, self.channels, start, private=private,
                              allocate=self._pool.array)

    def flush(self) -> None:
        """Write every buffered chunk whose rows are all present, and wait for the puts."""
        for index in [i for i, b in self._buffers.items() if b.filled.all()]:
            self._write_chunk(index, self._buffers.pop(index))
        self._put_failures(self._puts.wait)

    def close(self) -> None:
        """Flush complete chunks and drop partial ones (they belong to another writer or a
        later resume). Does not mark the split complete."""
        if self._closed:
            return
        try:
            for index in [i for i, b in self._buffers.items() if b.filled.all()]:
                self._write_chunk(index, self._buffers.pop(index))
        finally:
            self._buffers.clear()
            self._closed = True
            self._puts.close()

    def commit(self) -> dict[str, Any]:
        """Flush, check that every chunk of the split is on storage, then mark it complete.

        Callable after :meth:`close` (the usual multi-writer sequence: every writer closes, then
        one commits). Committing a split that is already complete changes nothing. Returns the
        split's final metadata.
        """
        try:
            self._check_generation()
        except SplitExists:
            if self._buffers:  # rows this writer still held: not in the split another commit made
                raise
            # Every chunk was on storage for the other commit, and this writer holds nothing more.
            self._meta = split_protocol.stored_metadata(self._storage, self._key)
            self._puts.close()
            return self._meta.to_json()
        if self._meta.complete and not self._buffers:
            return self._meta.to_json()
        self.flush()
        if self._buffers:
            # Rows left out of chunks begun here, and the rows of chunks nobody wrote at all.
            untouched = [c for c in self._absent_on_storage() if c not in self._buffers]
            missing = sum(int((~b.filled).sum()) for b in self._buffers.values()) + sum(
                hi - lo for lo, hi in map(self.chunk_range, untouched))
            first = min(self._buffers)
            raise MissingChunks(
                f"cannot commit {self._key}: {missing} samples were never written (first in chunk "
                f"{first}, rows {self.chunk_range(first)}); write them, then commit again"
            )
        absent = self._absent_on_storage()
        if absent:
            lo, hi = self.chunk_range(absent[0])
            raise MissingChunks(
                f"cannot commit {self._key}: {len(absent)} of {self.num_chunks} chunks are missing "
                f"(first: chunk {absent[0]}, samples [{lo}, {hi})); write them (another rank may "
                "still be running) or resume, then commit"
            )
        final = self._final_report(self._meta)
        # chunk_seals last before the document: each chunk's crc32c trailer at its place, read
        # back (4 bytes a chunk), so a chunk later swapped or moved is found (format.seals).
        self._check_generation()
        # each chunk's row blocks, before chunk_seals; the features trailers it reads serve both
        trailers = block_seals.finish(self._storage, self._key, self._meta)
        seals.write_seals(self._storage, self._key, self._meta, (layout.FEATURES, layout.LABELS, layout.SCALES),
                          known=trailers)
        try:
            meta = lifecycle.mark_complete(self._storage, self._key, self._meta, **final)
        except SplitTakenOver:
            self._closed = True
            raise
        self._meta = meta
        self._closed = True
        self._puts.close()
        return meta.to_json()

    def report(self) -> dict[str, Any]:
        """The quantization report and channel statistics of the chunks on storage so far."""
        self._puts.wait()
        return self._final_report(self._meta, only=sorted(self._done))

    # ------------------------------------------------------------------ input checks
    def _check_labels(self, labels: Any, count: int) -> np.ndarray | None:
        if self.label_shape is None:
            if labels is not None:
                raise ShapeMismatch(
                    f"labels were passed but split {self._key} was created without labels: pass "
                    "label_shape/label_dtype to create_split"
                )
            return None
        if labels is None:
            raise ShapeMismatch(f"split {self._key} has labels: pass labels= with every write")
        rows = dtypes.as_numpy(labels)
        if tuple(rows.shape) != (count, *self.label_shape):
            raise ShapeMismatch(
                f"labels of shape {tuple(rows.shape)} do not match [{count}, "
                f"{', '.join(map(str, self.label_shape))}] for this batch"
            )
        assert self._label_dtype is not None
        if rows.dtype != self._label_dtype:
            if not np.can_cast(rows.dtype, self._label_dtype, casting="same_kind") or (
                rows.size and not np.array_equal(rows.astype(self._label_dtype), rows)
            ):
                raise DtypeMismatch(
                    f"labels of dtype {rows.dtype} do not fit this split's label dtype "
                    f"{self._label_dtype}: cast them, or recreate the split with another label_dtype"
                )
        # Always our own copy (labels are small): chunk puts may run after write() returns.
        return np.array(rows, dtype=self._label_dtype, copy=True)

    # ------------------------------------------------------------------ chunk buffers
    def _scatter(self, start: int, batch: Prepared, labels: np.ndarray | None, *, copy: bool) -> None:
        stop = start + len(batch.stored)
        first, last = start // self.chunk_rows, (stop - 1) // self.chunk_rows
        code = SOURCE_CODES[batch.kind]
        for index in range(first, last + 1):
            if index in self._submitted:
                continue  # already valid on storage (resume) or written: keep it as it is
            lo, hi = self.chunk_range(index)
            a, b = max(lo, start), min(hi, stop)
            src = slice(a - start, b - start)
            if a == lo and b == hi and index not in self._buffers:
                # The batch holds the whole chunk: put it from the batch, no buffer copy (unless
                # the batch is the caller's own memory, which may change after write() returns).
                data = batch.stored[src]
                self._write_chunk(index, _Buffer(
                    data=np.array(data) if copy else data, filled=np.ones(b - a, bool),
                    labels=None if labels is None else labels[src], rows=batch.rows[src], source_code=code))
                continue
            buffer = self._buffers.get(index) or self._new_buffer(hi - lo)
            self._buffers[index] = buffer
            rows = slice(a - lo, b - lo)
            buffer.data[rows] = batch.stored[src]
            buffer.filled[rows] = True
            if labels is not None and buffer.labels is not None:
                buffer.labels[rows] = labels[src]
            buffer.rows[rows] = batch.rows[src]
            buffer.source_code = max(buffer.source_code, code)
            if buffer.filled.all():
                self._write_chunk(index, self._buffers.pop(index))

    def _new_buffer(self, rows: int) -> _Buffer:
        labels = None
        if self.label_shape is not None:
            assert self._label_dtype is not None
            labels = np.zeros((rows, *self.label_shape), self._label_dtype)
        return _Buffer(
            data=self._pool.array((rows, *self.sample_shape), self._storage_dtype),
            filled=np.zeros(rows, bool),
            labels=labels,
            rows=RowStats.zeros(rows, self.channels),
        )

    def _write_chunk(self, index: int, buffer: _Buffer) -> None:
        data, scales = buffer.data, None
        if self._work_dtype != self.dtype:
            data, scales, stats = quantize_int8.encode_chunk(
                data, buffer.rows, self._tokens, buffer.source_code, self.channels)
        else:
            stats = fold_rows(buffer.rows, self._tokens, buffer.source_code)
        # One small read per chunk: a writer whose split was overwritten (another generation)
        # stops here instead of writing its rows into the other run's split.
        self._check_generation()
        puts = []
        if buffer.labels is not None:
            puts.append((layout.LABELS, self._pad(buffer.labels), None))
        puts.append((layout.CHUNK_STATS, seal(stats.to_row(), self._meta, index)[None, :], None))
        if scales is not None:
            puts.append((layout.SCALES, scales, None))
        puts.append((layout.FEATURES, self._pad(data), self.compressor))
        self._submitted.add(index)
        self._puts.submit(index, puts)

    def _pad(self, rows: np.ndarray) -> np.ndarray:
        # zarr stores edge chunks at full chunk shape, padded with the fill value (0).
        if len(rows) == self.chunk_rows:
            return rows
        padded = np.zeros((self.chunk_rows, *rows.shape[1:]), rows.dtype)
        padded[: len(rows)] = rows
        return padded

    # ------------------------------------------------------------------ commit helpers
    def _absent_on_storage(self) -> list[int]:
        others = [i for i in range(self.num_chunks) if i not in self._done]
        return split_protocol.absent_chunks(self._storage, self._key, self._meta, others)

    def _final_report(self, meta: SplitMetadata, only: list[int] | None = None) -> dict[str, Any]:
        return split_protocol.sealed_report(
            self._storage, self._key, meta, range(self.num_chunks) if only is None else only,
            channels=self.channels, written_dtype=self._source_dtype)

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosed(f"writer for {self._key} is closed: open it again with "
                               "create_split(..., resume=True) (on the command line: --resume)")

    def _committed_elsewhere(self) -> Exception:
        held = sum(int(b.filled.sum()) for b in self._buffers.values())
        return SplitExists(
            f"split {self._key} was committed by another writer while this one was writing (every chunk was "
            f"on storage then): this writer stopped without changing it"
            + (f", and the {held} samples it still held are not in it" if held else "")
            + ". A complete split takes no more writes: to rewrite it, create it again with overwrite=True "
            "(on the command line: --overwrite)")

    def _put_failures(self, check: Callable[[], None]) -> None:
        split_protocol.explain_put_failure(check, self._check_generation)
