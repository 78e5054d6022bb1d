"""What one server worker holds: the opened store, a cache of opened splits that notices when a
split changes on storage, the response buffer pool, and the budget of response bytes in flight.

Staleness: an opened split is kept with the exact bytes of its metadata document
(the split group's ``zarr.json``, which a writer rewrites on create/overwrite/commit and which
holds the split's generation). On a local store the document is checked on every request and
once more after the gather: a split that changed in between (an overwrite started, a
re-extraction committed) is answered with 409, so no response ever mixes two generations. Each
check is an ``os.stat`` of the document: a writer replaces it by rename, never in place, so the
same (device, inode, size, mtime, ctime) is the same document, and its bytes are read again only
when the stat differs (the rule of featurestore.core.generation; reading and comparing the bytes
twice per request was ~60 us of a single item's ~1 ms). On object storage each re-read is a round trip, so the document is
re-checked at most every ``metadata_ttl_s`` seconds (default 1 s) and only before the gather.

The store's readers check the generation themselves (featurestore.core.generation): a read on
object storage caught in an overwrite raises SplitChanged, answered with the same retryable 409.
Every data response names the generation of the opened split (``OpenedSplit.generation``, the
``X-Featurestore-Generation`` header): a client compares it with the one it opened.

Overwrites: a split this worker has served complete and that is now incomplete (an
overwrite is writing it), missing (the overwrite deleted it and has not written it again yet),
or whose chunks vanished or changed under a read (a MissingChunks/CorruptChunk/FileNotFoundError
while its document changed) is answered 409 with ``Retry-After`` ("the split changed while
reading: retry"), never 404 or a 500 "the store is damaged"; clients retry those 409s.
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
from server.on_loop import WouldBlock
from server.settings import Settings

_HTTP_HINT = (
    "The server serves complete splits only: wait for the extraction to finish (or resume it with "
    "'featurestore extract ... --resume') and retry; to read the rows written so far, open the "
    "store itself (not the server) with allow_incomplete=True."
)


# How long a split served here may stay missing from storage and still count as "being rewritten"
# (an overwrite deletes it, then writes its new document at once).
_REWRITE_GRACE_S = 60.0


def _private_paths(*roots: str) -> tuple[str, ...]:
    """The store's absolute paths and URL, longest first (see ``server.errors.relative_to_store``);
    a relative or one-character root is skipped, as replacing it would mangle ordinary words."""
    kept = {r.rstrip("/") for r in roots if r and (r.startswith("/") or "://" in r)}
    return tuple(sorted((r for r in kept if len(r) > 1), key=len, reverse=True))


@dataclass
class OpenedSplit:
    """One cache entry: the opened reader (a FeatureArray or a BagArray) and the metadata bytes
    it was opened from."""

    key: tuple[str, str, str]
    reader: Any
    document: bytes
    checked: float
    # When this worker first saw the split changed under this entry (None: not yet).
    changed: float | None = None
    # "dense" (reader: a FeatureArray) or "bags" (reader: a BagArray).
    kind: str = "dense"
    # A derived split's staleness (featurestore.core.lineage) and when it was last checked.
    stale: str | None = None
    stale_checked: float | None = None

    @property
    def cache_key(self) -> tuple[str, str, str, str]:
        return (*self.key, self.kind)

    @property
    def generation(self) -> str | None:
        """The generation the opened split's bytes are from (each data response says it)."""
        value = self.reader.metadata.get("generation")
        return None if value is None else str(value)


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
        # Error bodies name things relative to the store, never by the server's own paths.
        self.private_paths = _private_paths(self.store.url, self.real_root if self.local else "")
        # The one lease-based pool (core/buffers.py): a response's buffers return to it when
        # ArrayResponse drops its last view after the last byte was sent, never earlier.
        # Anonymous maps, reused warm: plain np.empty buffers of many sizes fragmented glibc's
        # heap (RSS 43 -> 664 MiB over the 16-client load test), fresh maps per request
        # page-faulted away half the throughput. Small answers use the ordinary allocator.
        self.buffers = BufferPool(keep=16, max_free_bytes=settings.pool_bytes,
                                  min_pooled=1 << 20)  # fmt: skip
        self._splits: OrderedDict[tuple[str, str, str, str], OpenedSplit] = OrderedDict()
        # Local stores: each split document's bytes by the stat they were read under.
        self._documents: dict[tuple[str, str, str], tuple[tuple[int, ...], bytes]] = {}
        self._lock = threading.Lock()
        self._inflight = 0
        self.inline_answers = 0  # data requests answered on the event loop (server/on_loop.py)
        self._inflight_cv = threading.Condition()

    # ------------------------------------------------------------------ splits
    def _document(self, key: tuple[str, str, str]) -> bytes:
        doc_key = f"{layout.split_key(*key)}/{layout.ZARR_JSON}"
        try:
            if not self.local:
                return self.store.storage.read(doc_key)
            path = self.store.storage.local_path(doc_key)
            st = os.stat(path)
            signature = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            known = self._documents.get(key)
            if known is not None and known[0] == signature:
                return known[1]
            with open(path, "rb") as f:
                document = f.read()
            if len(document) == st.st_size:  # not a file caught between two stats: keep it
                if len(self._documents) >= 4 * self.settings.array_cache_size:
                    self._documents.clear()  # bounded: split names are the clients' to choose
                self._documents[key] = (signature, document)
            return document
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.store.split_metadata(*key)  # raises the precise not-found error
            raise SplitNotFound(f"split {'/'.join(key)} not found") from None

    def open_split(self, dataset: str, encoder: str, split: str, kind: str = "dense", *,
                   inline: bool = False) -> OpenedSplit:  # fmt: skip
        """The split, opened from its current metadata (409 if it is not complete): as a dense
        split (``store.open``) or, with ``kind="bags"``, as a bag split (``store.open_bags``);
        each refuses a split of the other kind with its own error. ``inline``: raise
        :class:`~server.on_loop.WouldBlock` rather than open it (not opened yet, or changed)."""
        key = (
            validate_name(dataset, "dataset"),
            validate_name(encoder, "encoder"),
            validate_name(split, "split"),
        )
        opener = {"dense": self.store.open, "bags": self.store.open_bags}[kind]
        now = time.monotonic()
        with self._lock:
            entry = self._splits.get((*key, kind))
            if entry is not None:
                self._splits.move_to_end(entry.cache_key)
        if entry is not None and not self.local and now - entry.checked < self.settings.metadata_ttl_s:
            return entry
        if inline and entry is None:
            raise WouldBlock
        try:
            document = self._document(key)
            if entry is not None and entry.document == document:
                entry.checked, entry.changed = now, None
                return entry
            if inline:
                raise WouldBlock
            # New or changed: open afresh (outside the lock: a slow object store must not
            # serialize every other request). store.open re-reads the document; if it changed
            # again meanwhile the post-gather check below catches it.
            array = opener(*key)
        except (IncompleteSplit, SplitNotFound) as error:
            # Incomplete or missing now, complete when this worker last served it: an overwrite
            # is writing it (it deletes the split, then writes the new one), not a split that
            # never was.
            if entry is not None and not self._given_up(entry, error):
                raise self._changed(entry, "is being rewritten on storage") from None
            if isinstance(error, IncompleteSplit):
                raise IncompleteSplit(f"{error} {_HTTP_HINT}") from None
            raise
        entry = OpenedSplit(key, array, document, now, kind=kind)
        with self._lock:
            self._splits[entry.cache_key] = entry
            self._splits.move_to_end(entry.cache_key)
            while len(self._splits) > self.settings.array_cache_size:
                self._splits.popitem(last=False)
        return entry

    def open(self, dataset: str, encoder: str, split: str) -> Any:
        return self.open_split(dataset, encoder, split).reader

    def confirm(self, entry: OpenedSplit) -> None:
        """After a gather: refuse (409) if the split changed while it was read (local stores)."""
        if self.local:
            self.check_unchanged(entry)

    def check_unchanged(self, entry: OpenedSplit) -> None:
        """Raise the retryable 409 if the split's document is no longer the one ``entry`` was
        opened from (re-read now, whatever the TTL): after a read that found chunks missing or
        damaged, this tells an overwrite in progress from a damaged store."""
        try:
            same = self._document(entry.key) == entry.document
        except (SplitNotFound, OSError):
            same = False
        if not same:
            raise self._changed(entry, "changed on storage while it was read (it is being "
                                "rewritten or was re-extracted)")  # fmt: skip

    def _changed(self, entry: OpenedSplit, what: str) -> IncompleteSplit:
        """The 409 for a split that changed under ``entry``; the entry stays cached (stale, so
        every request re-reads the document) to remember that the split was complete here."""
        if entry.changed is None:
            entry.changed = time.monotonic()
        error = IncompleteSplit(f"split {'/'.join(entry.key)} {what}: retry the request. {_HTTP_HINT}")
        error.retry_after = 1  # type: ignore[attr-defined]  # server/errors.py: Retry-After
        return error

    def _given_up(self, entry: OpenedSplit, error: Exception) -> bool:
        """A split missing for longer than a rewrite takes was deleted: forget it (404 again)."""
        if not isinstance(error, SplitNotFound) or entry.changed is None:
            return False
        if time.monotonic() - entry.changed < _REWRITE_GRACE_S:
            return False
        with self._lock:
            if self._splits.get(entry.cache_key) is entry:
                del self._splits[entry.cache_key]
        return True

    def stale_reason(self, entry: OpenedSplit) -> str | None:
        """Why the derived split of ``entry`` no longer describes its source (the data routes'
        ``X-Featurestore-Stale`` header), or None. Its source's document is re-read on every
        request locally and at most every ``metadata_ttl_s`` seconds on object storage."""
        from featurestore.core.lineage import stale_reason
        from featurestore.format import lineage

        metadata = entry.reader.metadata
        if lineage.KEY not in metadata:
            return None
        now = time.monotonic()
        if self.local or entry.stale_checked is None or now - entry.stale_checked >= self.settings.metadata_ttl_s:
            entry.stale, entry.stale_checked = stale_reason(self.store, metadata), now
        return entry.stale

    # ------------------------------------------------------------------ buffers
    def buffer(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A leased, page-aligned response buffer (back in the pool when its last view dies)."""
        return self.buffers.array(shape, dtype)

    # ------------------------------------------------------------------ bytes in flight
    def reserve(self, nbytes: int, *, inline: bool = False) -> None:
        """Count ``nbytes`` of response against ``max_inflight_bytes``; wait up to
        ``inflight_wait_s`` for room, else raise :class:`Busy` (503 with Retry-After).
        ``inline``: raise :class:`~server.on_loop.WouldBlock` rather than wait.

        One response always fits when nothing else is in flight, so a cap below
        ``max_response_bytes`` cannot lock a request out for good.
        """
        cap = self.settings.max_inflight_bytes
        deadline = time.monotonic() + self.settings.inflight_wait_s
        with self._inflight_cv:
            while self._inflight and self._inflight + nbytes > cap:
                if inline:
                    raise WouldBlock
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
