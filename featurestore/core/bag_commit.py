"""A bag split's segments found (resume) and laid out into the final arrays (commit).

``collect`` reads every segment's records (crc32c checked) and keeps the bags whose chunks are
all on storage: the complete bags, whoever wrote them. ``commit`` orders them by id, writes the
final ``features`` and ``coords`` chunks (a chunk whose bytes already sit in one segment chunk
at the same place is linked, not copied: a single writer adding bags in id order rewrites
nothing), then the index arrays (``offsets``, ``bag_ids``, ``labels``, ``bag_attrs``, sealed
``bag_stats``), then ``block_seals`` (each features chunk's running crc32c per row block: a read
checks just the blocks of the bag it reads) and ``chunk_seals`` (every final chunk's crc32c
trailer, read back, sealed with the generation and the chunk's place), then the split document with ``status: "complete"``, and last deletes the
segments. A commit killed at any point leaves the split ``writing`` with its segments intact, so
a resume or another commit redoes it; it is deterministic, so it writes the same bytes again.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from featurestore.core import block_seals, lifecycle, quantize_int8, split_protocol
from featurestore.core.chunk_puts import ChunkPuts, default_workers
from featurestore.core.present import present_chunks
from featurestore.core.reader import FeatureArray
from featurestore.core.seals import put_array, write_seals
from featurestore.core.storage import Storage
from featurestore.core.string_arrays import put_strings
from featurestore.errors import InvalidLabels, SplitExists
from featurestore.format import bags, chunks, dtypes, layout
from featurestore.format.metadata import SplitMetadata, seal
from featurestore.format.stats import SOURCE_NAMES, merge_rows, report, row_length

__all__ = ["Collected", "collect", "commit"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Collected:
    """The complete bags of a split's segments: id -> (segment, record)."""

    records: dict[str, tuple[str, bags.BagRecord]] = field(default_factory=dict)
    filled: dict[tuple[str, int], int] = field(default_factory=dict)  # rows held by a segment chunk
    segments: list[str] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)  # a segment's rows (its chunk count * chunk_rows)
    listed: set[tuple[str, int]] = field(default_factory=set)  # every record found, complete or not


def collect(storage: Storage, key: str, meta: SplitMetadata) -> Collected:
    """The complete bags in ``key``'s segments. A bag id found in several segments (two writers
    given the same bag) is taken from the first segment by name: the same choice every time."""
    rows = meta.chunk_rows
    out = Collected()
    out.segments = _segments(storage, key)

    def scan(segment: str) -> tuple[set[int], list[int], list[tuple[int, int, list[bags.BagRecord]]]]:
        base = f"{key}/{bags.SEGMENTS}/{segment}"
        present = present_chunks(storage, base, [(name, 2, _payload(meta, name)) for name in (layout.FEATURES, bags.COORDS)])
        indices = _record_indices(storage, base)
        return present, indices, list(_records(storage, base, indices))

    for segment, (present, indices, found) in zip(out.segments, in_flight(storage, scan, out.segments)):
        out.rows[segment] = (max(present) + 1) * rows if present else 0
        out.listed.update((segment, i) for i in indices)
        for index, filled, records in found:
            out.filled[(segment, index)] = filled
            for record in records:
                if record.bag_id in out.records or not all(c in present for c in record.chunks(rows)):
                    continue
                out.records[record.bag_id] = (segment, record)
    return out


