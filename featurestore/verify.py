"""Check the chunks of complete splits: presence, size and crc32c (``featurestore verify``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import chunks, dtypes, layout
from .stats import row_length
from .store import FeatureStore


@dataclass
class SplitCheck:
    key: str
    status: str
    chunks_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        # Only complete splits can be damaged; an incomplete one is listed, not counted.
        return self.status == "complete" and bool(self.problems)


def iter_splits(store: FeatureStore, dataset: str | None = None, encoder: str | None = None,
                split: str | None = None) -> Iterator[tuple[str, str, str]]:
    for ds in [dataset] if dataset else store.datasets():
        for enc in [encoder] if encoder else store.encoders(ds):
            for sp in [split] if split else store.splits(ds, enc):
                yield ds, enc, sp


def verify_split(store: FeatureStore, dataset: str, encoder: str, split: str) -> SplitCheck:
    meta = store.split_metadata(dataset, encoder, split)
    key = layout.split_key(dataset, encoder, split)
    result = SplitCheck(key=key, status=str(meta.get("status")))
    if result.status != "complete":
        return result
    for name, ndim, nbytes in _arrays(meta):
        count = layout.num_chunks(meta["num_samples"], meta["chunk_rows"])
        for index in range(count):
            chunk = layout.chunk_key(f"{key}/{name}", index, ndim)
            try:
                raw = store.storage.read(chunk)
            except FileNotFoundError:
                result.problems.append(f"{chunk}: missing")
                continue
            problem = chunks.check(raw, nbytes)
            result.chunks_checked += 1
            if problem:
                result.problems.append(f"{chunk}: {problem}")
    return result


def _arrays(meta: dict[str, Any]) -> list[tuple[str, int, int | None]]:
    rows, shape = meta["chunk_rows"], meta["sample_shape"]
    itemsize = dtypes.storage_dtype(meta["logical_dtype"]).itemsize
    arrays: list[tuple[str, int, int | None]] = [
        (layout.FEATURES, 1 + len(shape), None if meta.get("compressor") else rows * int(np.prod(shape)) * itemsize),
    ]
    if meta.get("labels"):
        label_shape = meta["labels"]["shape"]
        nbytes = rows * int(np.prod(label_shape, dtype=np.int64)) * np.dtype(meta["labels"]["dtype"]).itemsize
        arrays.append((layout.LABELS, 1 + len(label_shape), nbytes))
    arrays.append((layout.CHUNK_STATS, 2, 8 * row_length(shape[-1])))
    return arrays
