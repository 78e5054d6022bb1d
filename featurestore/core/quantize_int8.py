"""int8 splits in the store: the writers' encoding and the readers' scales.

The dense writer buffers an int8 split's rows as float32 (checked like any other dtype: NaN/Inf
and float64 beyond float32 refused), then :func:`encode_chunk` turns each finished chunk into
codes, its scales row and its statistics row (errors of the values back against the float32
rows, saturation counted): in one pass by core.int8_kernel when numba is installed, else by
numpy's passes, the same bits. The bag writer encodes each whole bag (:func:`encode_bag`, scales per
bag and channel) and its commit writes the ``scales`` index array (:func:`bag_scales`). Readers
load the small scales once (:class:`ScalesTable`; ``core.bag_array`` its own) and dequantize gathered
codes into the caller's buffer (format.int8). The scheme is format.int8's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore.core.checked import damage_message
from featurestore.core.storage import Storage
from featurestore.errors import (
    REPAIR_ADVICE,
    CorruptChunk,
    DtypeMismatch,
    FeatureStoreError,
    InvalidMetadata,
    MissingChunks,
)
from featurestore.format import dtypes, int8, layout
from featurestore.format.stats import ChunkStats, RowStats, fold_rows, row_stats_numpy

READ_DTYPES = ("float32", "float16")


def working_dtype(logical: str) -> str:
    """The dtype a writer buffers rows in before its chunk is written."""
    return "float32" if dtypes.is_int8(logical) else logical


def encode_chunk(values: np.ndarray, rows: RowStats, tokens: int, source_code: int,
                 channels: int) -> tuple[np.ndarray, np.ndarray, ChunkStats]:
    """A finished chunk's float32 rows -> (int8 codes, scales row [1, *S], statistics row).

    The statistics describe the values back (channel moments) and their error against the rows
    written; the per-sample source abs max is the one measured on the way in."""
    codes, scales, saturated, measured = _encode_measured(values, (len(values), tokens, channels))
    measured.abs_max[:] = rows.abs_max
    stats = fold_rows(measured, tokens, source_code)
    stats.overflow_count = saturated
    return codes, scales[None], stats


def encode_bag(values: np.ndarray, rows: RowStats, source_code: int) -> tuple[np.ndarray, np.ndarray, ChunkStats]:
    """A bag's float32 rows ``[n, dim]`` -> (int8 codes, its scales ``[dim]``, its statistics
    row). Bag splits scale per (bag, channel), not per chunk: a commit lays bags out in id order
    across chunks, and a bag's codes and scales move with it."""
    codes, scales, saturated, measured = _encode_measured(values, (1, len(values), values.shape[-1]))
    measured.abs_max[:] = rows.abs_max
    stats = fold_rows(measured, len(values), source_code)
    stats.overflow_count = saturated
    return codes, scales, stats


def _encode_measured(values: np.ndarray, samples: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, int, RowStats]:
    """Codes, scales (per position of ``values[0]``), saturated count and the statistics of the
    values back against ``values`` seen as ``samples`` ``[B, T, C]`` (the per-sample abs max left
    for the caller: it is the one measured on the way in). One pass with numba (core.int8_kernel),
    else numpy's passes; the same bits either way."""
    from featurestore.core import fused_stats

    count, tokens, channels = samples
    if not fused_stats.available() or not len(values):
        codes, scales, saturated = int8.encode(values)
        back = int8.decode(codes, scales)
        shaped = (count, tokens, channels)
        measured = row_stats_numpy(values.reshape(shaped), back.reshape(shaped), "float32", False, channels)
        return codes, scales, saturated, measured
    from featurestore.core import int8_kernel

    rows = np.ascontiguousarray(values, dtype=np.float32)
    scales = int8.scales_for(int8_kernel.absmax(rows.reshape(len(rows), -1)))
    codes = np.empty(rows.shape, np.int8)
    sums = [np.zeros((count, channels), np.float64) for _ in range(4)]
    errors = [np.zeros(count, np.float32) for _ in range(2)]
    reference = np.empty((count, channels), np.float64)
    over = np.zeros(count, np.int64)
    fused_stats.run_items(int8_kernel.encode_measure, (rows.reshape(samples), scales.reshape(-1),
                          codes.reshape(samples), *sums, *errors, reference, over), count, fused_stats.threads())
    saturated = int(over.sum())
    first, second, err_sq, src_sq = sums
    measured = RowStats.zeros(count, channels)
    measured.mean[:] = reference + first / tokens
    measured.m2[:] = np.maximum(second - first * first / tokens, 0.0)
    measured.max_abs_error[:], measured.max_rel_error[:] = errors
    measured.sq_error[:], measured.sq_source[:] = err_sq.sum(axis=1), src_sq.sum(axis=1)
    return codes, scales.reshape(rows.shape[1:]), saturated, measured


def bag_scales(records: list[Any], dim: int) -> np.ndarray:
    """The ``scales`` index array of an int8 bag split: one float32 row per bag, in id order."""
    return np.stack([r.scales for r in records]) if records else np.zeros((0, dim), np.float32)


def scales_document(meta: Any) -> bytes:
    """The ``scales`` array's zarr.json: float32 [num_chunks, *sample_shape], one row a chunk."""
    return layout.array_document(
        shape=(meta.num_chunks, *meta.sample_shape), chunk_rows=1, data_type="float32",
        attributes={"featurestore": {"description": "int8 scales: features[r] * scales[r // chunk_rows]; "
                                                    "see docs/FORMAT.md"}})


