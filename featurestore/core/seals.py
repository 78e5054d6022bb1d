"""``chunk_seals`` on storage, for every kind of split: written at commit, read back, asked.

The table itself (codes, rows, what a mismatch means) is featurestore.format.seals. Here: the
crc32c trailers read back from the chunks (4 bytes each: a chunk linked or put by another writer
is never decoded at commit), the small arrays in featurestore's own chunk encoding that hold
the table (and a bag split's index), and the one question a reader asks of it: which crc32c
belongs at this place in this generation (:func:`sealed_crc` for one chunk, :class:`SealTable`
for the chunk cache's check of every cached file of a split, either kind).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from featurestore.core.storage import Storage
from featurestore.errors import CorruptChunk
from featurestore.format import chunks, layout
from featurestore.format.metadata import SplitMetadata
from featurestore.format.seals import CHUNK_SEALS, SEAL_COLUMNS, SEALED_ARRAYS, generation_of, seal_table

INDEX_CHUNK_BYTES = 8 << 20


def read_trailers(storage: Storage, array_key: str, doc: dict[str, Any], indices: Iterable[int]) -> list[int]:
    """The crc32c trailers of chunks ``indices`` (4 bytes read from each; a compressed chunk's
    size is asked first)."""
    shape, rows = list(doc["shape"]), layout.array_chunk_rows(doc)
    keys = [layout.chunk_key(array_key, i, len(shape)) for i in indices]
    if layout.is_compressed(doc):
        sizes = [storage.size(k) for k in keys]
        ends = [(s if s is not None else layout.CRC_BYTES) for s in sizes]
    else:
        nbytes = rows * int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(doc["data_type"]).itemsize
        ends = [nbytes + layout.CRC_BYTES] * len(keys)
    trailers = storage.read_ranges(keys, [e - layout.CRC_BYTES for e in ends], ends)
    return [int.from_bytes(t, "little") for t in trailers]


def write_seals(storage: Storage, key: str, meta: SplitMetadata, names: Sequence[str],
                known: dict[str, list[int]] | None = None) -> None:
    """``chunk_seals`` of split ``key``: the crc32c trailer of every chunk of the arrays ``names``
    that exist (in ``SEALED_ARRAYS`` order), sealed with the generation; ``known``: arrays whose
    trailers the commit read back already (the block seals check), not read again."""
    crcs: dict[str, list[int]] = {}
    for name in names:
        if known and name in known:
            crcs[name] = known[name]
            continue
        try:
            doc = layout.load_document(storage.read(f"{key}/{name}/{layout.ZARR_JSON}"))
        except FileNotFoundError:
            continue  # no labels
        count = layout.num_chunks(doc["shape"][0], layout.array_chunk_rows(doc))
        crcs[name] = read_trailers(storage, f"{key}/{name}", doc, range(count))
    put_array(storage, f"{key}/{CHUNK_SEALS}", seal_table(crcs, generation_of(meta)),
              attributes={"featurestore": {"description": f"one row per chunk of {', '.join(names)}: array code, "
                                           "chunk index, crc32c, generation; see docs/FORMAT.md",
                                           "arrays": list(SEALED_ARRAYS)}})


def read_table(storage: Storage, key: str) -> np.ndarray | None:
    """Split ``key``'s ``chunk_seals`` (each chunk's crc32c checked), None if it has none (a dense
    split committed before the table existed, or one not committed yet)."""
    try:
        doc = layout.load_document(storage.read(f"{key}/{CHUNK_SEALS}/{layout.ZARR_JSON}"))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    shape, rows = list(doc["shape"]), layout.array_chunk_rows(doc)
    parts = []
    for index in range(layout.num_chunks(shape[0], rows)):
        chunk = layout.chunk_key(f"{key}/{CHUNK_SEALS}", index, 2)
        raw = storage.read(chunk)
        problem = chunks.check(raw, rows * SEAL_COLUMNS * 8)
        if problem is not None:
            raise CorruptChunk(f"{chunk}: {problem}: run `featurestore verify`, then resume the split to rewrite it")
        parts.append(np.frombuffer(raw[: -layout.CRC_BYTES], "<u8").reshape(rows, SEAL_COLUMNS))
    return (np.concatenate(parts) if parts else np.empty((0, SEAL_COLUMNS), np.uint64))[: shape[0]]


def sealed_crc(storage: Storage, key: str, meta: SplitMetadata, array: str, chunk: int,
               table: np.ndarray | None = None) -> int | None:
    """The crc32c the split's ``chunk_seals`` holds for chunk ``chunk`` of ``array``, None when the
    split has no table (then its statistics rows are its only seal). A table without that row,
    or sealed for another generation, is :class:`CorruptChunk`. ``table``: the table already read."""
    table = read_table(storage, key) if table is None else table
    if table is None:
        return None
    code = SEALED_ARRAYS.index(array) if array in SEALED_ARRAYS else -1
    rows = np.flatnonzero((table[:, 0] == code) & (table[:, 1] == chunk))
    if len(rows) != 1 or int(table[rows[0], 3]) != generation_of(meta):
        raise CorruptChunk(f"{key}/{CHUNK_SEALS} does not seal chunk {chunk} of {array} for generation "
                           f"{meta.generation}: run `featurestore verify`, then resume the split to rewrite it")
    return int(table[rows[0], 2])


class SealTable:
    """A split's ``chunk_seals``, read on first use (the chunk cache's check of a file this process
    did not fetch: its trailer against the crc32c sealed for its place, no request per chunk);
    each sealed array's crc32c per chunk index. The table is read straight from storage (one
    small GET, its own crc32c checked), never through the cache."""

    def __init__(self, storage: Storage, key: str, meta: SplitMetadata) -> None:
        self._storage, self._key, self._generation = storage, key, generation_of(meta)
        self._columns: dict[str, np.ndarray] | None = None

    def crcs(self, name: str) -> np.ndarray | None:
        """The crc32c sealed for each chunk of array ``name`` (-1 where none is), or None where
        the table seals nothing for it: a split committed before ``chunk_seals`` existed, an
        array sealed only since (an older int8 split's scales), or a table of another generation
        (the split changed since it was opened: the read's generation check says so)."""
        if self._columns is None:
            self._columns = self._load()
        return self._columns.get(name)

    def _load(self) -> dict[str, np.ndarray]:
        table = read_table(self._storage, self._key)
        if table is None or bool((table[:, 3] != self._generation).any()):
            return {}
        columns = {}
        for code, name in enumerate(SEALED_ARRAYS):
            rows = table[table[:, 0] == code]
            if not len(rows):
                continue
            crcs = np.full(int(rows[:, 1].max()) + 1, -1, np.int64)
            crcs[rows[:, 1].astype(np.int64)] = rows[:, 2].astype(np.int64)
            columns[name] = crcs
        return columns


def put_array(storage: Storage, array_key: str, values: np.ndarray, attributes: dict[str, Any] | None = None) -> None:
    """A small array in featurestore's own chunk encoding (raw little-endian rows + crc32c)."""
    values = np.ascontiguousarray(values, values.dtype.newbyteorder("<"))
    row_bytes = max(1, values[:1].nbytes if len(values) else values.dtype.itemsize * int(np.prod(values.shape[1:])))
    chunk_rows = max(1, min(max(1, len(values)), INDEX_CHUNK_BYTES // row_bytes))
    storage.delete_tree(array_key)
    storage.write(f"{array_key}/{layout.ZARR_JSON}", layout.array_document(
        shape=values.shape, chunk_rows=chunk_rows, data_type=values.dtype.name, attributes=attributes))
    for index in range(layout.num_chunks(len(values), chunk_rows)):
        put_index_chunk(storage, array_key, values, chunk_rows, index)


def put_index_chunk(storage: Storage, array_key: str, values: np.ndarray, chunk_rows: int, index: int) -> None:
    """Chunk ``index`` of a small array (one atomic put: a repair replaces single chunks this way)."""
    values = np.ascontiguousarray(values, values.dtype.newbyteorder("<"))
    part = values[index * chunk_rows : (index + 1) * chunk_rows]
    if len(part) < chunk_rows:  # edge chunks at full shape, padded with 0 (as zarr writes them)
        padded = np.zeros((chunk_rows, *values.shape[1:]), values.dtype)
        padded[: len(part)] = part
        part = padded
    storage.write_sealed(layout.chunk_key(array_key, index, values.ndim), chunks.encode(part, None))
