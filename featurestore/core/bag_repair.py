"""Repairing a complete bag split from its source: the bags a damaged chunk belongs to, and the
commit that rewrites exactly their chunks (docs/FORMAT.md, "Slide bags": repair).

A resume of a complete bag split (``create_bag_split(resume=True)``; ``verify_chunks=True`` reads
every chunk, as ``featurestore verify`` does, else only their sizes) checks it here first:

- sound: the writer comes back complete, nothing to do;
- a ``features`` or ``coords`` chunk missing, damaged or not where ``chunk_seals`` puts it, with
  a sound index: the bags whose rows lie in such chunks are to be added again. Their ids go into
  the split document (``bags.repair``) together with ``status: "writing"`` (the split must not
  read as complete meanwhile), and the writer is a :class:`RepairWriter` whose ``done_ids`` are
  every other bag. The caller adds those bags from its source as it adds any missing bag; the
  commit (:func:`commit_repair`) writes the chunks their rows lie in, with the other bags' rows
  read from the split itself, their statistics rows, the seals of the chunks written, and the
  document back to complete. Every other file stays as it is;
- the index itself damaged (``offsets``, ``bag_ids``, ``labels``, ``bag_attrs``, ``bag_stats``,
  ``chunk_seals``) or an array document wrong: no chunk can be traced to its bags, so every bag is
  added again (a plain writer with none done) and the ordinary commit lays the split out anew.

Kills: the ids to redo are on storage before anything else changes; a resume of the ``writing``
split (any rank, with or without ``verify_chunks``) gets a :class:`RepairWriter` for the same
bags, counting those already added to a segment as done. The repair commit writes the same bytes
again when redone (the bags to redo come from the segments, which it deletes last); it never
rewrites the index arrays whole, it replaces single chunks of ``bag_stats`` and ``chunk_seals``,
each one atomic put.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore.core import bag_commit, block_seals, lifecycle, split_protocol
from featurestore.core.bag_verify import BagIndex, damaged_row_chunks, read_index
from featurestore.core.bag_writer import BagWriter
from featurestore.core.chunk_puts import ChunkPuts
from featurestore.core.seals import put_index_chunk, read_trailers
from featurestore.core.storage import Storage
from featurestore.errors import CorruptChunk, IncompleteSplit, InputChanged, SplitExists
from featurestore.format import bags, dtypes, layout
from featurestore.format.metadata import SplitMetadata, seal, unseal

__all__ = ["REPAIR", "RepairWriter", "commit_repair", "open_complete", "resume_repair"]

REPAIR = "repair"  # the key, in the split's ``bags`` settings, of the bag ids being redone


class RepairWriter(BagWriter):
    """A :class:`BagWriter` that adds only the bags of ``repair_ids`` (the ones whose chunks are
    damaged) and whose commit rewrites only their chunks."""

    def __init__(self, storage: Storage, key: str, metadata: SplitMetadata, *, done_ids: set[str],
                 repair_ids: set[str]) -> None:
        super().__init__(storage, key, metadata, done_ids=done_ids)
        self.repair_ids = frozenset(repair_ids)

    def add_bag(self, bag_id: str, features: Any, coords: Any = None, label: Any = None,
                attrs: dict[str, Any] | None = None) -> None:
        if bags.check_bag_id(bag_id) not in self.repair_ids:
            raise SplitExists(f"bag {bag_id!r} is not in split {self._key}, which is being repaired (its "
                              f"{len(self.repair_ids)} damaged bag(s) added again): a repair adds no bags; "
                              "overwrite the split (overwrite=True, --overwrite) to add some")
        super().add_bag(bag_id, features, coords=coords, label=label, attrs=attrs)

    def commit(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._meta.complete:
            return self._meta.to_json()
        self.close()
        self._meta = commit_repair(self._storage, self._key, self._meta, extra=extra)
        return self._meta.to_json()


def open_complete(storage: Storage, key: str, meta: SplitMetadata, *, verify_chunks: bool) -> BagWriter | None:
    """A resume of the complete split ``key``: None if it is sound, else the writer that repairs it
    (module doc)."""
    index, _ = read_index(storage, key, meta)
    bad = None if index is None else damaged_row_chunks(storage, key, meta, index, crc=verify_chunks)
    if bad is not None and not bad:
        return None
    if index is None or bad is None:  # nothing traces a chunk to its bags: every bag again
        writing = lifecycle.mark_writing(storage, key, meta)
        return BagWriter(storage, key, writing, done_ids=set())
    redo = bags_in_chunks(index, bad, meta.chunk_rows)
    writing = lifecycle.mark_writing(storage, key, meta, bags={**(meta.bags or {}), REPAIR: sorted(redo)})
    return RepairWriter(storage, key, writing, done_ids=set(index.ids) - redo, repair_ids=redo)


def resume_repair(storage: Storage, key: str, meta: SplitMetadata, *, verify_chunks: bool) -> RepairWriter:
    """A resume of a split whose repair began (``bags.repair`` in its document): the same bags to
    redo, plus, with ``verify_chunks``, those of any chunk found damaged since."""
    redo = set((meta.bags or {})[REPAIR])
    index = _index(storage, key, meta)
    if verify_chunks:
        bad = damaged_row_chunks(storage, key, meta, index, crc=True)
        more = bags_in_chunks(index, bad or set(), meta.chunk_rows) - redo
        if more:
            redo |= more
            meta = meta.replace(bags={**(meta.bags or {}), REPAIR: sorted(redo)})
            lifecycle.write_split_document(storage, key, meta)
    added = set(bag_commit.collect(storage, key, meta).records) & redo
    return RepairWriter(storage, key, meta, done_ids=(set(index.ids) - redo) | added, repair_ids=redo)


def bags_in_chunks(index: BagIndex, chunk_indices: set[int], chunk_rows: int) -> set[str]:
    """The bags with rows in any of ``chunk_indices`` (chunks beyond the rows hold none)."""
    offsets, out = index.offsets, set()
    for chunk in chunk_indices:
        lo, hi = chunk * chunk_rows, (chunk + 1) * chunk_rows
        i = int(np.searchsorted(offsets[1:], lo, side="right"))  # first bag ending after lo
        while i < len(index.ids) and offsets[i] < hi:
            if offsets[i + 1] > offsets[i]:
                out.add(index.ids[i])
            i += 1
    return out


def commit_repair(storage: Storage, key: str, meta: SplitMetadata, extra: dict[str, Any] | None = None) -> SplitMetadata:
    """Rewrite the chunks of the bags being redone from their segments and mark the split complete
    (module doc); ``extra`` keys join the metadata's."""
    split_protocol.check_generation(storage, key, meta)
    spec = dict(meta.bags or {})
    redo = set(spec.pop(REPAIR))
    index = _index(storage, key, meta)
    found = bag_commit.collect(storage, key, meta)
    missing = sorted(redo - set(found.records))
    if missing:
        raise IncompleteSplit(f"cannot finish the repair of {key}: {len(missing)} damaged bag(s) were not added "
                              f"again (first: {missing[0]!r}); rerun the command that wrote the split with --resume "
                              "once their source is readable, or --overwrite")
    position = {bag_id: i for i, bag_id in enumerate(index.ids)}
    stats = index.stats.copy()
    for bag_id in sorted(redo):
        i = position[bag_id]
        _same_bag(key, index, i, found.records[bag_id][1])
        stats[i] = seal(found.records[bag_id][1].stats, meta, i)
    rows, total = meta.chunk_rows, int(meta.num_samples)
    count = layout.num_chunks(total, rows)
    chunks = {c for bag_id in redo for c in _chunks_of(index, position[bag_id], rows)}
    _write_chunks(storage, key, meta, index, found, redo, sorted(chunks))
    for name in (layout.FEATURES, bags.COORDS):  # files beyond the count: not the commit's
        for stale in (int(c) for c in storage.listdir(f"{key}/{name}/c") if c.isdigit() and int(c) >= count):
            storage.delete_tree(f"{key}/{name}/c/{stale}")
    _replace_rows(storage, f"{key}/{bags.BAG_STATS}", index.stats, stats)
    _reseal(storage, key, meta, index.seals, sorted(chunks))
    final = lifecycle.mark_complete(storage, key, meta, bags=spec, extra={**meta.extra, **(extra or {})},
                                    **bag_commit.folded_report(meta, [unseal(row, meta)[0] for row in stats]))
    storage.delete_tree(f"{key}/{bags.SEGMENTS}")
    return final