def write_scales_document(storage: Storage, key: str, meta: Any) -> None:
    if dtypes.is_int8(meta.logical_dtype):
        storage.write(f"{key}/{layout.SCALES}/{layout.ZARR_JSON}", scales_document(meta))


def check_read_dtype(dtype: str | None, logical: str) -> str | None:
    """``read_numpy(dtype=)``: None (the stored values: int8 codes for int8), float32 or float16."""
    if dtype is None:
        return None
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:  # a torch dtype, or anything numpy does not name
        name = str(dtype)
    if name not in READ_DTYPES:
        raise DtypeMismatch(f"read dtype {dtype!r} is not offered: use None (stored values, {logical}), "
                            f"{' or '.join(READ_DTYPES)}")
    return name


def _damaged(array: Any, key: str, error: Exception) -> CorruptChunk:
    """The first damaged chunk of a dense split's scales array, named with the features chunks it covers."""
    rows = int(array.chunks[0])
    for chunk, start in enumerate(range(0, int(array.shape[0]), rows)):
        try:
            array[start : start + rows]
        except Exception as reason:  # noqa: BLE001 - the first chunk that fails is the damage
            covers = f"chunk {start}" if rows == 1 else f"chunks {start}-{start + rows - 1}"
            return CorruptChunk(damage_message(f"chunk {chunk} of {key} (the int8 scales of the split's {covers}; "
                                               "every read of the split needs them)", str(reason)))
    return CorruptChunk(damage_message(f"{key} (the split's int8 scales)", str(error)))


class ScalesTable:
    """An int8 dense split's whole ``scales`` array, read once (it is [num_chunks, *S] float32,
    small). Every value of the split needs its chunk's row, so a missing document or a damaged
    chunk is refused, each named (zarr's own messages name neither), and a chunk whose row is
    absent (zarr would read it as its fill value: codes times 0) is refused by every read that
    needs it: only rows not written yet may lack it, on a split opened with allow_incomplete."""

    WHAT = "the split's int8 scales, a row per features chunk"

    def __init__(self, storage: Storage, split_key: str, *, complete: bool = True) -> None:
        self._storage = storage
        self._key = f"{split_key}/{layout.SCALES}"
        self._complete = complete
        self._table: np.ndarray | None = None
        self._absent = np.zeros(0, np.int64)  # chunks without a row on storage (NaN in the table)

    @property
    def loaded(self) -> bool:
        """Whether the table is in memory (:meth:`table` reads it from storage the first time)."""
        return self._table is not None

    def table(self) -> np.ndarray:
        """The whole table; on a split still being written, a chunk not written yet has NaN rows."""
        table = self._load()
        if self._complete and self._absent.size:
            raise self._missing(self._absent)
        return table

    def rows(self, chunks: np.ndarray) -> np.ndarray:
        """The rows of ``chunks``, each on storage (else MissingChunks)."""
        return self._load()[self._check(chunks)]

    def dequantize(self, codes: np.ndarray, index: np.ndarray, chunk_rows: int, out: np.ndarray) -> np.ndarray:
        return int8.dequantize_into(codes, self._check(index // chunk_rows), self._load(), out)

    def _check(self, chunks: np.ndarray) -> np.ndarray:
        self._load()
        if self._absent.size and (wanted := np.intersect1d(self._absent, chunks)).size:
            raise self._missing(wanted)
        return chunks

    def _load(self) -> np.ndarray:
        if self._table is None:
            import zarr

            try:
                array = zarr.open_array(store=self._storage.zarr_store(), path=self._key, mode="r")
            except FeatureStoreError:
                raise
            except Exception as error:  # noqa: BLE001 - zarr's "no array found", or a document that is not JSON
                raise InvalidMetadata(f"{self._key} ({self.WHAT}) is missing or unreadable on {self._storage.url} "
                                      f"({type(error).__name__}): the split is damaged: {REPAIR_ADVICE}") from None
            try:
                table = np.ascontiguousarray(array[:], dtype=np.float32)
            except FeatureStoreError:
                raise
            except Exception as error:  # noqa: BLE001 - zarr's crc32c codec or a short chunk: damage
                raise _damaged(array, self._key, error) from None
            # zarr reads an absent chunk as its fill value, 0: only an all-zero row (a chunk whose
            # values are all 0 has one too) is asked about, file by file (no listing: a server's
            # /zarr route and other HTTP stores list nothing).
            rows = table.reshape(len(table), -1)
            zero = np.flatnonzero(~rows.any(axis=1)) if rows.shape[1] else np.zeros(0, np.int64)
            absent = np.array([c for c in zero.tolist()
                               if self._storage.size(layout.chunk_key(self._key, c, array.ndim)) is None], np.int64)
            table[absent] = np.nan
            self._table, self._absent = table, absent
        return self._table

    def _missing(self, chunks: np.ndarray) -> MissingChunks:
        more = f" (and {len(chunks) - 1} more)" if len(chunks) > 1 else ""
        if not self._complete:
            return MissingChunks(f"{self._key}: chunk {int(chunks[0])}{more} has not been written yet ({self.WHAT}): "
                                 "read only written rows, or resume the split first")
        return MissingChunks(f"{self._key}: chunk {int(chunks[0])}{more} is missing from a complete split "
                             f"({self.WHAT}; damaged store): {REPAIR_ADVICE}")

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_table": None, "_absent": np.zeros(0, np.int64)}
