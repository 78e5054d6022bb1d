"""Read-ahead by plan: a loader's epoch order tells the chunk cache what to fetch and what to keep.

For a split read through a local chunk cache (object storage with ``cache_dir``,
:mod:`featurestore.core.storage.chunk_cache`), a :class:`FeatureLoader` knows every batch of the epoch
before it starts. From that plan:

* **keep**: each chunk's last batch in the epoch is handed to the cache, which does not evict a
  chunk the epoch still needs (:meth:`CachedArray.plan`);
* **read ahead**: a thread walks the batches in order and starts the download of each chunk at its
  first use, ahead of the consumer, so a batch finds its chunks local instead of waiting on a
  first touch. It is bounded twice: at most :data:`~featurestore.core.storage.chunk_cache.FETCH_THREADS`
  downloads in flight, and at most half the cache's bytes fetched ahead of the consumer's batch
  (read-ahead never pushes out what the next batches read).

Without a cache (local stores, HTTP, object storage without ``cache_dir``) nothing is started.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featurestore.core.storage.chunk_cache import FETCH_THREADS

_POLL_S = 0.005


class ReadAhead:
    """Keep and read-ahead for the cached arrays of one epoch; :meth:`close` stops it."""

    def __init__(self, fronts: Sequence[Any], batch_chunks: Sequence[np.ndarray], first_position: int,
                 position: Callable[[], int]) -> None:
        """``batch_chunks``: for each batch of the epoch from ``first_position`` on, the chunks it
        reads (:func:`row_chunks`, :func:`bag_chunks`); the fronts share their chunk geometry."""
        self._fronts = list(fronts)
        self._position = position
        self._stop = threading.Event()
        n_chunks = 1 + max((int(c.max()) for c in batch_chunks if len(c)), default=0)
        last_use = np.full(n_chunks, -1, np.int64)
        first_use = np.full(n_chunks, np.iinfo(np.int64).max, np.int64)
        for k, chunks in enumerate(batch_chunks, start=first_position):
            chunks = np.asarray(chunks, np.int64)
            last_use[chunks] = k
            first_use[chunks] = np.minimum(first_use[chunks], k)
        touched = np.flatnonzero(last_use >= 0)
        self._order = touched[np.argsort(first_use[touched], kind="stable")]
        self._first_use = first_use
        for front in self._fronts:
            front.plan(last_use, position)
        self._thread = threading.Thread(target=self._run, name="featurestore-readahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        budget = min(front.cache.max_bytes for front in self._fronts) // 2  # fetched ahead, at most
        chunk_bytes = sum(front.chunk_nbytes for front in self._fronts)
        cache = self._fronts[0].cache
        ahead: list[int] = []  # first uses of the chunks this thread started
        for chunk in self._order.tolist():
            first = int(self._first_use[chunk])
            while not self._stop.is_set():
                position = self._position()
                ahead = [use for use in ahead if use > position]
                if cache.inflight() < FETCH_THREADS and (len(ahead) + 1) * chunk_bytes <= budget:
                    break
                time.sleep(_POLL_S)
            if self._stop.is_set():
                return
            if first < self._position():
                continue  # the consumer is past it: its reads fetched it themselves
            try:
                if sum(len(front.prefetch([chunk])) for front in self._fronts):
                    ahead.append(first)
            except Exception:  # noqa: BLE001 - read-ahead only: the batch's own read reports errors
                return

    def close(self) -> None:
        """Stop starting downloads (those in flight finish) and forget the plan."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5.0)
        for front in self._fronts:
            front.plan(None)


def row_chunks(rows: np.ndarray, chunk_rows: int) -> np.ndarray:
    """The chunks a batch of rows reads."""
    return np.unique(np.asarray(rows, np.int64) // chunk_rows)


def bag_chunks(offsets: np.ndarray, bags: np.ndarray, chunk_rows: int) -> np.ndarray:
    """The chunks a batch of bags (positions; bag ``i`` is rows ``offsets[i]:offsets[i + 1]``)
    reads, whole bags (a ``max_patches`` draw reads a subset of their rows, almost always in the
    same chunks)."""
    bags = np.asarray(bags, np.int64)
    starts, stops = offsets[bags], offsets[bags + 1]
    full = stops > starts
    first, last = starts[full] // chunk_rows, (stops[full] - 1) // chunk_rows
    if not len(first):
        return np.empty(0, np.int64)
    return np.unique(np.concatenate([np.arange(a, b + 1) for a, b in zip(first.tolist(), last.tolist())]))


def cached_fronts(ds: Any) -> list[Any]:
    """The chunk-cache fronts of a dataset's arrays (features and labels of a dense split,
    features and coords of a bag split), [] if it reads no cache."""
    if getattr(ds, "read_path", None) != "cached":
        return []
    if hasattr(ds, "array"):
        arrays = [ds.array, ds.array.labels]
    else:
        arrays = [ds.bags.features, ds.bags.coords]
    fronts = [a.chunk_cache for a in arrays if a is not None]
    return [f for f in fronts if f is not None]
