"""``RemoteBagArray``: a bag split on a server, with the interface of the store's local bag reader
(``store.open_bags(...)``), so a ``BagDataset`` treats a store path and a server URL alike.

Everything it knows about the split comes from one :class:`~featurestore.format.bag_listing.BagsListing`
(``GET /v1/bags/...``, all pages, fetched once); every byte it reads comes through
:meth:`FeatureClient.fetch_bag`, one request per bag, or several for a bag larger than the server's
byte cap (row ranges, each written in place into the one output pair). Each response must be of
the generation the listing named: a bag of a split overwritten since is ``SplitChanged``, never
another generation's rows under this listing's lengths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from featurestore import errors as fse
from featurestore.core.quantize_int8 import check_read_dtype
from featurestore.format import dtypes, wire
from featurestore.format.bag_listing import BagsListing
from featurestore.format.bags import BagLookup, check_out, select_rows, selected_count

if TYPE_CHECKING:
    from client.http import FeatureClient

__all__ = ["RemoteBagArray"]


class RemoteBagArray(BagLookup):
    """A bag split over HTTP: ``len``, ``ids``, ``lengths`` (int64), ``labels``, ``dim``,
    ``dtype``, ``coords_dtype``, ``coords_unit``, ``patch_size_level0``, ``metadata``, ``num_rows``,
    ``attrs(i_or_id)``, ``label(i_or_id)``, ``index(bag_id)``, ``position(i_or_id)``,
    ``read(i_or_id, rows=None)`` (torch) and ``read_numpy(i_or_id, rows=None, out=None, dtype=None)``
    (numpy; bfloat16 as uint16 bits, int8 as codes unless ``dtype`` asks for values; ``out``: the
    features' buffer), as the local reader has them.

    ``rows``: which patches, by the rule every bag reader shares
    (:func:`~featurestore.format.bags.select_rows`): None (the whole bag), a slice (a step-1 slice
    is asked for by ``GET ?start=&stop=``), or positions within the bag (any order, duplicates
    allowed; sent as one ``POST`` body).
    """

    def __init__(self, client: FeatureClient, key: tuple[str, str, str], listing: BagsListing) -> None:
        self.client = client
        self.key = key
        self.listing = listing
        self.route = dict(zip(("dataset", "encoder", "split"), key, strict=True))
        self.ids: list[str] = listing.ids
        self.lengths: np.ndarray = listing.lengths
        self.labels: np.ndarray | None = None if listing.labels is None else np.asarray(listing.labels)
        self.dim = listing.dim
        self.dtype = listing.dtype
        self.numpy_dtype = wire.storage_dtype(listing.dtype)
        self.coords_dtype = listing.coords_dtype
        self.coords_unit = listing.coords_unit
        self.metadata = listing.metadata
        self.patch_size_level0: Any = (listing.metadata.get("bags") or {}).get("patch_size_level0")
        self.path = "http"
        self._positions: dict[str, int] | None = None
        self._attrs: list[dict[str, Any]] | None = listing.attrs

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return (f"RemoteBagArray({self.client.url!r}, {'/'.join(self.key)}, bags={len(self)}, dim={self.dim}, "
                f"dtype={self.dtype!r})")  # fmt: skip

    # ------------------------------------------------------------------ lookup
    def _where(self) -> str:
        return f"{self.client.url} {'/'.join(self.key)}"

    @property
    def num_rows(self) -> int:
        """Patches over all bags."""
        return int(self.lengths.sum())

    def label(self, bag: int | str) -> Any:
        return None if self.labels is None else self.labels[self.position(bag)].item()

    def attrs(self, bag: int | str) -> dict[str, Any]:
        """One bag's slide attributes (all bags' fetched on first use, one listing request)."""
        position = self.position(bag)
        if self._attrs is None:
            listing = self.client.bags(*self.key, attrs=True)
            if listing.generation != self.listing.generation:
                raise fse.SplitChanged(f"{self._where()}: the split is now generation {listing.generation!r}, this "
                                       f"reader opened {self.listing.generation!r}: it was overwritten since; open it again")
            self._attrs = listing.attrs or [{} for _ in self.ids]
        return dict(self._attrs[position])

    # ------------------------------------------------------------------ reads
    def read(self, bag: int | str, rows: Any = None) -> tuple[Any, Any]:
        """``(features [n, D] in the stored dtype, float32 values for int8, coords [n, 2])`` as
        torch tensors."""
        if self.dtype == wire.CODES:
            features, coords = self.read_numpy(bag, rows=rows, dtype="float32")
            return dtypes.to_torch(features, "float32"), dtypes.to_torch(coords, self.coords_dtype)
        features, coords = self.read_numpy(bag, rows=rows)
        return dtypes.to_torch(features, self.dtype), dtypes.to_torch(coords, self.coords_dtype)

    def read_numpy(self, bag: int | str, rows: Any = None, out: np.ndarray | None = None,
                   dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """``(features, coords)`` of one bag (or its ``rows``) as numpy; the features are written
        into ``out`` if given (a C-contiguous ``[n, D]`` array, e.g. pinned memory), as the local
        reader does: in the storage dtype (int8 codes for int8), or as ``dtype``
        ("float32"/"float16"). An int8 bag travels as codes and its scales row (``?dtype=int8``),
        dequantized here by the local reader's formula, so the values are the same bits."""
        want = check_read_dtype(dtype, self.dtype)
        position = self.position(bag)
        selection = select_rows(rows, int(self.lengths[position]), self.ids[position])
        count = selected_count(selection)
        if want is not None:
            if out is None:
                out = np.empty((count, self.dim), want)
            elif out.shape != (count, self.dim) or out.dtype != np.dtype(want) or not out.flags.c_contiguous:
                raise fse.ShapeMismatch(f"out has shape {out.shape} and dtype {out.dtype}; this bag read needs a "
                                        f"C-contiguous ({count}, {self.dim}) array of {want}")
            if self.dtype == wire.CODES or np.dtype(want) != self.numpy_dtype:
                stored = np.empty((count, self.dim), self.numpy_dtype)
                coords, scales = self._stored(position, selection, count, stored)
                if scales is not None:
                    np.multiply(stored, scales[0], out=out, casting="same_kind")
                else:
                    out[...] = dtypes.stored_as_float32(stored, self.dtype)
                return out, coords
        if out is None:
            out = np.empty((count, self.dim), self.numpy_dtype)
        check_out(out, count, self.dim, self.numpy_dtype)
        return out, self._stored(position, selection, count, out)[0]

    def _stored(self, position: int, selection: slice | np.ndarray, count: int,
                features: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
        """The stored rows of bag ``position`` into ``features``: ``(coords, the int8 scales row
        [1, D] or None)``."""
        coords = np.empty((count, 2), wire.storage_dtype(self.coords_dtype))
        scales = np.zeros((1, self.dim), np.float32) if self.dtype == wire.CODES else None
        # Pieces that fit the server's byte cap (an int8 bag's scales row included), each one
        # request written in place.
        room = self.listing.max_response_bytes - (0 if scales is None else scales.nbytes)
        step = max(1, room // max(self.listing.row_nbytes, 1))
        path = wire.route(wire.BAG, **self.route, bag_id=self.ids[position])
        try:
            self._fetch(path, selection, count, step, features, coords, scales)
        except (fse.SplitChanged, fse.IndexOutOfRange, fse.BagNotFound) as error:
            cached = getattr(self.client, "_bags", {})  # the client's next open_bags asks for the listing again
            if cached.get(self.key) is self:
                del cached[self.key]
            if isinstance(error, fse.SplitChanged):
                raise
            # Rows and ids were checked against this reader's listing before asking: the server's
            # 416 or 404 (which carry no generation) means the split was overwritten since.
            raise fse.SplitChanged(wire.redact(
                f"{self.client.url} {'/'.join(self.key)}: the server no longer holds bag {self.ids[position]!r} as "
                f"this reader's listing has it ({str(error).splitlines()[0]}): the split was overwritten since it "
                "was opened; open it again")) from None
        return coords, scales

    def _fetch(self, path: str, selection: slice | np.ndarray, count: int, step: int, features: np.ndarray,
               coords: np.ndarray, scales: np.ndarray | None) -> None:
        for lo in range(0, count, step):  # an empty bag: nothing to ask for
            hi = min(count, lo + step)
            if isinstance(selection, slice):
                params = {"start": str(selection.start + lo), "stop": str(selection.start + hi)}
                self.client.fetch_bag(path, features[lo:hi], coords[lo:hi], self.dtype, self.coords_dtype,
                                      params=params, generation=self.listing.generation, scales=scales)  # fmt: skip
            else:
                self.client.fetch_bag(path, features[lo:hi], coords[lo:hi], self.dtype, self.coords_dtype,
                                      indices=selection[lo:hi], generation=self.listing.generation,
                                      scales=scales)  # fmt: skip


RemoteBags = RemoteBagArray  # the name before the reader family was named as one (deprecated)
