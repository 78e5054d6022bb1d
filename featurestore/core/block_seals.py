"""``block_seals`` on storage (featurestore.format.block_seals has the format): each features
chunk's running block crc32c written beside it by the chunk puts, the array's document at commit,
and the table read back for a reader.

The writer computes a chunk's block crcs in the one crc32c pass its trailer needs (the trailer is
the last of them), puts the chunk's row before the features chunk (a features chunk on storage
has its row; the chunk puts put it beside the chunk's other early arrays), and the commit writes
the document. A row is kept only where its last value is its chunk's trailer; one missing then
(a chunk a writer of an older version left, resumed) or not ending in it (a row whose writer was
killed before its chunk, beside the chunk a writer without block seals put on resume) is
computed from its chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.core.seals import read_trailers
from featurestore.core.storage import Storage
from featurestore.format import chunks, layout
from featurestore.format.block_seals import (
    BLOCK_SEALS,
    block_rows,
    block_span,
    blocks_per_chunk,
    damaged_blocks,
    running_crcs,
)
from featurestore.format.metadata import SplitMetadata

# Writers seal row blocks (tests turn it off to write a split as an older version did).
ENABLED = True


def block_nbytes(meta: SplitMetadata) -> int | None:
    """Payload bytes of a block of the split's features chunks; None where the split has no
    block seals (compressed chunks: zarr decodes and checks them whole; or sealing is off)."""
    if not ENABLED or meta.compressor is not None:
        return None
    sample = _sample_nbytes(meta)
    return block_rows(sample, meta.chunk_rows) * sample


def _sample_nbytes(meta: SplitMetadata) -> int:
    from featurestore.format import dtypes

    return int(np.prod(meta.sample_shape, dtype=np.int64)) * dtypes.storage_dtype(meta.logical_dtype).itemsize


def sealed_puts(storage: Storage, split_key: str, index: int, chunk_key: str, payload: memoryview,
                nbytes: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """The put of features chunk ``index``'s block seals row and the put of the chunk itself (at
    ``chunk_key``, with its trailer), from one crc32c pass. The caller starts the chunk's put once
    the row's has landed."""
    crcs = running_crcs(payload, nbytes)
    row = memoryview(crcs.astype("<u4")).cast("B")

    def put_row() -> None:
        storage.write_sealed(layout.chunk_key(f"{split_key}/{BLOCK_SEALS}", index, 2), row)

    def put_chunk() -> None:
        storage.write(chunk_key, payload, chunks.crc_trailer(int(crcs[-1])))

    return put_row, put_chunk


def copy_row(storage: Storage, source_key: str, source: int, split_key: str, index: int) -> None:
    """Features chunk ``source``'s row under ``source_key`` (a bag split's segment) as chunk
    ``index``'s of ``split_key``, where a bag commit puts that chunk in place. A segment written
    without block seals has none: ``finish`` computes it from the chunk."""
    try:  # a missing source is an error of the copy itself: no HEAD per chunk on object storage
        storage.copy(layout.chunk_key(f"{source_key}/{BLOCK_SEALS}", source, 2),
                     layout.chunk_key(f"{split_key}/{BLOCK_SEALS}", index, 2))
    except FileNotFoundError:
        pass


