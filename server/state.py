"""What one server worker holds: the opened store, a cache of opened splits that notices when a
split changes on storage, the response buffer pool, and the budget of response bytes in flight.

Staleness (issue 12.2): an opened split is kept with the exact bytes of its metadata document
(the split group's ``zarr.json``, which a writer rewrites on create/overwrite/commit and which
holds the split's generation). On a local store the document is re-read on every request (a
page-cached read of a few KiB, ~10-20 us) and once more after the gather: a split that changed in
between (an overwrite started, a re-extraction committed) is answered with 409, so no response
ever mixes two generations. On object storage each re-read is a round trip, so the document is
re-checked at most every ``metadata_ttl_s`` seconds (default 1 s) and only before the gather.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.errors import IncompleteSplit, SplitNotFound
from featurestore.format import layout
from featurestore.format.names import validate_name
from featurestore.core.buffers import BufferPool
from server.errors import Busy
from server.settings import Settings

_HTTP_HINT = (
    "The server serves complete splits only: wait for the extraction to finish (or resume it with "
    "'featurestore extract ... --resume') and retry; to read the rows written so far, open the "
    "store itself (not the server) with allow_incomplete=True."
)


@dataclass
class OpenedSplit:
    """One cache entry: the opened array and the metadata bytes it was opened from."""

    key: tuple[str, str, str]
    array: Any
    document: bytes
    checked: float


class StoreState:
    """The store opened read-only, plus an LRU of opened splits checked for staleness."""

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
        self.local = self.store.storage.local_path(layout.ZARR_JSON) is not None
        # The one lease-based pool (core/buffers.py): a response's buffers return to it when
        # ArrayResponse drops its last view after the last byte was sent, never earlier.
        # Anonymous maps, reused warm: plain np.empty buffers of many sizes fragmented glibc's
        # heap (RSS 43 -> 664 MiB over the 16-client load test), fresh maps per request
        # page-faulted away half the throughput. Small answers use the ordinary allocator.
        self.buffers = BufferPool(keep=16, max_free_bytes=settings.pool_bytes,
                                  min_pooled=1 << 20)  # fmt: skip
        self._splits: OrderedDict[tuple[str, str, str], OpenedSplit] = OrderedDict()
        self._lock = threading.Lock()
        self._inflight = 0
        self._inflight_cv = threading.Condition()

    # ------------------------------------------------------------------ splits
    def _document(self, key: tuple[str, str, str]) -> bytes:
        try:
            return self.store.storage.read(f"{layout.split_key(*key)}/{layout.ZARR_JSON}")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.store.split_metadata(*key)  # raises the precise not-found error
            raise SplitNotFound(f"split {'/'.join(key)} not found") from None

    def open_split(self, dataset: str, encoder: str, split: str) -> OpenedSplit:
        """The split, opened from its current metadata (409 if it is not complete)."""
        key = (
            validate_name(dataset, "dataset"),
            validate_name(encoder, "encoder"),
            validate_name(split, "split"),
        )
        now = time.monotonic()
        with self._lock:
            entry = self._splits.get(key)
            if entry is not None:
                self._splits.move_to_end(key)
        if entry is not None and not self.local and now - entry.checked < self.settings.metadata_ttl_s:
            return entry
        document = self._document(key)
        if entry is not None and entry.document == document:
            entry.checked = now
            return entry
        # New or changed: open afresh (outside the lock: a slow object store must not serialize
        # every other request). store.open re-reads the document; if it changed again meanwhile
        # the post-gather check below catches it.
        try:
            array = self.store.open(*key)
        except IncompleteSplit as error:
            with self._lock:
                self._splits.pop(key, None)
            raise IncompleteSplit(f"{error} {_HTTP_HINT}") from None
        entry = OpenedSplit(key, array, document, now)
        with self._lock:
            self._splits[key] = entry
            self._splits.move_to_end(key)
            while len(self._splits) > self.settings.array_cache_size:
                self._splits.popitem(last=False)
        return entry

    def open(self, dataset: str, encoder: str, split: str) -> Any:
        return self.open_split(dataset, encoder, split).array

    def confirm(self, entry: OpenedSplit) -> None:
        """After a gather: refuse (409) if the split changed while it was read (local stores)."""
        if not self.local:
            return
        try:
            same = self._document(entry.key) == entry.document
        except (SplitNotFound, OSError):
            same = False
        if not same:
            with self._lock:
                if self._splits.get(entry.key) is entry:
                    del self._splits[entry.key]
            raise IncompleteSplit(
                f"split {'/'.join(entry.key)} changed on storage while it was read (it is being "
                f"rewritten or was re-extracted): retry the request. {_HTTP_HINT}"
            )

    # ------------------------------------------------------------------ buffers
    def buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A leased, page-aligned response buffer (back in the pool when its last view dies)."""
        return self.buffers.array(shape, dtype)

    # ------------------------------------------------------------------ bytes in flight
    def reserve(self, nbytes: int) -> None:
        """Count ``nbytes`` of response against ``max_inflight_bytes``; wait up to
        ``inflight_wait_s`` for room, else raise :class:`Busy` (503 with Retry-After).

        One response always fits when nothing else is in flight, so a cap below
        ``max_response_bytes`` cannot lock a request out for good.
        """
        cap = self.settings.max_inflight_bytes
        deadline = time.monotonic() + self.settings.inflight_wait_s
        with self._inflight_cv:
            while self._inflight and self._inflight + nbytes > cap:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Busy(
                        f"the server has {self._inflight} bytes of responses in flight (cap "
                        f"FEATURESTORE_MAX_INFLIGHT_BYTES={cap}); retry in a moment",
                        retry_after=1,
                    )
                self._inflight_cv.wait(left)
            self._inflight += nbytes

    def release(self, nbytes: int) -> None:
        with self._inflight_cv:
            self._inflight -= nbytes
            self._inflight_cv.notify_all()

    @property
    def inflight_bytes(self) -> int:
        return self._inflight
