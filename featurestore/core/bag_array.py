"""BagArray: the read side of a bag split (``store.open_bags``), over the dense reader's paths.

The index (``offsets``, ``bag_ids``, ``labels``) is read once when the split is opened (a few
small arrays: no scan of the rows). One bag is rows ``offsets[i]:offsets[i + 1]`` of ``features``
and ``coords``, read by :class:`featurestore.core.reader.FeatureArray` like any dense rows: memory
map or concurrent preads locally, one ranged read per chunk the bag spans on object storage, each
chunk's crc32c checked on its first read per process (featurestore.core.checked). Every read
is of the generation the split was opened as, or ``SplitChanged`` (featurestore.core.generation):
the offsets read at open never meet another generation's rows. Through the chunk cache, a cached
file is also checked against ``chunk_seals`` (:class:`featurestore.core.seals.SealTable`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from featurestore.core import quantize_int8
from featurestore.core.bag_commit import read_strings
from featurestore.core.buffers import BufferPool
from featurestore.core.reader import FeatureArray
from featurestore.core.seals import SealTable
from featurestore.core.storage import Storage
from featurestore.errors import CorruptChunk, ShapeMismatch
from featurestore.format import bags, dtypes, layout
from featurestore.format.metadata import SplitMetadata


# A bag read's features land in memory recycled from bags the caller has dropped: a fresh map per
# bag costs its page faults (a warm pass over a 1536-wide cohort read 3.5-3.9 GB/s into fresh
# arrays, 4.3-5.2 with this pool, 4.8-5.3 into one reused array). At most two idle buffers and
# 128 MiB stay in the process; a kept bag's memory is never handed out again.
def _outputs() -> BufferPool:
    return BufferPool(keep=2, max_free_bytes=128 << 20, min_pooled=1 << 20, grow=True)


_OUTPUTS = _outputs()


def _after_fork_in_child() -> None:
    # A forked reader (a DataLoader worker) gets its own: a parent's thread may have held the
    # pool's lock at the fork, and its idle buffers are the parent's pages.
    global _OUTPUTS
    _OUTPUTS = _outputs()


os.register_at_fork(after_in_child=_after_fork_in_child)


class BagArray(bags.BagLookup):
    """The bags of one split: ``len``, ``ids``, ``lengths``, ``labels``, ``read(i_or_id)``."""

    def __init__(self, storage: Storage, key: str, meta: SplitMetadata,
                 documents: dict[str, dict[str, Any]]) -> None:
        self._storage = storage
        self.key = key
        self.metadata: dict[str, Any] = meta.to_json()
        self.dim: int = int(meta.sample_shape[0])
        self.dtype: str = meta.logical_dtype
        spec = meta.bags or {}
        self.coords_unit: str | None = spec["coords"]["unit"]
        self.coords_dtype: str = spec["coords"]["dtype"]
        self.patch_size_level0: Any = spec.get("patch_size_level0")
        self.features = FeatureArray(storage, key, layout.FEATURES, documents[layout.FEATURES],
                                     logical_dtype=self.dtype, metadata=self.metadata)
        self.coords = FeatureArray(storage, key, bags.COORDS, documents[bags.COORDS],
                                   logical_dtype=self.coords_dtype, metadata=self.metadata)
        seals = SealTable(storage, key, meta)
        self.features.seals, self.coords.seals = (seals, layout.FEATURES), (seals, bags.COORDS)
        offsets = _whole(storage, key, bags.OFFSETS, documents[bags.OFFSETS], "int64", self.metadata, seals)
        self.offsets: np.ndarray = offsets
        self.lengths: np.ndarray = np.diff(offsets).astype(np.int64)
        self.ids: list[str] = _strings(storage, key, bags.BAG_IDS)
        labels_doc = documents.get(layout.LABELS)
        self.labels: np.ndarray | None = None
        if labels_doc is not None:
            self.labels = _whole(storage, key, layout.LABELS, labels_doc, labels_doc["data_type"], self.metadata, seals)
        _check_index(key, int(spec.get("count", 0)), offsets, len(self.features), len(self.ids), self.labels)
        self._attrs: list[str] | None = None
        self._positions: dict[str, int] | None = None
        self.scales: np.ndarray | None = None  # int8: float32 [num_bags, dim], bag i's row per channel
        if dtypes.is_int8(self.dtype):
            self.scales = _whole(storage, key, layout.SCALES, documents[layout.SCALES], "float32", self.metadata, seals)

    # ------------------------------------------------------------------ index
    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"BagArray({self.key!r}, bags={len(self)}, rows={int(self.offsets[-1])}, dim={self.dim}, dtype={self.dtype!r})"

    @property
    def num_rows(self) -> int:
        """Patches over all bags."""
        return int(self.offsets[-1])

    def _where(self) -> str:
        return self.key

    def attrs(self, i_or_id: int | str) -> dict[str, Any]:
        """The bag's attributes (slide attributes kept by import, or ``add_bag(attrs=)``)."""
        i = self.position(i_or_id)
        if self._attrs is None:
            since = time.monotonic()
            attrs = _strings(self._storage, self.key, bags.BAG_ATTRS)
            self.features._generation().after(since)  # the opened generation's, not a later one's
            self._attrs = attrs
            if len(self._attrs) != len(self):
                raise CorruptChunk(f"{self.key}/{bags.BAG_ATTRS} has {len(self._attrs)} entries for {len(self)} bags: "
                                   "the store is damaged; run `featurestore verify`, then re-import the split")
        return json.loads(self._attrs[i])

    def label(self, i_or_id: int | str) -> Any:
        return None if self.labels is None else self.labels[self.position(i_or_id)].item()

    # ------------------------------------------------------------------ reads
    def rows_of(self, i_or_id: int | str, rows: Any = None) -> np.ndarray:
        """Row positions in ``features``/``coords`` of the bag (or of its ``rows``, by the one
        rule of :func:`featurestore.format.bags.select_rows`)."""
        i = self.position(i_or_id)
        start, stop = int(self.offsets[i]), int(self.offsets[i + 1])
        selection = bags.select_rows(rows, stop - start, self.ids[i])
        if isinstance(selection, slice):
            return np.arange(start + selection.start, start + selection.stop, dtype=np.int64)
        return start + selection

    def read_numpy(self, i_or_id: int | str, rows: Any = None, out: np.ndarray | None = None,
                   dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(features [n, dim], coords [n, 2])`` of one bag in the storage dtypes (bfloat16 as its
        uint16 bits, int8 codes: values are ``codes * self.scales[i]``), or features as ``dtype``
        ("float32"/"float16", an int8 bag dequantized into ``out``); ``rows``: which patches
        (:func:`~featurestore.format.bags.select_rows`: None, a slice, or positions within the bag);
        ``out``: a C-contiguous ``[n, dim]`` buffer for the features (pinned memory)."""
        if quantize_int8.check_read_dtype(dtype, self.dtype) is not None:
            return self._read_as(i_or_id, rows, out, str(dtype))
        index = self.rows_of(i_or_id, rows)
        if out is not None:
            bags.check_out(out, len(index), self.dim, self.features.numpy_dtype)
        else:
            out = _OUTPUTS.array((len(index), self.dim), self.features.numpy_dtype)
        with self.features._generation().deferred():  # features and coords: one check
            features = self.features.read_numpy(index, out=out)
            return features, self.coords.read_numpy(index)

    def _read_as(self, i_or_id: int | str, rows: Any, out: np.ndarray | None, want: str) -> tuple[np.ndarray, np.ndarray]:
        count = len(self.rows_of(i_or_id, rows))
        if out is None:
            out = np.empty((count, self.dim), want)
        elif out.shape != (count, self.dim) or out.dtype != np.dtype(want) or not out.flags.c_contiguous:
            raise ShapeMismatch(f"out has shape {out.shape} and dtype {out.dtype}; this bag read needs a "
                                f"C-contiguous ({count}, {self.dim}) array of {want}")
        stored, coords = self.read_numpy(i_or_id, rows)
        if self.scales is not None:
            np.multiply(stored, self.scales[self.position(i_or_id)], out=out, casting="same_kind")
        else:
            out[...] = dtypes.stored_as_float32(stored, self.dtype)
        return out, coords

    def read(self, i_or_id: int | str, rows: Any = None) -> tuple[Any, Any]:
        """``(features, coords)`` as torch tensors: features in the stored dtype (torch.bfloat16
        for bfloat16; float32 values for int8), coords in the split's coords dtype."""
        if self.scales is not None:
            features, coords = self.read_numpy(i_or_id, rows, dtype="float32")
            return dtypes.to_torch(features, "float32"), dtypes.to_torch(coords, self.coords_dtype)
        features, coords = self.read_numpy(i_or_id, rows)
        return dtypes.to_torch(features, self.dtype), dtypes.to_torch(coords, self.coords_dtype)


def _strings(storage: Storage, key: str, name: str) -> list[str]:
    """A string index array read whole (zarr checks its crc32c); a missing or damaged one is
    CorruptChunk naming it, not zarr's own error."""
    try:
        return read_strings(storage, f"{key}/{name}")
    except Exception as error:  # zarr raises its own types (ArrayNotFoundError, checksum ValueError)
        raise CorruptChunk(f"{key}/{name} is missing or damaged ({type(error).__name__}: {error}): run "
                           "`featurestore verify` on the store, then re-import the split (--overwrite)") from None


def _check_index(key: str, count: int, offsets: np.ndarray, rows: int, ids: int, labels: np.ndarray | None) -> None:
    """The index arrays agree with each other and with the rows (one vectorised pass): a damaged
    one read as data would send a bag's reads to another bag's rows, or past the end."""
    problem = None
    if len(offsets) != count + 1 or ids != count or (labels is not None and len(labels) != count):
        problem = (f"{count} bags in the metadata, but {len(offsets)} offsets, {ids} ids"
                   + ("" if labels is None else f", {len(labels)} labels"))
    elif offsets[0] != 0 or offsets[-1] != rows:
        problem = f"offsets run from {int(offsets[0])} to {int(offsets[-1])}, the features hold {rows} rows"
    elif count and bool((np.diff(offsets) < 0).any()):
        problem = f"offsets decrease at bag {int(np.argmax(np.diff(offsets) < 0))}"
    if problem:
        raise CorruptChunk(f"the index of bag split {key} is damaged ({problem}): run `featurestore verify` on "
                           "the store, then re-import the split (--overwrite)")


def _whole(storage: Storage, key: str, name: str, doc: dict[str, Any], logical: str,
           metadata: dict[str, Any], seals: SealTable) -> np.ndarray:
    """A small index array read whole, through the checked reader (a cached file of it checked
    against ``seals`` too)."""
    array = FeatureArray(storage, key, name, doc, logical_dtype=logical, metadata=metadata)
    array.seals = (seals, name)
    return array.read_numpy(np.arange(len(array), dtype=np.int64)).copy()


BagSplit = BagArray  # the name before the reader family was named as one (deprecated)
