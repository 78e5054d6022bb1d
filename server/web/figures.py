"""The pictures of a split, computed with bounded work and cached.

Bounds, per request: one sample (dense) or one bag is read, at most ``ui_max_sample_bytes`` of it
(else 413 naming the setting); the principal axes are fitted on at most ``pictures.FIT_ROWS``
rows; pictures are at most ``max_side`` pixels a side; at most ``ui_pictures_at_once`` pictures
are computed at a time per worker (others wait up to ``inflight_wait_s``, then get 503 with
Retry-After). Finished PNGs are kept in an LRU of ``ui_picture_cache_bytes`` keyed by the split's
metadata document (its generation included), so an overwritten split never shows old pictures.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from featurestore.format import dtypes
from server.errors import Busy, RequestTooLarge
from server.state import StoreState
from server.web import pictures
from server.web.png import encode_png


class PictureTooLarge(RequestTooLarge):
    """The sample or bag is bigger than the picture routes read (413)."""


class PictureCache:
    """An LRU of PNG bytes bounded by their total size."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[Any, ...], bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...]) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: tuple[Any, ...], value: bytes) -> None:
        if len(value) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self._bytes += len(value) - (len(old) if old is not None else 0)
            self._items[key] = value
            while self._bytes > self.max_bytes:
                _, dropped = self._items.popitem(last=False)
                self._bytes -= len(dropped)

    @property
    def nbytes(self) -> int:
        return self._bytes


class Figures:
    """Per app: the picture cache and the limit on pictures computed at once."""

    def __init__(self, state: StoreState) -> None:
        settings = state.settings
        self.state = state
        self.cache = PictureCache(settings.ui_picture_cache_bytes)
        self.max_bytes = settings.ui_max_sample_bytes
        self._slots = threading.BoundedSemaphore(settings.ui_pictures_at_once)
        self._wait_s = settings.inflight_wait_s
        self.computed = 0  # pictures computed (not served from the cache): for tests and bench

    def _cached(self, key: tuple[Any, ...], compute: Callable[[], np.ndarray]) -> bytes:
        body = self.cache.get(key)
        if body is not None:
            return body
        if not self._slots.acquire(timeout=self._wait_s):
            raise Busy(f"{self.state.settings.ui_pictures_at_once} pictures are being computed "
                       "(FEATURESTORE_UI_PICTURES_AT_ONCE); retry in a moment", retry_after=1)  # fmt: skip
        try:
            body = self.cache.get(key)  # another request may have made it meanwhile
            if body is None:
                body = encode_png(compute())
                self.computed += 1
                self.cache.put(key, body)
        finally:
            self._slots.release()
        return body

    def _check_size(self, nbytes: int, what: str) -> None:
        if nbytes > self.max_bytes:
            raise PictureTooLarge(
                f"{what} is {nbytes} bytes, over the {self.max_bytes} bytes the picture routes read "
                "(FEATURESTORE_UI_MAX_SAMPLE_BYTES): raise it or look at a smaller sample")

    # ------------------------------------------------------------------ dense
    def grid_of(self, metadata: dict[str, Any], sample_shape: tuple[int, ...]) -> tuple[int, tuple[int, int]] | None:
        return pictures.token_grid(metadata.get("token_layout"), tuple(sample_shape))

    def pca_png(self, dataset: str, encoder: str, split: str, index: int, max_side: int = 384) -> bytes:
        """Sample ``index`` as the RGB picture of its patch tokens' first three components."""
        from server.errors import BadRequest

        entry = self.state.open_split(dataset, encoder, split)
        arr = entry.array
        layout = self.grid_of(arr.metadata, arr.sample_shape)
        if layout is None:
            raise BadRequest(f"split {dataset}/{encoder}/{split} has samples of shape {list(arr.sample_shape)} "
                             f"with token_layout {arr.metadata.get('token_layout')!r}: not a patch grid, so "
                             "there is no picture; record the grid (featurestore import --grid)")  # fmt: skip
        prefix, grid = layout
        self._check_size(arr.sample_nbytes, f"one sample of {dataset}/{encoder}/{split}")
        key = ("pca", dataset, encoder, split, hashlib.blake2b(entry.document, digest_size=16).digest(),
               int(index), max_side)  # fmt: skip

        def compute() -> np.ndarray:
            stored = arr.read_numpy([index])[0]
            self.state.confirm(entry)
            sample = dtypes.stored_as_float32(stored, arr.dtype)
            return pictures.pca_picture(sample, prefix, grid, max_side=max_side)

        if not 0 <= index < len(arr):
            arr.read_numpy([index])  # raises IndexOutOfRange (416) with the reader's message
        return self._cached(key, compute)

    # ------------------------------------------------------------------ bags
    def slide_png(self, dataset: str, encoder: str, split: str, index: int, max_side: int = 512) -> bytes:
        """Bag ``index`` as a slide map: its patches at their coordinates, coloured by PC1."""
        store = self.state.store
        bags = store.open_bags(dataset, encoder, split)
        lengths = np.asarray(bags.lengths, np.int64)
        if not 0 <= index < len(lengths):
            from featurestore.errors import IndexOutOfRange

            raise IndexOutOfRange(f"bag {index} is out of range: {dataset}/{encoder}/{split} has {len(lengths)} bags (0..{len(lengths) - 1})")
        dim = int(getattr(bags, "dim", 0) or 0)
        itemsize = 4 if str(getattr(bags, "dtype", "")) == "float32" else 2
        self._check_size(int(lengths[index]) * max(dim, 1) * itemsize, f"bag {index} of {dataset}/{encoder}/{split}")
        document = store.storage.read(f"{dataset}/{encoder}/{split}/zarr.json")
        key = ("slide", dataset, encoder, split, hashlib.blake2b(document, digest_size=16).digest(), int(index), max_side)

        def compute() -> np.ndarray:
            features, coords = bags.read_numpy(index)
            features = np.asarray(features)
            if features.dtype == np.uint16:  # bfloat16 bits
                features = dtypes.stored_as_float32(features, "bfloat16")
            if len(features) == 0:
                return pictures.slide_map(np.zeros((0, 2)), np.zeros(0), max_side=max_side)
            components = pictures.fit_components(features, 1)
            values = components.unit(components.project(features))[:, 0]
            return pictures.slide_map(np.asarray(coords), values, patch=_patch_size(bags, index), max_side=max_side)

        return self._cached(key, compute)


def _patch_size(bags: Any, index: int) -> int | None:
    """The patch side at level 0, where the bag split records it (attrs), else None (inferred)."""
    attrs_of = getattr(bags, "attrs", None)
    try:
        attrs = attrs_of(index) if callable(attrs_of) else None
    except Exception:  # noqa: BLE001 - attributes are optional; the map infers the step
        attrs = None
    for name in ("patch_size_level0", "patch_size"):
        if isinstance(attrs, dict) and isinstance(attrs.get(name), (int, float)) and attrs[name] > 0:
            return int(attrs[name])
    return None