def finish(storage: Storage, split_key: str, meta: SplitMetadata) -> dict[str, list[int]]:
    """At commit: every chunk's row present and ending in its chunk's trailer (computed from the
    chunk where a writer left none, or one that is not this chunk's), then the document that
    makes ``block_seals`` an array. Returns the features trailers it read back, for
    ``chunk_seals`` (``{}`` for a split without block seals)."""
    nbytes = block_nbytes(meta)
    if nbytes is None:
        return {}
    features = f"{split_key}/{layout.FEATURES}"
    doc = layout.load_document(storage.read(f"{features}/{layout.ZARR_JSON}"))
    trailers = read_trailers(storage, features, doc, range(meta.num_chunks))
    key = f"{split_key}/{BLOCK_SEALS}"
    rows = block_rows(_sample_nbytes(meta), meta.chunk_rows)
    per_chunk = blocks_per_chunk(meta.chunk_rows, rows)
    present = sorted(c for c in (int(c) for c in storage.listdir(f"{key}/c") if c.isdigit()) if c < meta.num_chunks)
    # None: a chunk directory without its row (a writer killed in between)
    raws = storage.read_present([layout.chunk_key(key, c, 2) for c in present])
    sound = {c for c, raw in zip(present, raws)
             if raw is not None and chunks.check(raw, per_chunk * 4) is None
             and int(np.frombuffer(raw, "<u4", count=per_chunk)[-1]) == trailers[c]}
    payload_bytes = meta.chunk_rows * _sample_nbytes(meta)
    for index in range(meta.num_chunks):
        if index not in sound:  # left by no writer (an older version's chunk), stale, or damaged
            raw = storage.read(layout.chunk_key(features, index, 1 + len(meta.sample_shape)))
            crcs = running_crcs(memoryview(raw)[:payload_bytes], nbytes)
            storage.write_sealed(layout.chunk_key(key, index, 2), memoryview(crcs.astype("<u4")).cast("B"))
    storage.write(f"{key}/{layout.ZARR_JSON}", layout.array_document(
        shape=(meta.num_chunks, per_chunk), chunk_rows=1, data_type="uint32",
        attributes={"featurestore": {"array": layout.FEATURES, "block_rows": rows,
                                     "description": "per features chunk, the running crc32c of its payload at "
                                                    "the end of each block of block_rows rows; see docs/FORMAT.md"}}))
    return {layout.FEATURES: trailers}


def expected_shape(meta: SplitMetadata) -> tuple[int, int, int]:
    """(block rows, blocks per chunk, block bytes) of the split's features chunks."""
    sample = _sample_nbytes(meta)
    rows = block_rows(sample, meta.chunk_rows)
    return rows, blocks_per_chunk(meta.chunk_rows, rows), rows * sample


def block_problems(raw: bytes | memoryview, row: np.ndarray, meta: SplitMetadata, index: int) -> list[str]:
    """Why features chunk ``index`` (``raw``, trailer included) does not match its block seals
    ``row``: one line per damaged block, naming it and its rows in the split."""
    rows, _, nbytes = expected_shape(meta)
    payload = memoryview(raw)[: meta.chunk_rows * _sample_nbytes(meta)]
    out = []
    for j in damaged_blocks(payload, row, nbytes):
        lo, hi = block_span(j, rows, meta.chunk_rows)
        first = index * meta.chunk_rows
        out.append(f"block {j} (rows {first + lo}-{first + hi - 1})")
    return out


class BlockTable:
    """A split's block seals as a reader uses them."""

    def __init__(self, rows: int, table: np.ndarray) -> None:
        self.block_rows = rows
        self.table = table  # [n_chunks, blocks_per_chunk] uint32
        self.per_chunk = table.shape[1]


def load(storage: Storage, split_key: str, *, chunk_rows: int, sample_nbytes: int, num_chunks: int,
         sealed: np.ndarray | None) -> BlockTable | None:
    """The split's block seals, or None where it has none usable: a split written before them, or
    one whose rows are not linked to its ``chunk_seals`` (``sealed``: the features column; None,
    no table) or damaged: then the whole-chunk check, as before."""
    if sealed is None:
        return None
    key = f"{split_key}/{BLOCK_SEALS}"
    try:
        doc = layout.load_document(storage.read(f"{key}/{layout.ZARR_JSON}"))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None
    attrs: dict[str, Any] = doc.get("attributes", {}).get("featurestore", {})
    rows = int(attrs.get("block_rows", 0))
    per_chunk = blocks_per_chunk(chunk_rows, rows) if rows > 0 else 0
    if rows != block_rows(sample_nbytes, chunk_rows) or list(doc.get("shape", [])) != [num_chunks, per_chunk]:
        return None  # another geometry than this reader's: the whole-chunk check
    keys = [layout.chunk_key(key, c, 2) for c in range(num_chunks)]
    # A damaged or missing row costs this reader the block checks, not the data: it checks whole
    # chunks, as for a split without block seals (`featurestore verify` reports the damage).
    try:
        raws = storage.read_many(keys)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    table = np.empty((num_chunks, per_chunk), np.uint32)
    for c, raw in enumerate(raws):
        if chunks.check(raw, per_chunk * 4) is not None:
            return None
        table[c] = np.frombuffer(raw, "<u4", count=per_chunk)
    if len(sealed) < num_chunks or not np.array_equal(table[:, -1].astype(np.int64), sealed[:num_chunks]):
        return None  # not this commit's rows (verify names them): the whole-chunk check
    return BlockTable(rows, table)
