"""Dense splits as a kind (featurestore.core.split_kind): ``[N, *sample_shape]`` samples written
by :class:`~featurestore.core.writer.SplitWriter`, resumable by chunk.

What only a dense split has: its metadata (chunk rows from ``chunk_bytes`` or ``chunk_rows``,
labels, ids), its arrays (``features``, ``labels``, ``chunk_stats``, ``ids``), the settings a
resume must share (geometry, compressor, chunk rows), and its done chunks: those whose arrays
are all present and whose statistics row is sealed for this generation and this chunk
(with ``verify_chunks``: every chunk read, crc32c, features against their statistics row, and
each chunk's trailer against ``chunk_seals``). ``verify`` is featurestore.core.dense_verify.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore import __version__
from featurestore.core import dense_verify, lifecycle, quantize_int8, seals
from featurestore.core.present import present_chunks
from featurestore.core.split_kind import Findings, SplitKind, check_chunk_bytes
from featurestore.core.storage import Storage
from featurestore.core.string_arrays import put_strings
from featurestore.core.writer import SplitWriter
from featurestore.errors import DtypeMismatch, InvalidOption, ShapeMismatch, SplitSettingsMismatch
from featurestore.format import chunks, dtypes, int8, layout
from featurestore.format.chunk_checks import features_match_stats
from featurestore.format.metadata import (DENSE, LabelSpec, Provenance, SplitMetadata, chunk_arrays, seal_problem,
                                          stats_row_length)
from featurestore.format.seals import SEALED_ARRAYS, generation_of, sealed_arrays


class DenseKind(SplitKind[SplitWriter]):
    name = DENSE

    def new_metadata(self, dataset: str, encoder: str, split: str, *, num_samples: int, sample_shape: Any,
                     dtype: str, label_shape: Any, label_dtype: Any, metadata: dict[str, Any] | None,
                     chunk_bytes: int | None, chunk_rows: int | None, compressor: str | None,
                     ids: list[str] | None, provenance: Provenance | None) -> SplitMetadata:
        dtypes.check_feature_dtype(dtype)
        if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ShapeMismatch(f"num_samples must be a positive int, got {num_samples!r}")
        shape = tuple(int(s) for s in sample_shape)
        if not shape or any(s < 1 for s in shape):
            raise ShapeMismatch(f"sample_shape must have at least one positive axis (e.g. (tokens, dim)), got {tuple(sample_shape)!r}")
        if chunk_rows is not None and chunk_bytes is not None:
            raise InvalidOption(f"chunk_rows={chunk_rows!r} and chunk_bytes={chunk_bytes!r} exclude each other: give one")
        if chunk_rows is None:
            sample_nbytes = int(np.prod(shape)) * dtypes.storage_dtype(dtype).itemsize
            chunk_rows = layout.chunk_rows_for(sample_nbytes, check_chunk_bytes(chunk_bytes), int(num_samples))
            chunk_rows = int8.chunk_rows(dtype, chunk_rows, int(num_samples))
        elif not isinstance(chunk_rows, (int, np.integer)) or isinstance(chunk_rows, bool) or chunk_rows < 1:
            raise InvalidOption(f"chunk_rows must be a positive int, got {chunk_rows!r}")
        else:
            chunk_rows = min(int(chunk_rows), int(num_samples))
        if ids is not None and len(ids) != num_samples:
            raise ShapeMismatch(f"ids has {len(ids)} entries for {num_samples} samples: pass one id per sample")
        if ids is not None:
            _check_ids(ids)
        labels = None
        if label_dtype is not None:
            label_np = np.dtype(label_dtype)
            if label_np.kind not in "iufb":
                raise DtypeMismatch(f"label_dtype {label_np} is not numeric: use e.g. 'int64' or 'uint8'")
            labels = LabelSpec(tuple(int(s) for s in label_shape), label_np.name)
        return SplitMetadata.new(
            dataset=dataset, encoder_name=encoder, split=split, num_samples=int(num_samples),
            sample_shape=shape, logical_dtype=dtype, chunk_rows=int(chunk_rows), compressor=compressor,
            labels=labels, ids=ids is not None, user=metadata, provenance=provenance,
            creator_version=__version__)

    def check_resumable(self, meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
        for name in ("num_samples", "sample_shape", "logical_dtype", "labels"):
            if getattr(meta, name) != getattr(wanted, name):
                raise ShapeMismatch(
                    f"cannot resume {key}: its {name} is {getattr(meta, name)!r}, this run asks for "
                    f"{getattr(wanted, name)!r}; use overwrite=True (--overwrite) to replace it")
        for name, flag in (("compressor", "--compressor"), ("chunk_rows", "--chunk-mb")):
            if getattr(meta, name) != getattr(wanted, name):
                raise SplitSettingsMismatch(
                    f"split {key} ({meta.status}) was written with {name} {getattr(meta, name)!r}, this run "
                    f"asks for {getattr(wanted, name)!r} ({flag}): run with the split's own setting, or "
                    "--overwrite to rewrite it with the new one")

    def create(self, storage: Storage, key: str, meta: SplitMetadata, *, ids: list[str] | None = None,
               **_: Any) -> SplitWriter:
        write_arrays(storage, key, meta, ids)
        return writer(storage, key, meta, set())

    def resume(self, storage: Storage, key: str, meta: SplitMetadata, *, verify_chunks: bool,
               ids: list[str] | None = None, **_: Any) -> SplitWriter:
        if meta.complete:
            done = done_chunks(storage, key, meta, crc=verify_chunks)
            if len(done) < meta.num_chunks:
                # Damaged: it must not read as complete while its chunks are rewritten, and each
                # damaged chunk loses its features file (the proof of a done chunk), so a resume
                # cut short still rewrites a chunk that only the seals it loses could tell apart.
                meta = lifecycle.mark_writing(storage, key, meta)
                for index in set(range(meta.num_chunks)) - done:
                    storage.delete_tree(f"{key}/{layout.FEATURES}/c/{index}")
            return writer(storage, key, meta, done)
        # The array documents may be missing if the creating process died right after the
        # group; writing them again is idempotent (same geometry, checked above).
        write_arrays(storage, key, meta, ids)
        return writer(storage, key, meta, done_chunks(storage, key, meta))

    def verify(self, storage: Storage, key: str, meta: SplitMetadata, found: Findings) -> None:
        dense_verify.verify_dense(storage, key, meta, found)


def writer(storage: Storage, key: str, meta: SplitMetadata, done: set[int]) -> SplitWriter:
    label_np = np.dtype(meta.labels.dtype) if meta.labels is not None else None
    return SplitWriter(storage, key, meta, done_chunks=done, label_dtype=label_np)


def _check_ids(ids: list[str]) -> None:
    """Sample ids name one sample each (``positions_of``, the server's by-id route): distinct
    strings a store can hold (UTF-8), refused before anything is written."""
    seen: set[str] = set()
    for position, sample_id in enumerate(ids):
        if not isinstance(sample_id, str):
            raise ShapeMismatch(f"ids[{position}] is {sample_id!r} ({type(sample_id).__name__}): sample ids are strings")
        try:
            sample_id.encode("utf-8")
        except UnicodeEncodeError:
            raise ShapeMismatch(f"ids[{position}] {sample_id!r} is not valid Unicode text: sample ids are stored as "
                                "UTF-8") from None
        if sample_id in seen:
            raise ShapeMismatch(f"ids[{position}] {sample_id!r} names an earlier sample too: each id names one sample")
        seen.add(sample_id)


def write_arrays(storage: Storage, key: str, meta: SplitMetadata, ids: list[str] | None) -> None:
    n, rows = meta.num_samples, meta.chunk_rows
    logical = meta.logical_dtype
    attrs = {"featurestore": {"logical_dtype": logical}}
    storage.write(f"{key}/{layout.FEATURES}/{layout.ZARR_JSON}", layout.array_document(
        shape=(n, *meta.sample_shape), chunk_rows=rows, data_type=dtypes.zarr_data_type(logical),
        compressor=meta.compressor, attributes=attrs))
    if meta.labels is not None:
        storage.write(f"{key}/{layout.LABELS}/{layout.ZARR_JSON}", layout.array_document(
            shape=(n, *meta.labels.shape), chunk_rows=rows, data_type=meta.labels.dtype,
            attributes={"featurestore": {"logical_dtype": meta.labels.dtype}}))
    quantize_int8.write_scales_document(storage, key, meta)
    storage.write(f"{key}/{layout.CHUNK_STATS}/{layout.ZARR_JSON}", layout.array_document(
        shape=(meta.num_chunks, stats_row_length(meta)), chunk_rows=1, data_type="float64",
        attributes={"featurestore": {"description": "per-chunk partial sums; see docs/FORMAT.md"}}))
    if ids is not None:
        put_strings(storage, f"{key}/{layout.IDS}", [str(i) for i in ids])


def done_chunks(storage: Storage, key: str, meta: SplitMetadata, crc: bool = True) -> set[int]:
    """Chunks whose features, statistics row and labels are all present with the right size,
    whose statistics row carries this split's generation and the chunk's own index, and with
    ``crc`` (every chunk read) whose crc32c is valid, whose features are the ones that row
    describes and whose trailer is the one ``chunk_seals`` holds for its place, if the split has
    that table (int8 scales too where it seals them): a swapped or moved chunk file with a valid
    crc32c of its own is rewritten too."""
    arrays = chunk_arrays(meta)
    candidates = present_chunks(storage, key, arrays, among=range(meta.num_chunks), sizes=not crc or None)
    table = seals.read_table(storage, key) if crc and meta.complete else None
    sealed = {} if table is None else {(SEALED_ARRAYS[int(c)], int(i)): (int(v), int(g)) for c, i, v, g in table}
    compared = set() if table is None else sealed_arrays(table)  # an older table: no int8 scales rows
    done = set()
    for index in sorted(candidates):
        raws: dict[str, bytes] = {}
        try:
            for name, ndim, _ in arrays:
                if crc or name == layout.CHUNK_STATS:
                    raws[name] = storage.read(layout.chunk_key(f"{key}/{name}", index, ndim))
        except (FileNotFoundError, IsADirectoryError):
            continue  # another rank mid-write, or one killed there
        if any(chunks.check(raws[name], nbytes) is not None for name, _, nbytes in arrays if name in raws):
            continue
        stats = raws[layout.CHUNK_STATS]
        if seal_problem(stats, meta, index) is not None:
            continue  # another run's chunk (overwrite raced) or a moved file
        if crc:
            row = np.frombuffer(stats[: -layout.CRC_BYTES], np.float64)
            if features_match_stats(raws[layout.FEATURES], meta, index, row) is not None:
                continue  # a swapped or moved features file: its rows belong elsewhere
            if table is not None and any(
                    sealed.get((name, index)) != (int.from_bytes(raws[name][-layout.CRC_BYTES:], "little"),
                                                  generation_of(meta)) for name in raws if name in compared):
                continue  # not the chunk the commit sealed for this place (labels swapped, say)
        done.add(index)
    return done


DENSE_KIND = DenseKind()
