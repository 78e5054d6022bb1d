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

from featurestore.format import dtypes, layout
from featurestore.format.names import validate_name
from featurestore.errors import FeatureStoreError, WrongSplitKind
from server.errors import BadRequest, Busy, NotFound, RequestTooLarge
from server.state import StoreState
from server.web import pictures
from server.web.png import encode_png

_OPEN_BAGS = 8  # bag splits kept open per worker (their index arrays)
_ATTENTION_MAPS = 4  # attention maps shown beside a slide map


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
        self._bags: OrderedDict[str, tuple[bytes, Any]] = OrderedDict()
        self._bags_lock = threading.Lock()
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
        try:
            entry = self.state.open_split(dataset, encoder, split)
        except WrongSplitKind as error:  # a bag split: its pictures are slide maps
            raise _other_kind(error, f"its pictures are slide maps: /ui/slidemap/{dataset}/{encoder}/{split}/"
                                     "BAG.png") from None
        arr = entry.reader
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
            # values, not stored bits: an int8 sample's codes are scaled per position
            sample = arr.read_numpy([index], dtype="float32")[0]
            self.state.confirm(entry)
            return pictures.pca_picture(sample, prefix, grid, max_side=max_side)

        if not 0 <= index < len(arr):
            arr.read_numpy([index])  # raises IndexOutOfRange (416) with the reader's message
        return self._cached(key, compute)

    # ------------------------------------------------------------------ bags
    def open_bags(self, dataset: str, encoder: str, split: str) -> Any:
        """The bag split, opened once per version of its document (its index arrays, ids
        included, are read at open: not again for every page and picture)."""
        key = layout.split_key(validate_name(dataset, "dataset"), validate_name(encoder, "encoder"),
                               validate_name(split, "split"))  # fmt: skip
        try:
            document = self.state.store.storage.read(f"{key}/{layout.ZARR_JSON}")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self.state.store.split_info(dataset, encoder, split)  # the precise not-found error
            raise
        digest = hashlib.blake2b(document, digest_size=16).digest()
        with self._bags_lock:
            cached = self._bags.get(key)
        if cached is not None and cached[0] == digest:
            return cached[1]
        try:
            bags = self.state.store.open_bags(dataset, encoder, split)
        except WrongSplitKind as error:  # a dense split: its pictures are PCA pictures of samples
            raise _other_kind(error, f"its pictures are of samples: /ui/pca/{dataset}/{encoder}/{split}/"
                                     "INDEX.png") from None
        with self._bags_lock:
            self._bags[key] = (digest, bags)
            while len(self._bags) > _OPEN_BAGS:
                self._bags.popitem(last=False)
        return bags

    def bag_rows(self, bags: Any, index: int) -> np.ndarray | None:
        """The rows of bag ``index`` a slide map reads: all (None), or, for a bag over
        ``ui_max_sample_bytes``, that many bytes of evenly spaced rows."""
        n = int(bags.lengths[index])
        per_row = bags.dim * _itemsize(bags.dtype) + 2 * np.dtype(bags.coords_dtype).itemsize
        limit = max(1, self.max_bytes // per_row)
        if n <= limit:
            return None
        return np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))

    def attention_maps(self, bags: Any) -> list[tuple[str, Any, str | None]]:
        """``(name, map or None, why it cannot be read)`` of each attention map saved under the
        bag split (at most ``_ATTENTION_MAPS``); stale maps are listed, their ``stale`` says why."""
        from featurestore.core.bag_attention import attention_names, open_attention

        storage = self.state.store.storage
        out: list[tuple[str, Any, str | None]] = []
        for name in attention_names(storage, bags.key)[:_ATTENTION_MAPS]:
            try:
                out.append((name, open_attention(storage, bags.key, name, bags.metadata), None))
            except FeatureStoreError as error:
                out.append((name, None, str(error)))
        return out

    def slide_png(self, dataset: str, encoder: str, split: str, index: int, max_side: int = 512,
                  attention: str | None = None) -> bytes:
        """Bag ``index`` as a slide map: its patches at their coordinates, coloured by PC1, or by
        the rank of their weight in attention map ``attention`` (a stale map is refused: 409)."""
        bags = self.open_bags(dataset, encoder, split)
        i = bags.position(int(index))  # IndexOutOfRange (416) outside the split
        rows = self.bag_rows(bags, i)
        key: tuple[Any, ...] = ("slide", bags.key, bags.metadata.get("generation"), bags.metadata.get("completed"), i,
                                max_side)  # fmt: skip
        amap = None
        if attention is not None:
            from featurestore.core.bag_attention import open_attention

            amap = open_attention(self.state.store.storage, bags.key, attention, bags.metadata)
            amap.check_current()  # StaleAttention (409): a map of another state of the split is never shown
            weights_of = amap.bag
            key += ("attention", attention, amap.lineage.get("created"))

        def compute() -> np.ndarray:
            if amap is None:
                features, coords = bags.read_numpy(i, rows, dtype="float32")  # values (int8: codes x scales)
            else:
                weights = weights_of(i, bags.offsets, rows)
                if weights is None:
                    raise NotFound(f"bag {bags.ids[i]!r} was not evaluated by the probe run that saved attention map "
                                   f"{attention!r} (an empty bag, or one outside its evaluated split)")
                coords = bags.coords.read_numpy(bags.rows_of(i, rows))
            coords = np.asarray(coords, np.float64)
            # rows written without coordinates hold -1 (NaN for float coordinates)
            placed = np.isfinite(coords).all(axis=1) & (coords >= 0).all(axis=1)
            if not placed.any():
                return pictures.slide_map(np.zeros((0, 2)), np.zeros(0), max_side=max_side)
            if amap is None:
                sample = features[placed]
                components = pictures.fit_components(sample, 1)
                values = components.unit(components.project(sample))[:, 0]
            else:
                values = pictures.ranks(weights[placed])
            patch = bags.patch_size_of(i) if bags.coords_unit == "px" else None
            return pictures.slide_map(coords[placed], values, patch=patch, max_side=max_side)

        return self._cached(key, compute)


def _itemsize(logical: str) -> int:
    return int(dtypes.storage_dtype(logical).itemsize)


def _other_kind(error: WrongSplitKind, advice: str) -> WrongSplitKind:
    """A picture route of the other kind of split: 404 WrongSplitKind (as the data routes answer),
    with the page's own way forward instead of the library's (``store.open_bags(...)``)."""
    what = str(error).partition(WrongSplitKind.DOOR)[0].rstrip(" :;,")
    return WrongSplitKind(f"{what}: {advice}")
