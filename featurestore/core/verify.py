"""Check the chunks of complete splits: presence, size and crc32c (``featurestore verify``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from featurestore.core.store import FeatureStore, chunk_arrays
from featurestore.format import chunks, layout


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
    meta = store.split_info(dataset, encoder, split)
    key = layout.split_key(dataset, encoder, split)
    result = SplitCheck(key=key, status=meta.status)
    if not meta.complete:
        return result
    for name, ndim, nbytes in chunk_arrays(meta):
        count = meta.num_chunks
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