def _index(storage: Storage, key: str, meta: SplitMetadata) -> BagIndex:
    index, problems = read_index(storage, key, meta)
    if index is None:
        raise CorruptChunk(f"cannot repair {key}: its index is damaged too ({problems[0] if problems else 'unreadable'}); "
                           "rerun the command that wrote it with --overwrite")
    return index


def _same_bag(key: str, index: BagIndex, i: int, record: bags.BagRecord) -> None:
    """A bag added again must be the bag it replaces: same rows count, label and attributes
    (else its source changed, and the rest of the split no longer matches it)."""
    length = int(index.offsets[i + 1] - index.offsets[i])
    label = None if index.labels is None else index.labels[i].item()
    for what, old, new in (("rows", length, record.length), ("label", label, record.label),
                           ("attributes", index.attrs[i], record.attrs)):
        if old != new:
            raise InputChanged(f"cannot repair {key}: bag {record.bag_id!r} now has {what} {new!r}, the split "
                               f"holds {old!r}: its source changed since the split was written; rerun with "
                               "--overwrite to rewrite the whole split")


def _chunks_of(index: BagIndex, i: int, chunk_rows: int) -> range:
    start, stop = int(index.offsets[i]), int(index.offsets[i + 1])
    return range(start // chunk_rows, (stop - 1) // chunk_rows + 1) if stop > start else range(0)


def _write_chunks(storage: Storage, key: str, meta: SplitMetadata, index: BagIndex, found: bag_commit.Collected,
                  redo: set[str], targets: list[int]) -> None:
    """Each chunk of ``targets`` assembled as the commit lays it out: rows of the bags redone from
    their segments, the other bags' rows read (crc32c checked) from the split's own chunk."""
    rows, dim, total = meta.chunk_rows, int(meta.sample_shape[0]), int(meta.num_samples)
    coords_dtype = np.dtype((meta.bags or {})["coords"]["dtype"])
    readers: dict[tuple[str, str], Any] = {}

    def reader(segment: str | None, name: str) -> Any:
        if (segment, name) not in readers:
            base, count = (key, total) if segment is None else (f"{key}/{bags.SEGMENTS}/{segment}", found.rows[segment])
            readers[(segment, name)] = bag_commit.rows_reader(storage, base, meta, name, count)
        return readers[(segment, name)]

    # A split with block seals gets the rewritten chunks' rows with them (one written before
    # block seals keeps none: its readers check whole chunks)
    sealed = storage.exists(f"{key}/{block_seals.BLOCK_SEALS}/{layout.ZARR_JSON}")
    puts = ChunkPuts(storage, key, block_nbytes=block_seals.block_nbytes(meta) if sealed else None)
    try:
        for chunk in targets:
            split_protocol.check_generation(storage, key, meta)
            features = np.zeros((rows, dim), dtypes.storage_dtype(meta.logical_dtype))
            coords = np.zeros((rows, 2), coords_dtype)
            lo, hi = chunk * rows, min(total, (chunk + 1) * rows)
            i = int(np.searchsorted(index.offsets[1:], lo, side="right"))
            while i < len(index.ids) and index.offsets[i] < hi:
                start, stop = int(index.offsets[i]), int(index.offsets[i + 1])
                a, b = max(lo, start), min(hi, stop)
                if a < b:
                    bag_id = index.ids[i]
                    if bag_id in redo:
                        segment, record = found.records[bag_id]
                        where = np.arange(record.start + a - start, record.start + b - start, dtype=np.int64)
                    else:
                        segment, where = None, np.arange(a, b, dtype=np.int64)
                    reader(segment, layout.FEATURES).read_numpy(where, out=features[a - lo : b - lo])
                    reader(segment, bags.COORDS).read_numpy(where, out=coords[a - lo : b - lo])
                i += 1
            puts.submit(chunk, [(bags.COORDS, coords, None), (layout.FEATURES, features, None)])
    finally:
        puts.close()


def _replace_rows(storage: Storage, array_key: str, old: np.ndarray, new: np.ndarray) -> None:
    """Put again the chunks of a small array whose rows changed (each chunk one atomic put)."""
    rows = layout.array_chunk_rows(layout.load_document(storage.read(f"{array_key}/{layout.ZARR_JSON}")))
    changed = [r for r in range(len(old)) if old[r].tobytes() != new[r].tobytes()]  # NaN rows compare too
    for chunk in sorted({r // rows for r in changed}):
        put_index_chunk(storage, array_key, new, rows, chunk)


def _reseal(storage: Storage, key: str, meta: SplitMetadata, table: np.ndarray, chunks: list[int]) -> None:
    """``chunk_seals`` with the trailers of the chunks written read back into their rows; every
    other row stays as the commit sealed it."""
    sealed = table.copy()
    for code, name in enumerate(bags.SEALED_ARRAYS[:2]):  # features, coords
        doc = layout.load_document(storage.read(f"{key}/{name}/{layout.ZARR_JSON}"))
        rows = np.flatnonzero(sealed[:, 0] == code)
        for chunk, crc in zip(chunks, read_trailers(storage, f"{key}/{name}", doc, chunks)):
            sealed[rows[chunk], 2] = crc
    _replace_rows(storage, f"{key}/{bags.CHUNK_SEALS}", table, sealed)
