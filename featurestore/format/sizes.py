"""How big a split is, from its metadata alone (no I/O), in the two senses every view shows:

* **data**: the bytes of its values (features; labels; a bag split's coordinates), as they would
  sit in memory, without padding, checksums or statistics;
* **on storage**: the bytes of its chunk files as docs/FORMAT.md lays them out: every chunk is
  stored whole (an edge chunk padded to full size) with its crc32c, plus the statistics rows and,
  for a bag split, its offsets, labels and chunk seals. A split smaller than one chunk therefore
  takes a whole chunk: a bag split of 2,181 patches of 32 float16 takes 10 MiB in 8 MiB chunks.

``featurestore ls``/``info`` and the web page all take their figures from :func:`split_size`,
so they agree. Strings (sample ids, bag ids and attributes: vlen-utf8, sized by their values) and
the metadata documents are not counted: the storage figure of a split that has them is a floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from featurestore.format import dtypes, layout
from featurestore.format.block_seals import block_rows, blocks_per_chunk
from featurestore.format.metadata import SplitMetadata, chunk_arrays
from featurestore.format.stats import row_length

__all__ = ["INDEX_CHUNK_BYTES", "UNCOUNTED", "SplitSize", "bytes_text", "split_size"]

# The largest chunk of a bag split's small arrays (offsets, labels, bag_stats, chunk_seals):
# core.bag_commit writes them in chunks of min(rows, this // row bytes) rows, the edge one padded.
INDEX_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class SplitSize:
    """``data`` and ``stored`` bytes (None: a bag split before its commit, when its bags are still
    in the writers' segments); ``floor``: ``stored`` leaves strings out; ``notes``: what it leaves
    out, or that compressed features are counted uncompressed."""

    data: int | None
    stored: int | None
    floor: bool = False
    notes: tuple[str, ...] = ()

    def data_text(self) -> str:
        return UNCOUNTED if self.data is None else bytes_text(self.data)

    def stored_text(self, notes: bool = True) -> str:
        """``"at least 10.0 MiB (bag ids and attributes not counted)"``, as ``info`` and the page
        show it (``notes=False``: without the parenthesis)."""
        if self.stored is None:
            return UNCOUNTED
        text = ("at least " if self.floor else "") + bytes_text(self.stored)
        return f"{text} ({'; '.join(self.notes)})" if notes and self.notes else text


UNCOUNTED = "not counted until commit"


def bytes_text(nbytes: float) -> str:
    """``178831`` -> ``"174.6 KiB"`` (binary units, one decimal; bytes as an integer)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def split_size(meta: SplitMetadata) -> SplitSize:
    """The split's :class:`SplitSize` (docs/FORMAT.md geometry; compressed features counted
    uncompressed, said so in its notes)."""
    if meta.is_bags:
        return _bag_size(meta)
    itemsize = dtypes.storage_dtype(meta.logical_dtype).itemsize
    data = meta.num_samples * math.prod(meta.sample_shape) * itemsize
    if meta.labels is not None:
        data += meta.num_samples * math.prod(meta.labels.shape) * np.dtype(meta.labels.dtype).itemsize
    if not meta.complete:  # its chunks are being written: the geometry would count them all
        return _size(meta, data, None, "sample ids not counted" if meta.ids else "")
    stored = 0
    for _, _, nbytes in chunk_arrays(meta):
        if nbytes is None:  # compressed features: their uncompressed size
            nbytes = meta.chunk_rows * math.prod(meta.sample_shape) * itemsize
        stored += meta.num_chunks * (nbytes + layout.CRC_BYTES)
    # chunk_seals: a row per features and labels chunk; block_seals (uncompressed): a row per
    # features chunk (neither before it existed: those splits are counted a few bytes over)
    if meta.complete:
        stored += _index_bytes(meta.num_chunks * (2 if meta.labels is not None else 1), 4 * 8)
        if meta.compressor is None:
            stored += _block_seals_bytes(meta.num_chunks, meta.chunk_rows, math.prod(meta.sample_shape) * itemsize)
    return _size(meta, data, stored, "sample ids not counted" if meta.ids else "")


def _bag_size(meta: SplitMetadata) -> SplitSize:
    spec = meta.bags or {}
    if not meta.complete:  # bags live in writers' segments until the commit lays them out
        return SplitSize(None, None)
    count, rows, dim = int(spec.get("count") or 0), meta.num_samples, int(meta.sample_shape[0])
    feature_row = dim * dtypes.storage_dtype(meta.logical_dtype).itemsize
    coord_row = 2 * np.dtype(str((spec.get("coords") or {}).get("dtype") or "int64")).itemsize
    label_item = np.dtype(str(spec["labels"]["dtype"])).itemsize if spec.get("labels") else 0
    data = rows * (feature_row + coord_row) + count * label_item
    chunks = layout.num_chunks(rows, meta.chunk_rows)
    stored = chunks * (meta.chunk_rows * (feature_row + coord_row) + 2 * layout.CRC_BYTES)
    small = [(count + 1, 8)]  # offsets (int64)
    if label_item:
        small.append((count, label_item))
    stats_width = row_length(dim) + (2 if meta.generation is not None else 0)
    small.append((count, 8 * stats_width))  # bag_stats (float64 rows)
    # chunk_seals: one (array, index, crc, generation) uint64 row per chunk of the sealed arrays
    seals = 2 * chunks + sum(_index_chunks(n, row) for n, row in small[: 2 if label_item else 1])
    small.append((seals, 4 * 8))
    stored += sum(_index_bytes(n, row) for n, row in small)
    # (bag splits committed before block_seals existed have none: counted a few bytes over)
    stored += _block_seals_bytes(chunks, meta.chunk_rows, feature_row)
    return _size(meta, data, stored, "bag ids and attributes not counted")


def _size(meta: SplitMetadata, data: int, stored: int | None, strings: str) -> SplitSize:
    notes = (strings,) if strings else ()
    if meta.compressor:  # the figure is the uncompressed layout: no bound either way
        return SplitSize(data, stored, False, (*notes, f"features counted uncompressed, stored with {meta.compressor}"))
    return SplitSize(data, stored, bool(strings), notes)


def _block_seals_bytes(num_chunks: int, chunk_rows: int, row_bytes: int) -> int:
    """``block_seals``: a uint32 per row block of each features chunk, a row (and its trailer) per chunk."""
    return num_chunks * (4 * blocks_per_chunk(chunk_rows, block_rows(row_bytes, chunk_rows)) + layout.CRC_BYTES)


def _index_chunks(n: int, row_bytes: int) -> int:
    return layout.num_chunks(n, _index_rows(n, row_bytes))


def _index_rows(n: int, row_bytes: int) -> int:
    return max(1, min(max(1, n), INDEX_CHUNK_BYTES // row_bytes))


def _index_bytes(n: int, row_bytes: int) -> int:
    return _index_chunks(n, row_bytes) * (_index_rows(n, row_bytes) * row_bytes + layout.CRC_BYTES)
