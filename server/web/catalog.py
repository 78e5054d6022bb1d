"""What the page lists: one :class:`SplitRow` per split of the store, read from the split's
metadata document and cached by that document's exact bytes.

A page of 100 splits re-reads 100 small documents (page-cached locally, one GET each on object
storage) and parses only those that changed: a split's document holds its per-channel mean and
std, ~100 KiB of JSON at 3072 channels, and parsing all of them on every view would cost more than
the rest of the page. A split whose document is damaged gets a row that says so; the rest of the
page still renders.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

from featurestore.errors import FeatureStoreError
from featurestore.format import layout
from featurestore.format.metadata import SplitMetadata, chunk_arrays

DENSE, BAGS = "dense", "bags"


@dataclass(frozen=True)
class SplitRow:
    dataset: str
    encoder: str
    split: str
    kind: str = DENSE
    status: str = "damaged"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    size_bytes: int | None = None
    size_note: str = ""
    generation: str | None = None
    cache_key: str | None = None
    encoder_spec: Any = None
    weights_hash: Any = None
    preprocessing: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.dataset, self.encoder, self.split)

    @property
    def path(self) -> str:
        return "/".join(self.key)


def storage_bytes(meta: SplitMetadata) -> tuple[int | None, str]:
    """Bytes of the split's chunk files (features, labels, statistics rows), from its geometry:
    exact for uncompressed splits (every chunk is full size plus its crc32c, the last one padded);
    for compressed ones the uncompressed size, said so in the note."""
    chunks = meta.num_chunks
    total, note = 0, ""
    for name, _, nbytes in chunk_arrays(meta):
        if nbytes is None:  # compressed features: their uncompressed size
            nbytes = meta.chunk_rows * math.prod(meta.sample_shape) * _itemsize(meta.logical_dtype)
            note = f"uncompressed; stored with {meta.compressor}"
        total += chunks * (nbytes + layout.CRC_BYTES)
    return total, note


def _itemsize(logical: str) -> int:
    from featurestore.format import dtypes

    return int(dtypes.storage_dtype(logical).itemsize)


def dense_row(dataset: str, encoder: str, split: str, doc: dict[str, Any]) -> SplitRow:
    from featurestore.core.store import check_split

    meta = check_split(doc, layout.split_key(dataset, encoder, split))
    size, note = storage_bytes(meta)
    enc = meta.encoder if isinstance(meta.encoder, dict) else {}
    return SplitRow(
        dataset, encoder, split, kind=DENSE, status=meta.status,
        shape=(meta.num_samples, *meta.sample_shape), dtype=meta.logical_dtype,
        size_bytes=size, size_note=note, generation=meta.generation, cache_key=meta.cache_key,
        encoder_spec=enc.get("spec"), weights_hash=enc.get("weights_hash"),
        preprocessing=meta.preprocessing, metadata=meta.to_json(),
    )  # fmt: skip


def bag_row(store: Any, dataset: str, encoder: str, split: str, doc: dict[str, Any]) -> SplitRow:
    """A bag split (``store.open_bags``, branch ``bags``): shape ``(bags, patches, dim)``."""
    meta = (doc.get("attributes") or {}).get("featurestore") or {}
    enc = meta.get("encoder") if isinstance(meta.get("encoder"), dict) else {}
    shape: tuple[int, ...] = ()
    size = None
    status = str(meta.get("status", "complete"))
    try:
        bags = store.open_bags(dataset, encoder, split)
        lengths = [int(n) for n in bags.lengths]
        dim = int(getattr(bags, "dim", 0) or (meta.get("dim") or 0))
        shape = (len(lengths), sum(lengths), dim)
        size = getattr(bags, "nbytes", None)
        meta = dict(getattr(bags, "metadata", None) or meta)
    except FeatureStoreError as error:
        return SplitRow(dataset, encoder, split, kind=BAGS, status=status, metadata=meta, error=str(error))
    return SplitRow(
        dataset, encoder, split, kind=BAGS, status=status, shape=shape,
        dtype=str(meta.get("logical_dtype", "")), size_bytes=size,
        generation=meta.get("generation"), cache_key=meta.get("cache_key"),
        encoder_spec=enc.get("spec"), weights_hash=enc.get("weights_hash"),
        preprocessing=meta.get("preprocessing"), metadata=meta,
    )  # fmt: skip


def split_kind(store: Any, dataset: str, encoder: str, split: str) -> str:
    """``dense`` or ``bags``: ``store.split_kind`` where the store has bag splits (branch
    ``bags``), else every split is dense."""
    kind = getattr(store, "split_kind", None)
    return str(kind(dataset, encoder, split)) if kind is not None else DENSE


class Catalog:
    """Rows of every split of one store, each re-parsed only when its document changed."""

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
            return cached[1]
        try:
            doc = layout.load_document(raw)
            if split_kind(self.store, *key) == BAGS:
                row = bag_row(self.store, *key, doc)
            else:
                row = dense_row(*key, doc)
        except (FeatureStoreError, ValueError, TypeError, AttributeError) as error:
            row = SplitRow(*key, error=f"{type(error).__name__}: {error}")
        with self._lock:
            self._rows[key] = (raw, row)
        return row
