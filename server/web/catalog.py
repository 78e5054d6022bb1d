"""What the page lists: one :class:`SplitRow` per split of the store, read from the split's
metadata document and cached by that document's exact bytes.

A page of 100 splits re-reads 100 small documents (page-cached locally, one GET each on object
storage) and parses only those that changed: a split's document holds its per-channel mean and
std, ~100 KiB of JSON at 3072 channels, and parsing all of them on every view would cost more than
the rest of the page. A split whose document is damaged gets a row that says so; the rest of the
page still renders.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Any

from featurestore.errors import FeatureStoreError
from featurestore.format import layout
from featurestore.format.metadata import BAGS, DENSE
from featurestore.format.sizes import SplitSize, split_size

__all__ = ["BAGS", "DENSE", "Catalog", "SplitRow", "row_from_document"]


@dataclass(frozen=True)
class SplitRow:
    dataset: str
    encoder: str
    split: str
    kind: str = DENSE
    status: str = "damaged"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    size: SplitSize = SplitSize(None, None)  # bytes of data and on storage
    generation: str | None = None
    cache_key: str | None = None
    encoder_spec: Any = None
    weights_hash: Any = None
    preprocessing: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # A derived split (``featurestore embed``): why it no longer describes its source, or None.
    stale: str | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.dataset, self.encoder, self.split)

    @property
    def path(self) -> str:
        return "/".join(self.key)


def row_from_document(dataset: str, encoder: str, split: str, doc: dict[str, Any]) -> SplitRow:
    """The row of a split (dense or bags) from its parsed ``zarr.json``."""
    from featurestore.core.store import check_split

    meta = check_split(doc, layout.split_key(dataset, encoder, split))
    enc = meta.encoder if isinstance(meta.encoder, dict) else {}
    if meta.is_bags:  # (bags, patches over all bags, dim)
        kind, shape = BAGS, (int((meta.bags or {}).get("count") or 0), meta.num_samples, *meta.sample_shape)
    else:
        kind, shape = DENSE, (meta.num_samples, *meta.sample_shape)
    # The row is cached for every split of the store: it keeps the metadata without the per-channel
    # mean and std (two lists of `dim` floats, the bulk of the document); a split's page reads them.
    light = {k: v for k, v in meta.to_json().items() if k != "channel_stats"}
    return SplitRow(
        dataset, encoder, split, kind=kind, status=meta.status, shape=shape, dtype=meta.logical_dtype,
        size=split_size(meta), generation=meta.generation, cache_key=meta.cache_key,
        encoder_spec=enc.get("spec"), weights_hash=enc.get("weights_hash"),
        preprocessing=meta.preprocessing, metadata=light,
    )  # fmt: skip


class Catalog:
    """Rows of every split of one store, each re-parsed only when its document changed (a row
    holds no per-channel statistics: :meth:`channel_stats` reads them for one split's page)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._rows: dict[tuple[str, str, str], tuple[bytes, SplitRow]] = {}
        self._lock = threading.Lock()

    def keys(self) -> list[tuple[str, str, str]]:
        from featurestore.core.verify import iter_splits

        return list(iter_splits(self.store))

    def rows(self) -> list[SplitRow]:
        keys = self.keys()
        rows = [self.row(*key) for key in keys]
        with self._lock:  # forget splits that are gone
            for gone in set(self._rows) - set(keys):
                del self._rows[gone]
        return rows

    def row(self, dataset: str, encoder: str, split: str) -> SplitRow:
        """The split's row, from its current document (raises SplitNotFound for a missing one)."""
        key = (dataset, encoder, split)
        try:
            raw = self.store.storage.read(f"{layout.split_key(*key)}/{layout.ZARR_JSON}")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.store.split_info(*key)  # the precise not-found error
            raise
        with self._lock:
            cached = self._rows.get(key)
        if cached is not None and cached[0] == raw:
            return self._with_staleness(cached[1])
        try:
            row = row_from_document(*key, layout.load_document(raw))
        except (FeatureStoreError, ValueError, TypeError, AttributeError) as error:
            row = SplitRow(*key, error=f"{type(error).__name__}: {error}")
        with self._lock:
            self._rows[key] = (raw, row)
        return self._with_staleness(row)

    def _with_staleness(self, row: SplitRow) -> SplitRow:
        """The row with its staleness checked now: it depends on the source split's document, not
        on this one's, so it is never cached with the row."""
        from featurestore.core.lineage import stale_reason
        from featurestore.format import lineage

        if row.error or lineage.KEY not in row.metadata:
            return row
        return replace(row, stale=stale_reason(self.store, row.metadata))

    def channel_stats(self, dataset: str, encoder: str, split: str) -> Any:
        """The split's ``channel_stats`` (per-channel mean and std), read now."""
        return self.store.split_info(dataset, encoder, split).channel_stats
