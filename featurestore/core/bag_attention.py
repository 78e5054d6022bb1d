"""Attention maps saved beside a bag split: listed, opened, checked against the split, read per bag.

The layout and the lineage are featurestore.format.attention (docs/FORMAT.md, "Attention maps");
the probe that writes them is featurestore.probes.attention. A map is read through the checked
reader (``FeatureArray``: each chunk's crc32c verified), one bag's rows at a time. A stale map
(its split overwritten or re-committed since) opens, says why in ``stale``, and refuses
:meth:`AttentionMap.bag` with :class:`~featurestore.errors.StaleAttention`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from featurestore.core.reader import FeatureArray
from featurestore.core.storage import Storage
from featurestore.errors import AttentionNotFound, CorruptChunk, StaleAttention
from featurestore.format import attention, layout
from featurestore.format.names import validate_name

__all__ = ["AttentionMap", "attention_names", "open_attention"]


def attention_names(storage: Storage, split_key: str) -> list[str]:
    """The names of the maps saved under a bag split (those whose document is written: a save cut
    short has none), sorted."""
    names = []
    for name in storage.listdir(attention.group_key(split_key)):
        try:
            validate_name(name, "attention map")
        except Exception:  # the group's own zarr.json, temporary files
            continue
        if storage.exists(f"{attention.group_key(split_key, name)}/{layout.ZARR_JSON}"):
            names.append(name)
    return sorted(names)


def open_attention(storage: Storage, split_key: str, name: str, split_metadata: dict[str, Any]) -> AttentionMap:
    """Map ``name`` of the bag split at ``split_key`` whose current metadata is ``split_metadata``."""
    key = attention.group_key(split_key, validate_name(name, "attention map"))
    try:
        raw = storage.read(f"{key}/{layout.ZARR_JSON}")
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        known = attention_names(storage, split_key)
        raise AttentionNotFound(f"bag split {split_key} has no attention map {name!r} (it has: "
                                f"{', '.join(known) or 'none'}): save one with featurestore probe --head abmil "
                                f"--save-attention {name}") from None
    try:
        doc = (json.loads(raw).get("attributes") or {}).get("featurestore")
    except (ValueError, AttributeError):
        doc = None
    return AttentionMap(storage, split_key, name, attention.check_lineage(doc, key), split_metadata)


class AttentionMap:
    """One saved map: ``name``, ``lineage`` (the stored document), ``stale`` (why it no longer
    fits the split, or None), ``fold`` ([bags] int32), :meth:`bag`."""

    def __init__(self, storage: Storage, split_key: str, name: str, lineage: dict[str, Any],
                 split_metadata: dict[str, Any]) -> None:
        self.name = name
        self.key = attention.group_key(split_key, name)
        self.lineage = lineage
        self.stale: str | None = attention.stale_reason(lineage, split_metadata)
        self._storage = storage
        self._values: FeatureArray | None = None
        self._fold: np.ndarray | None = None

    def _array(self, name: str, logical: str) -> FeatureArray:
        try:
            doc = layout.load_document(self._storage.read(f"{self.key}/{name}/{layout.ZARR_JSON}"))
        except (FileNotFoundError, ValueError) as error:
            raise CorruptChunk(f"attention map {self.key} has no readable {name} array ({type(error).__name__}): "
                               f"save it again ({attention.advice(self.name)})") from None
        return FeatureArray(self._storage, self.key, name, doc, logical_dtype=logical, metadata={})

    def check_current(self) -> None:
        """Raise StaleAttention when the map no longer fits its split."""
        if self.stale is not None:
            raise StaleAttention(f"attention map {self.key} is stale: {self.stale}; {attention.advice(self.name)}")

    @property
    def fold(self) -> np.ndarray:
        """The fold that evaluated each bag (``attention.NOT_EVALUATED``: none)."""
        self.check_current()
        if self._fold is None:
            array = self._array(attention.FOLD, "int32")
            self._fold = array.read_numpy(np.arange(len(array), dtype=np.int64)).copy()
        return self._fold

    def bag(self, i: int, offsets: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray | None:
        """float32 attention of bag ``i`` (its rows ``offsets[i]:offsets[i+1]``, or the ``rows``
        subset of them); None when the run did not evaluate that bag."""
        self.check_current()
        if int(self.fold[i]) == attention.NOT_EVALUATED:
            return None
        if self._values is None:
            self._values = self._array(attention.VALUES, "float32")
        start, stop = int(offsets[i]), int(offsets[i + 1])
        index = np.arange(start, stop, dtype=np.int64) if rows is None else start + np.asarray(rows, np.int64)
        return self._values.read_numpy(index).copy()
