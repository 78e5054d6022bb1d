"""What one server worker holds: the opened store and a small cache of opened split arrays."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

from featurestore.format.names import validate_name
from server.buffers import BufferPool
from server.settings import Settings


class StoreState:
    """The store opened read-only, plus an LRU of ``store.open(...)`` results.

    Opening a split reads its Zarr metadata (a round trip on object storage); data routes hit the
    same few splits over and over, so opened arrays are cached per (dataset, encoder, split).
    Only complete splits are cached (``store.open`` refuses the others), so a split that is
    still being written is re-checked on every request until it completes.
    """

    def __init__(self, settings: Settings) -> None:
        import fsspec

        import featurestore

        if not settings.store:
            raise ValueError(
                "no store to serve: pass create_app(store_url=...) or set FEATURESTORE_STORE"
            )
        self.settings = settings
        self.store = featurestore.open_store(settings.store, mode="r", **settings.storage_options)
        # The raw key space (/zarr) reads through fsspec directly; same URL, same options.
        self.fs, self.root = fsspec.core.url_to_fs(settings.store, **settings.storage_options)
        self.root = self.root.rstrip("/")
        # Where a local root really is (symlinks resolved): /zarr reads must stay below it.
        self.real_root = os.path.realpath(self.root)
        self.buffers = BufferPool(max_free_bytes=settings.max_response_bytes)
        self._arrays: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, dataset: str, encoder: str, split: str) -> Any:
        key = (
            validate_name(dataset, "dataset"),
            validate_name(encoder, "encoder"),
            validate_name(split, "split"),
        )
        with self._lock:
            arr = self._arrays.get(key)
            if arr is not None:
                self._arrays.move_to_end(key)
                return arr
        # Opened outside the lock: a slow object store must not serialize every other request.
        # Two threads may open the same split at once; the second result simply wins.
        arr = self.store.open(*key)
        with self._lock:
            self._arrays[key] = arr
            self._arrays.move_to_end(key)
            while len(self._arrays) > self.settings.array_cache_size:
                self._arrays.popitem(last=False)
        return arr