def in_flight(storage: Storage, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[R]:
    """``fn(item)`` of each item, in order, as many at a time as the storage's puts (object
    storage: 8): a ``--worker`` split has a segment per slide, each a few listings and reads of
    tens of milliseconds on an object store, which one after another made a 10,000-slide commit
    take the better part of an hour. At most twice that many results wait to be taken."""
    items = list(items)
    workers = min(default_workers(storage), len(items))
    if workers <= 1:
        yield from map(fn, items)
        return
    pool = ThreadPoolExecutor(workers, thread_name_prefix="featurestore-commit")
    try:
        pending = collections.deque(pool.submit(fn, item) for item in items[: 2 * workers])
        upcoming = iter(items[2 * workers :])
        while pending:
            result = pending.popleft().result()
            pending.extend(pool.submit(fn, item) for item in itertools.islice(upcoming, 1))
            yield result
    finally:  # an item failed, or the caller stopped taking: what has not started never does
        pool.shutdown(wait=True, cancel_futures=True)


def _segments(storage: Storage, key: str) -> list[str]:
    """The names of the split's writer segments (a dot-name is a temporary of the storage's)."""
    return [s for s in storage.listdir(f"{key}/{bags.SEGMENTS}") if not s.startswith(".")]


def _record_indices(storage: Storage, segment_key: str) -> list[int]:
    return sorted(int(n) for n in storage.listdir(f"{segment_key}/{bags.RECORDS}/c") if n.isdigit())


def _records(storage: Storage, segment_key: str, indices: list[int]) -> Iterator[tuple[int, int, list[bags.BagRecord]]]:
    """``(index, filled, records)`` of the segment's record chunks ``indices`` whose crc32c checks
    (a record is written atomically: one cut short or undecodable is damage, and skipped)."""
    keys = [layout.chunk_key(f"{segment_key}/{bags.RECORDS}", i, 1) for i in indices]
    for index, raw in zip(indices, storage.read_present(keys)):
        if raw is None or chunks.check(raw, None) is not None:
            continue
        try:
            filled, records = bags.decode_records(raw[: -layout.CRC_BYTES])
        except ValueError:
            continue
        yield index, filled, records


def late_bags(storage: Storage, key: str, found: Collected, taken: set[str]) -> list[str]:
    """Ids of bags whose records landed after ``found`` was listed and that the split (its ids
    ``taken``) lacks: a session still adding while the commit ran. Listed again after the split is
    marked complete, so a later put is seen by its own session's close (a complete split)."""
    def scan(segment: str) -> list[str]:
        base = f"{key}/{bags.SEGMENTS}/{segment}"
        new = [i for i in _record_indices(storage, base) if (segment, i) not in found.listed]
        return [r.bag_id for _, _, records in _records(storage, base, new) for r in records if r.bag_id not in taken]

    return sorted({bag_id for ids in in_flight(storage, scan, _segments(storage, key)) for bag_id in ids})


def _payload(meta: SplitMetadata, name: str) -> int:
    if name == bags.COORDS:
        return meta.chunk_rows * 2 * np.dtype((meta.bags or {})["coords"]["dtype"]).itemsize
    return meta.chunk_rows * int(meta.sample_shape[0]) * dtypes.storage_dtype(meta.logical_dtype).itemsize


def array_document(meta: SplitMetadata, name: str, rows: int) -> bytes:
    """The zarr.json of ``features`` or ``coords`` holding ``rows`` rows."""
    spec = meta.bags or {}
    if name == bags.COORDS:
        data_type, width = spec["coords"]["dtype"], 2
        attrs = {"unit": spec["coords"]["unit"], "patch_size_level0": spec.get("patch_size_level0")}
    else:
        data_type, width = dtypes.zarr_data_type(meta.logical_dtype), int(meta.sample_shape[0])
        attrs = {"logical_dtype": meta.logical_dtype}
    return layout.array_document(shape=(rows, width), chunk_rows=meta.chunk_rows, data_type=data_type,
                                 attributes={"featurestore": attrs})


def commit(storage: Storage, key: str, meta: SplitMetadata, extra: dict[str, Any] | None = None,
           found: Collected | None = None) -> SplitMetadata:
    """Lay out every complete bag of ``key`` and mark the split complete (module doc); ``extra``
    keys join the metadata's extra keys; ``found``: what :func:`collect` gave the caller just
    before (not read twice)."""
    if split_protocol.committed_elsewhere(storage, key, meta):
        # Its segments went at that commit: laying out what is left would drop the committed bags.
        raise SplitExists(f"split {key} was committed by another session since this one read it: it is "
                          "complete, and committing again would drop its bags; read it, or overwrite it")
    found = found if found is not None else collect(storage, key, meta)
    ids = sorted(found.records)
    entries = [found.records[i] for i in ids]
    offsets = bags.offsets_of([r.length for _, r in entries])
    total = int(offsets[-1])
    labels = _labels(meta, ids, [r.label for _, r in entries])
    _write_rows(storage, key, meta, found, entries, offsets, total)
    stats = [r.stats for _, r in entries]
    _write_index(storage, key, meta, ids, offsets, labels, [r.attrs for _, r in entries], stats)
    if dtypes.is_int8(meta.logical_dtype):  # bag i: features[offsets[i]:offsets[i+1]] * scales[i]
        put_array(storage, f"{key}/{layout.SCALES}",
                  quantize_int8.bag_scales([r for _, r in entries], int(meta.sample_shape[0])),
                  attributes={"featurestore": {"description": "int8 scales, one row per bag; see docs/FORMAT.md"}})
    # the features trailers the block seals check read back serve chunk_seals too
    trailers = block_seals.finish(storage, key, meta.replace(num_samples=total))
    write_seals(storage, key, meta, bags.SEALED_ARRAYS, known=trailers)
    spec = dict(meta.bags or {})
    spec["count"] = len(ids)
    if labels is not None:
        spec["labels"] = {"dtype": labels.dtype.name}
    final = lifecycle.mark_complete(storage, key, meta, num_samples=total, bags=spec,
                                    extra={**meta.extra, **(extra or {})}, **folded_report(meta, stats))
    late = late_bags(storage, key, found, set(ids))
    storage.delete_tree(f"{key}/{bags.SEGMENTS}")
    if late:
        raise SplitExists(f"split {key} is committed with {len(ids)} bags, but {len(late)} bag(s) another writer "
                          f"session added while this commit ran are not in it (first: {late[0]!r}): commit once, "
                          "after every session has closed; to include them, write the split again with "
                          "overwrite=True (--overwrite), every bag included")
    return final


def folded_report(meta: SplitMetadata, rows: list[np.ndarray]) -> dict[str, Any]:
    """The quantization report, channel statistics and source dtype folded from the bags'
    statistics rows (unsealed)."""
    total = merge_rows(rows, int(meta.sample_shape[0]))
    source = SOURCE_NAMES.get(total.source_code) or meta.source_dtype or meta.logical_dtype
    return {**report(total, source_dtype=source, logical_dtype=meta.logical_dtype), "source_dtype": source}


def _labels(meta: SplitMetadata, ids: list[str], values: list[Any]) -> np.ndarray | None:
    given = [v for v in values if v is not None]
    declared = (meta.bags or {}).get("labels")
    if not given and declared is None:
        return None
    missing = [i for i, v in zip(ids, values) if v is None]
    if missing:
        raise InvalidLabels(f"cannot commit {key_of(meta)}: {len(missing)} of {len(ids)} bags have no label "
                            f"(first: {missing[0]!r}; writer sessions disagreed): a split's bags have a label "
                            "each or none; overwrite the split (overwrite=True, --overwrite) to redo it")
    if declared is not None:
        dtype = np.dtype(declared["dtype"])
    else:
        dtype = np.dtype(np.float64 if any(isinstance(v, float) for v in given) else np.int64)
    return np.asarray(given, dtype)


def key_of(meta: SplitMetadata) -> str:
    return layout.split_key(meta.dataset, meta.encoder_name, meta.split)


def _write_rows(storage: Storage, key: str, meta: SplitMetadata, found: Collected,
                entries: list[tuple[str, bags.BagRecord]], offsets: np.ndarray, total: int) -> None:
    rows, dim = meta.chunk_rows, int(meta.sample_shape[0])
    pieces = [bags.Piece(int(offsets[i]), segment, r.start, r.length)
              for i, (segment, r) in enumerate(entries) if r.length]
    sources: dict[tuple[str, str], FeatureArray] = {}
    made = threading.Lock()

    def source(segment: str, name: str) -> FeatureArray:
        with made:  # one reader per segment array, whichever thread asks first
            if (segment, name) not in sources:
                sources[(segment, name)] = rows_reader(storage, f"{key}/{bags.SEGMENTS}/{segment}", meta, name,
                                                       found.rows[segment])
            return sources[(segment, name)]

    coords_dtype = np.dtype((meta.bags or {})["coords"]["dtype"])

    def lay_out(item: tuple[int, list[bags.Piece]]) -> tuple[np.ndarray, np.ndarray] | None:
        """Chunk ``index``'s rows read from the segments (None: linked in place instead)."""
        index, parts = item
        split_protocol.check_generation(storage, key, meta)
        place = bags.in_place(parts, index, rows, total, found.filled)
        if place is not None:
            segment, at = place
            base = f"{key}/{bags.SEGMENTS}/{segment}"
            block_seals.copy_row(storage, base, at, key, index)  # before its chunk, as the puts order them
            for name in (bags.COORDS, layout.FEATURES):
                storage.copy(layout.chunk_key(f"{base}/{name}", at, 2), layout.chunk_key(f"{key}/{name}", index, 2))
            return None
        features = np.zeros((rows, dim), dtypes.storage_dtype(meta.logical_dtype))
        coords = np.zeros((rows, 2), coords_dtype)
        lo = index * rows
        for part in parts:
            where = np.arange(part.seg_start, part.seg_start + part.length, dtype=np.int64)
            at = slice(part.start - lo, part.start - lo + part.length)
            source(part.segment, layout.FEATURES).read_numpy(where, out=features[at])
            source(part.segment, bags.COORDS).read_numpy(where, out=coords[at])
        return coords, features

    puts = ChunkPuts(storage, key, block_nbytes=block_seals.block_nbytes(meta))
    try:
        # Chunks read ahead, in order: each gathers from many small segments on a --worker split.
        planned = list(enumerate(bags.chunk_pieces(pieces, total, rows)))
        for (index, _), laid in zip(planned, in_flight(storage, lay_out, planned)):
            if laid is not None:
                puts.submit(index, [(bags.COORDS, laid[0], None), (layout.FEATURES, laid[1], None)])
    finally:
        puts.close()
    count = layout.num_chunks(total, rows)
    for name in (layout.FEATURES, bags.COORDS, block_seals.BLOCK_SEALS):
        # chunks beyond the count: left by an earlier, interrupted commit of more rows
        for stale in (int(c) for c in storage.listdir(f"{key}/{name}/c") if c.isdigit() and int(c) >= count):
            storage.delete_tree(f"{key}/{name}/c/{stale}")
    for name in (layout.FEATURES, bags.COORDS):
        storage.write(f"{key}/{name}/{layout.ZARR_JSON}", array_document(meta, name, total))


def rows_reader(storage: Storage, base: str, meta: SplitMetadata, name: str, rows: int) -> FeatureArray:
    """``features`` or ``coords`` of ``rows`` rows under ``base`` (a segment, or the split itself),
    read through the checked reader (each chunk's crc32c verified)."""
    doc = layout.load_document(array_document(meta, name, rows))
    logical = meta.logical_dtype if name == layout.FEATURES else (meta.bags or {})["coords"]["dtype"]
    array = FeatureArray(storage, base, name, doc, logical_dtype=logical, metadata={"status": "complete"})
    if array.path == "cached":
        # Each row is read once to be laid out, and segments are deleted at commit: the chunk
        # cache would only fill with dead chunks (and it keys a split's chunks by the split's
        # metadata, which a segment has not). Ranged reads, crc32c-checked, as without a cache.
        array.path = "ranges"
    return array


def _write_index(storage: Storage, key: str, meta: SplitMetadata, ids: list[str], offsets: np.ndarray,
                 labels: np.ndarray | None, attrs: list[str], stats: list[np.ndarray]) -> None:
    n = len(ids)
    put_array(storage, f"{key}/{bags.OFFSETS}", offsets, attributes={"featurestore": {
        "description": "bag i is rows offsets[i]:offsets[i+1] of features and coords"}})
    storage.delete_tree(f"{key}/{layout.LABELS}")
    if labels is not None:
        put_array(storage, f"{key}/{layout.LABELS}", labels)
    width = row_length(int(meta.sample_shape[0])) + (2 if meta.generation is not None else 0)
    sealed = np.zeros((n, width), np.float64)
    for i, row in enumerate(stats):
        sealed[i] = seal(row, meta, i)
    put_array(storage, f"{key}/{bags.BAG_STATS}", sealed, attributes={"featurestore": {
        "description": "per-bag statistics rows, sealed (generation, bag index); see docs/FORMAT.md"}})
    _put_strings(storage, f"{key}/{bags.BAG_IDS}", ids)
    _put_strings(storage, f"{key}/{bags.BAG_ATTRS}", attrs)


def _put_strings(storage: Storage, array_key: str, values: list[str]) -> None:
    # crc32c after the vlen-utf8 serializer: zarr checks it on every decode, verify reads it too.
    from zarr.codecs import Crc32cCodec

    put_strings(storage, array_key, values, compressors=[Crc32cCodec()])


def read_strings(storage: Storage, array_key: str) -> list[str]:
    import zarr

    array = zarr.open_array(store=storage.zarr_store(), path=array_key, mode="r")
    return [str(v) for v in array[:]] if array.shape[0] else []
