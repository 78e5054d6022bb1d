"""BagWriter: one writer session of a bag split, appending whole bags to its own segment.

Made by :meth:`featurestore.FeatureStore.create_bag_split` (docs/FORMAT.md, "Slide bags"). Each
session writes to a segment of its own (``<split>/segments/<random name>/``), so writers of one
split (torchrun ranks, a resume beside a still-running run) never touch the same keys. Rows are
appended chunk by chunk (the split's chunk geometry); a full chunk goes to the put pool
(featurestore.core.chunk_puts: coords and features chunks, then the chunk's record naming the
bags that end in it), the partial last chunk is put by ``close``/``commit``.

A bag is complete once its record and every chunk its rows lie in are on storage. Each is one
atomic put, so after a SIGKILL at any moment a resume (``resume=True``, featurestore.core.bag_commit
finds them) counts exactly the complete bags in ``done_ids`` and the caller re-adds the rest;
rows of incomplete bags stay unreferenced in their segment and vanish at commit.

What ``add_bag`` accepts is what a dense ``write()`` accepts (featurestore.core.intake: the same
precision policy, overflow guard and statistics), plus coordinates, a label and attributes.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from featurestore.core import bag_commit, block_seals, intake, quantize_int8, split_protocol
from featurestore.core.buffers import BufferPool
from featurestore.core.chunk_puts import ChunkPuts
from featurestore.core.storage import Storage
from featurestore.errors import (
    DtypeMismatch,
    DuplicateBag,
    FeatureStoreError,
    Float16Overflow,
    InvalidLabels,
    NonFiniteValues,
    ShapeMismatch,
    SplitExists,
    WriterClosed,
)
from featurestore.format import bags, dtypes, layout
from featurestore.format.metadata import SplitMetadata
from featurestore.format.stats import SOURCE_CODES, RowStats, fold_rows


def non_finite_rows(features: Any) -> str | None:
    """Where a bag's non-finite values are, in the bag's terms ("2 NaN and 0 Inf values in 1 of
    its 4 rows (first: row 2)"); None when every value is finite."""
    wide = (features.detach().double().cpu().numpy() if hasattr(features, "detach")
            else np.asarray(features).astype(np.float64))
    finite = np.isfinite(wide)
    if finite.all():
        return None
    rows = np.flatnonzero(~finite.reshape(len(wide), -1).all(axis=1))
    return (f"{int(np.isnan(wide).sum())} NaN and {int(np.isinf(wide).sum())} Inf values in {len(rows)} of its "
            f"{len(wide)} rows (first: row {int(rows[0])})")


def _refused_values(bag_id: str, source: Any, error: FeatureStoreError) -> FeatureStoreError:
    """The refusal of a bag's values (non-finite, beyond the stored dtype's range) in the bag's
    terms: the kernel saw the bag as sample 0 of a batch of one, and its advice is extract's."""
    if not isinstance(error, (NonFiniteValues, Float16Overflow)):
        return type(error)(f"bag {bag_id!r}: {error}")
    where = non_finite_rows(source)
    if where is not None:
        return NonFiniteValues(f"bag {bag_id!r}: {where}: featurestore does not store non-finite values; pass "
                               "the bag's features without them, or leave the bag out")
    return type(error)(f"bag {bag_id!r}: {str(error).replace('samples [0, 1)', f'its {len(source)} rows')}")


class BagWriter(split_protocol.SplitSession):
    """Adds bags to one bag split; see the module doc and docs/CORE-API.md."""

    def __init__(self, storage: Storage, key: str, metadata: SplitMetadata, *, done_ids: set[str]) -> None:
        self._storage = storage
        self._key = key
        self._meta = metadata
        self.dim: int = int(metadata.sample_shape[0])
        self.dtype: str = metadata.logical_dtype
        self.chunk_rows: int = metadata.chunk_rows
        spec = metadata.bags or {}
        self.coords_dtype = np.dtype(spec["coords"]["dtype"])
        label = spec.get("labels")
        self.label_dtype = None if label is None else np.dtype(label["dtype"])
        self._done = set(done_ids)  # complete on storage when this session started
        self._added: set[str] = set()  # added by this session
        self.segment = uuid.uuid4().hex[:16]
        self._segment_key = f"{key}/{bags.SEGMENTS}/{self.segment}"
        # Each features chunk's block seals from the crc pass its trailer needs: a commit that
        # copies the chunk into place copies its row too (featurestore.core.block_seals).
        self._puts = ChunkPuts(storage, self._segment_key, block_nbytes=block_seals.block_nbytes(metadata))
        # Chunk buffers are leased and come back once their chunk is stored: fresh memory costs a
        # page fault per 4 KiB on first touch (core.writer measured 3-20x a copy into a reused one).
        self._pool = BufferPool(keep=4, max_free_bytes=256 << 20)
        self._chunk = 0  # index of the segment chunk being filled
        self._fill = 0  # rows in it so far
        self._pending: list[bags.BagRecord] = []  # bags whose last row is in it
        self._features, self._coords = self._new_buffers()
        self._closed = metadata.complete
        self._labelled: bool | None = None  # whether this session's bags carry labels (the first says)

    # ------------------------------------------------------------------ public API
    @property
    def done_ids(self) -> set[str]:
        """Bags already complete (found on storage when this writer opened, or added by it)."""
        return self._done | self._added

    def session(self) -> BagWriter:
        """Another writer session on the same split (a segment of its own), without re-reading
        the segments: ``--worker`` closes one session per slide, so each bag is complete on
        storage before its claim is marked done (featurestore.extract.workers_share)."""
        return BagWriter(self._storage, self._key, self._meta, done_ids=set())

    def add_bag(self, bag_id: str, features: Any, coords: Any = None, label: Any = None,
                attrs: dict[str, Any] | None = None) -> None:
        """Add one bag: ``features`` [n, dim] (torch tensor on any device, or array-like; n may be
        0), ``coords`` [n, 2] (None: stored as -1, or NaN for float coordinates), a numeric
        ``label`` and a dict of JSON ``attrs``. Everything is checked before anything of the bag
        is buffered: a refused bag leaves nothing behind."""
        bag_id = bags.check_bag_id(bag_id)
        self._check_open(bag_id)
        if bag_id in self._done or bag_id in self._added:
            raise DuplicateBag(f"bag {bag_id!r} is already in split {self._key}: skip the ids in "
                               "writer.done_ids, or overwrite the split")
        split_protocol.explain_put_failure(self._puts.raise_error, self._check_generation)
        source = intake.as_source(features)
        if source.ndim != 2 or int(source.shape[1]) != self.dim:
            raise ShapeMismatch(f"bag {bag_id!r}: features of shape {tuple(source.shape)} do not match "
                                f"this split's [n, {self.dim}]: pass one row per patch")
        count = int(source.shape[0])
        coord_rows = self._check_coords(bag_id, coords, count)
        value = self._check_label(bag_id, label)
        try:
            attributes = bags.attrs_json(attrs)
        except ShapeMismatch as error:
            raise ShapeMismatch(f"bag {bag_id!r}: {error}") from None
        if count:
            # The bag is measured as one sample of `count` tokens: its statistics row is the
            # bag's own (per-channel moments over its rows), in one pass of the fused kernel.
            try:
                batch = intake.prepare(source[None], quantize_int8.working_dtype(self.dtype), self.dim, 0,
                                       private=False)
            except FeatureStoreError as error:
                raise _refused_values(bag_id, source, error) from None
            stored = batch.stored.reshape(count, self.dim)
            stats = fold_rows(batch.rows, count, SOURCE_CODES[batch.kind])
            if dtypes.is_int8(self.dtype):  # one scale per channel over the bag's rows
                stored, scales, stats = quantize_int8.encode_bag(stored, batch.rows, SOURCE_CODES[batch.kind])
        else:
            stored, stats = None, fold_rows(RowStats.zeros(0, self.dim), 1, 0)
            scales = np.zeros(self.dim, np.float32)
        start = self._chunk * self.chunk_rows + self._fill
        done = 0
        while done < count:
            if self._fill == self.chunk_rows:
                self._emit()
            take = min(count - done, self.chunk_rows - self._fill)
            assert stored is not None
            self._features[self._fill : self._fill + take] = stored[done : done + take]
            self._coords[self._fill : self._fill + take] = coord_rows[done : done + take]
            self._fill += take
            done += take
        self._pending.append(bags.BagRecord(bag_id, start, count, value, attributes, stats.to_row(),
                                            scales if dtypes.is_int8(self.dtype) else None))
        self._added.add(bag_id)
        self._labelled = value is not None

    def close(self) -> None:
        """Put the partial last chunk and its record, and wait for every put of this session.
        Does not commit: several writers close, then one commits."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._fill or self._pending:
                self._emit()
        finally:
            split_protocol.explain_put_failure(self._puts.close, self._check_generation)
        # A commit by another session while these puts were in flight deleted the segments before
        # they landed: this session's bags are in no split. Said here, not silently left behind.
        if self._added and split_protocol.committed_elsewhere(self._storage, self._key, self._meta):
            stored = self._stored_ids()
            if stored is None or self._added - stored:
                raise self._refusal(stored)

    def abandon(self) -> None:
        """End this session without keeping anything of it: its puts are waited for (their errors
        dropped) and its segment deleted. For a session whose bags will never count (``--worker``:
        one slide per session, and that slide failed or was given back)."""
        self._closed = True
        self._pending.clear()
        try:
            self._puts.close()
        except Exception:  # noqa: BLE001 - what failed is what is being dropped
            pass
        try:
            self._storage.delete_tree(self._segment_key)
        except Exception:  # noqa: BLE001 - an unreferenced segment is dropped at commit anyway
            pass

    def commit(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Close this session, then lay out every complete bag of every session in id order,
        write the index and mark the split complete (featurestore.core.bag_commit). Call it once,
        after every writer of the split has closed. ``extra``: metadata keys known only at the
        end (e.g. the slides an extractor skipped), added to the split's. Returns the split's
        final metadata."""
        if self._meta.complete:
            return self._meta.to_json()
        self.close()
        if split_protocol.committed_elsewhere(self._storage, self._key, self._meta):
            stored = self._stored_ids()
            if stored is None or self._added - stored:
                raise self._refusal(stored)
            # Every bag of this session is in that commit: nothing to lay out, no segment to keep.
            self.abandon()
            self._meta = split_protocol.stored_metadata(self._storage, self._key)
            return self._meta.to_json()
        self._meta = bag_commit.commit(self._storage, self._key, self._meta, extra=extra)
        return self._meta.to_json()

    def _committed_elsewhere(self) -> Exception:
        return self._refusal(self._stored_ids())

    def _refusal(self, stored: set[str] | None) -> Exception:
        """Another session committed the split while this one added bags: this session's segment
        is dropped (a complete split's segments are gone) and the refusal names its bags that the
        commit (its ids ``stored``, None: unreadable) did not take."""
        self.abandon()
        missing = sorted(self._added - (stored or set()))
        if stored is None:
            said = f"its bag ids could not be read to compare with this session's {len(self._added)} bags"
        elif missing:
            said = f"{len(missing)} of this session's {len(self._added)} bags are not in it (first: {missing[0]!r})"
        else:
            said = f"this session's {len(self._added)} bags are in it"
        return SplitExists(
            f"split {self._key} was committed by another writer session while this one was adding bags: {said}"
            + ". A complete split takes no more bags: commit once, after every session has closed; to add "
            "bags, write the split again with overwrite=True (--overwrite), every bag included")

    def _stored_ids(self) -> set[str] | None:
        """The committed split's bag ids; None when they cannot be read (then nothing is assumed)."""
        try:
            return set(bag_commit.read_strings(self._storage, f"{self._key}/{bags.BAG_IDS}"))
        except Exception:  # noqa: BLE001 - a refusal follows either way: it says the ids were not read
            return None

    # ------------------------------------------------------------------ input checks
    def _check_open(self, bag_id: str) -> None:
        if self._meta.complete:
            raise SplitExists(f"split {self._key} is complete ({(self._meta.bags or {}).get('count')} bags): "
                              f"bag {bag_id!r} cannot be added to it; overwrite the split (overwrite=True, "
                              "--overwrite) to rewrite it with more bags")
        if self._closed:
            raise WriterClosed(f"writer for {self._key} is closed: open it again with "
                               "create_bag_split(..., resume=True) (on the command line: --resume)")

    def _check_coords(self, bag_id: str, coords: Any, count: int) -> np.ndarray:
        if coords is None:
            fill = np.nan if self.coords_dtype.kind == "f" else bags.NO_COORD_INT
            return np.full((count, 2), fill, self.coords_dtype)
        rows = dtypes.as_numpy(coords)
        if rows.shape != (count, 2):
            raise ShapeMismatch(f"bag {bag_id!r}: coords of shape {tuple(rows.shape)} for {count} feature rows: "
                                f"pass [{count}, 2] coordinates, one (x, y) per patch")
        if rows.dtype == self.coords_dtype:
            return rows
        if rows.dtype.kind not in "iuf":
            raise DtypeMismatch(f"bag {bag_id!r}: coords of dtype {rows.dtype} are not numbers")
        if rows.dtype.kind in "iu" and self.coords_dtype.kind == "i":
            limits = np.iinfo(self.coords_dtype)
            outside = (rows > limits.max) | (rows < limits.min) if len(rows) else np.zeros((0, 2), bool)
            if outside.any():  # uint64 beyond int64, int64 beyond int32: no cast keeps them
                row = int(np.argmax(outside.any(axis=1)))
                raise DtypeMismatch(f"bag {bag_id!r}: coords row {row} ({rows[row, 0]}, {rows[row, 1]}) is beyond "
                                    f"the split's coords_dtype {self.coords_dtype} [{limits.min}, {limits.max}]: "
                                    "pass the bag's real coordinates (level-0 positions are far smaller)"
                                    + ("" if self.coords_dtype == np.int64 else ", or create the split with "
                                       "coords_dtype='int64'"))
            return rows.astype(self.coords_dtype)
        cast = rows.astype(self.coords_dtype)
        if not np.array_equal(cast, rows, equal_nan=self.coords_dtype.kind == "f" and rows.dtype.kind == "f"):
            # advise a dtype the split can have (uint64, float16 coords are not among them)
            wanted = rows.dtype.name if rows.dtype.name in bags.COORD_DTYPES else (
                "float64" if rows.dtype.kind == "f" else "int64")
            raise DtypeMismatch(f"bag {bag_id!r}: coords of dtype {rows.dtype} do not fit the split's coords_dtype "
                                f"{self.coords_dtype} exactly: create the split with coords_dtype='{wanted}'")
        return cast

    def _check_label(self, bag_id: str, label: Any) -> int | float | None:
        labelled = self._labelled if self.label_dtype is None else True
        if (label is None) == labelled and labelled is not None:
            if label is None:
                raise InvalidLabels(f"bag {bag_id!r} has no label, but this split's bags have labels: pass "
                                    "label= with every bag (or with none, and no label_dtype)")
            raise InvalidLabels(f"bag {bag_id!r} has a label, but the bags before it have none: give every "
                                "bag of a split a label, or none")
        if label is None:
            return None
        item: int | float
        if isinstance(label, (int, np.integer)) and not isinstance(label, (bool, np.bool_)):
            item = int(label)  # a Python int of any size: checked against the label dtype below
        else:
            value = dtypes.as_numpy(label)
            if value.shape != () or value.dtype.kind not in "iufb":
                raise ShapeMismatch(f"bag {bag_id!r}: label {label!r} is not one number: pass an int or float per bag")
            item = float(value) if value.dtype.kind == "f" else int(value)
        # the index is JSON and numbers: a commit could never store a non-finite one
        if isinstance(item, float) and not np.isfinite(item):
            raise InvalidLabels(f"bag {bag_id!r}: label {item!r} is not a finite number: give every bag a "
                                "finite label (or leave the bag out)")
        # Integer labels are stored as the declared label_dtype, else as int64 (core.bag_commit):
        # one beyond it would only fail at the commit, after every bag was written.
        dtype = self.label_dtype if self.label_dtype is not None else np.dtype(np.int64)
        if isinstance(item, int) and dtype.kind in "iu" and not np.iinfo(dtype).min <= item <= np.iinfo(dtype).max:
            raise DtypeMismatch(f"bag {bag_id!r}: label {item} is beyond the split's label dtype {dtype} "
                                f"[{np.iinfo(dtype).min}, {np.iinfo(dtype).max}]: pass a label in that range (a class "
                                "index or a number)")
        if self.label_dtype is not None and np.asarray(item).astype(self.label_dtype) != item:
            raise DtypeMismatch(f"bag {bag_id!r}: label {item!r} does not fit the split's label_dtype {self.label_dtype}")
        return item

    # ------------------------------------------------------------------ segment chunks
    def _new_buffers(self) -> tuple[np.ndarray, np.ndarray]:
        # A new pair per chunk: a submitted chunk belongs to the put pool until stored.
        return (self._pool.array((self.chunk_rows, self.dim), dtypes.storage_dtype(self.dtype)),
                self._pool.array((self.chunk_rows, 2), self.coords_dtype))

    def _emit(self) -> None:
        """Hand the current chunk (if it holds rows) and its record to the put pool."""
        self._check_generation()
        puts: list[Any] = []
        if self._fill:
            # a partial last chunk is padded with the fill value 0, as zarr pads edge chunks
            self._features[self._fill :] = 0
            self._coords[self._fill :] = 0
            puts.append((bags.COORDS, self._coords, None))
            puts.append((layout.FEATURES, self._features, None))
        # The record comes last: the pool puts a chunk's last array once the others have landed.
        puts.append((bags.RECORDS, bags.encode_records(self._pending, self._fill), None))
        self._puts.submit(self._chunk, puts)
        self._chunk += 1
        self._fill = 0
        self._pending = []
        self._features, self._coords = self._new_buffers()
