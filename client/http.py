"""HTTP client of the featurestore server: ``FeatureClient`` and ``RemoteFeatureArray``.

``client.open(dataset, encoder, split)`` returns a :class:`RemoteFeatureArray` with the same
interface as a local :class:`featurestore.FeatureArray` (``shape``, ``dtype``, ``labels``,
``read``, ``read_numpy(indices, out=None)``, ...), so datasets and loaders treat a store path
and a server URL alike. Server errors come back as :class:`ClientError`; when the server names
a featurestore error class (``SplitNotFound``, ``IndexOutOfRange``, ...) the raised exception
is also an instance of that class, so ``except SplitNotFound`` works for both sources.

This module is the facade: listings and reads by name. Requests, retries, the wait while a split
is rewritten, error mapping and the framed responses are :class:`client.transport.Transport`'s,
which ``FeatureClient`` extends. Imports httpx and numpy only; torch is imported by :meth:`read`
alone, and nothing here imports the server stack (fastapi).
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from client.remote import RemoteFeatureArray, reopening
from client.remote_bag_array import RemoteBagArray
from client.transport import TOKEN_ENV, ClientError, Transport, make_error
from featurestore.core.lineage import stale_reason, warn_stale
from featurestore.core.quantize_int8 import check_read_dtype
from featurestore.format import lineage, wire
from featurestore.format.bag_listing import BagsListing

__all__ = ["TOKEN_ENV", "ClientError", "FeatureClient", "RemoteBagArray", "RemoteFeatureArray"]


class FeatureClient(Transport):
    """Read a featurestore server: ``FeatureClient("http://host:8000", token=None)``.

    ``token``: the bearer token; None reads ``$FEATURESTORE_TOKEN``, ``""`` sends none.

    One pooled ``httpx.Client`` per process (re-created after a fork, dropped when pickled, so
    the client can live inside a DataLoader's dataset). Idempotent reads are retried
    ``retries`` times on connection errors and 5xx, waiting ``backoff * 2**attempt`` seconds.
    A split that is being rewritten (the server's 409 with ``Retry-After``: an overwrite deleted
    or changed it under the read) is asked for again, backing off up to the Retry-After, for at
    most ``split_change_wait_s`` seconds (0: not at all); then the 409 is raised
    (``IncompleteSplit``).
    ``transport`` replaces the default one (``client/_stdlib_transport.py``: the standard
    library's ``http.client`` keep-alive connections, whose ``readinto`` fills the output array
    straight from the socket; https goes through httpx's own), e.g.
    ``httpx.HTTPTransport()``. ``http_client`` lets tests pass
    ``fastapi.testclient.TestClient(app)``.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.25,
        split_change_wait_s: float = 60.0,
        max_connections: int = 16,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        super().__init__(url, token, timeout=timeout, retries=retries, backoff=backoff,
                         split_change_wait_s=split_change_wait_s, max_connections=max_connections,
                         transport=transport, http_client=http_client)  # fmt: skip
        self._layouts: dict[tuple[str, str, str], RemoteFeatureArray] = {}
        self._bags: dict[tuple[str, str, str], RemoteBagArray] = {}
        # open() checks a derived split's lineage and warns when it is stale; a dataset, which
        # checks and warns once itself, turns it off for the readers it opens (client.dataset).
        self.check_stale = True

    def __repr__(self) -> str:
        return f"FeatureClient({self.url!r}, token={'***' if self._token else None})"

    # ------------------------------------------------------------------ listings
    def datasets(self) -> list[str]:
        return list(self.get_json(wire.DATASETS)["datasets"])

    def encoders(self, dataset: str) -> list[str]:
        return list(self.get_json(wire.route(wire.ENCODERS, dataset=dataset))["encoders"])

    def splits(self, dataset: str, encoder: str) -> list[str]:
        return list(self.get_json(wire.route(wire.SPLITS, dataset=dataset, encoder=encoder))["splits"])

    def split_kinds(self, dataset: str, encoder: str) -> dict[str, str]:
        """``{split: "dense" | "bags"}``: which splits :meth:`open` reads, which :meth:`open_bags`."""
        doc = self.get_json(wire.route(wire.SPLITS, dataset=dataset, encoder=encoder))
        return {str(name): str(kind) for name, kind in (doc.get("kind") or {}).items()}

    def info(self, dataset: str, encoder: str, split: str) -> dict[str, Any]:
        """The split's metadata dict (what ``FeatureArray.metadata`` holds locally)."""
        result: dict[str, Any] = self.get_json(
            wire.route(wire.SPLIT, dataset=dataset, encoder=encoder, split=split)
        )
        return result

    def healthy(self) -> bool:
        try:
            return self.get_json(wire.HEALTHZ).get("status") == "ok"
        except ClientError:
            return False

    # ------------------------------------------------------------------ data
    def open(self, dataset: str, encoder: str, split: str) -> RemoteFeatureArray:
        """The split as a :class:`RemoteFeatureArray`: one request (structure and metadata), cached."""
        key = (dataset, encoder, split)
        arr = self._layouts.get(key)
        if arr is None:
            doc = self.get_json(wire.route(wire.ARRAYS, dataset=dataset, encoder=encoder, split=split))
            try:
                structure = wire.SplitStructure.from_json(doc)
            except wire.WireFormatError as error:
                raise make_error(f"{self.url} answered a bad split structure: {error}",
                                 status=200, detail=None, url=self.url) from None  # fmt: skip
            arr = RemoteFeatureArray(self, key, structure)
            arr.stale = self._stale(key, structure.metadata) if self.check_stale else None
            self._layouts[key] = arr
        return arr

    def _stale(self, key: tuple[str, str, str], metadata: dict[str, Any]) -> str | None:
        """Why a derived split (``featurestore embed``) no longer describes its source, warned
        (:class:`StaleSplitWarning`) as the server's ``X-Featurestore-Stale`` header says; None when
        current or not derived. Read, never served as current (client.stale)."""
        if lineage.KEY not in metadata:
            return None
        reason = stale_reason(ServedSplits(self), metadata)
        if reason is not None:
            warn_stale("/".join(key), reason, stacklevel=3)
        return reason

    # ------------------------------------------------------------------ bag splits
    def bags(self, dataset: str, encoder: str, split: str, *, attrs: bool = False) -> BagsListing:
        """The bag split's listing (every page): ``ids``, ``lengths`` (int64 patches per bag),
        ``labels`` (or None), ``dim``, ``dtype``, ``coords_dtype``, ``coords_unit``,
        ``metadata``; with ``attrs=True`` also each bag's slide attributes."""
        path = wire.route(wire.BAGS, dataset=dataset, encoder=encoder, split=split)
        params = {"attrs": "true"} if attrs else {}
        listing: BagsListing | None = None
        while listing is None or listing.next_offset is not None:
            offset = 0 if listing is None else listing.next_offset
            try:
                page = BagsListing.from_json(self.get_json(path, {**params, "offset": str(offset)}))
                listing = page if listing is None else listing.extend(page)
            except wire.WireFormatError as error:
                raise make_error(f"{self.url}{path} answered a bad bag listing: {error}",
                                 status=200, detail=None, url=self.url + path) from None  # fmt: skip
        return listing

    def open_bags(self, dataset: str, encoder: str, split: str) -> RemoteBagArray:
        """The bag split as a :class:`RemoteBagArray` (the local bag reader's interface): its
        listing is fetched once and cached."""
        key = (dataset, encoder, split)
        bags = self._bags.get(key)
        if bags is None:
            bags = self._bags[key] = RemoteBagArray(self, key, self.bags(dataset, encoder, split))
        return bags

    @reopening
    def read_bag(self, dataset: str, encoder: str, split: str, bag: int | str, rows: Any = None
                 ) -> tuple[Any, Any]:  # fmt: skip
        """One bag, by id (``str``) or position (``int``): ``(features [n, D] torch tensor in the
        stored dtype, float32 values for int8, coords [n, 2] torch tensor)``. ``rows``: None (whole bag), a slice, or patch
        indices. A bag above the server's byte cap is fetched in row ranges, into one tensor."""
        return self.open_bags(dataset, encoder, split).read(bag, rows=rows)

    @reopening
    def read_bag_numpy(self, dataset: str, encoder: str, split: str, bag: int | str, rows: Any = None,
                       out: np.ndarray | None = None, dtype: str | None = None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """:meth:`read_bag` as numpy (bfloat16 as uint16 bits, int8 as codes), or the features as
        ``dtype`` ("float32"/"float16"), into ``out`` if given; no torch."""
        return self.open_bags(dataset, encoder, split).read_numpy(bag, rows=rows, out=out, dtype=dtype)

    def _array(self, dataset: str, encoder: str, split: str, labels: bool) -> RemoteFeatureArray:
        arr = self.open(dataset, encoder, split)
        if labels:
            if arr.labels is None:
                raise make_error(f"split {dataset}/{encoder}/{split} has no labels",
                                 status=None, detail=None, url=self.url)
            return arr.labels
        return arr

    @reopening
    def read_numpy(self, dataset: str, encoder: str, split: str, indices: Any, *,
                   labels: bool = False, out: np.ndarray | None = None, dtype: str | None = None) -> np.ndarray:  # fmt: skip
        """Rows ``indices`` in the storage dtype (uint16 bits for bfloat16, codes for int8), or as
        ``dtype`` ("float32"/"float16", as ``FeatureArray.read_numpy``); no torch needed."""
        return self._array(dataset, encoder, split, labels).read_numpy(indices, out=out, dtype=dtype)

    @reopening
    def read(self, dataset: str, encoder: str, split: str, indices: Any, *,
             labels: bool = False) -> Any:  # fmt: skip
        """Rows ``indices`` as a torch tensor of the stored dtype (torch.bfloat16 for bfloat16;
        float32 values for int8)."""
        return self._array(dataset, encoder, split, labels).read(indices)

    @reopening
    def read_samples(self, dataset: str, encoder: str, split: str, indices: Any, *, dtype: str | None = None
                     ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
        """Features and labels (None without labels) of ``indices``, in one request: the features
        in the storage dtype (int8 codes for an int8 split), or as ``dtype`` values ("float32",
        "float16"; an int8 split's values as the store's own read gives them)."""
        arr = self.open(dataset, encoder, split)
        index = wire.as_index_array(indices)
        if check_read_dtype(dtype, arr.dtype) is not None:
            values = arr.read_numpy(index, dtype=dtype)
            return values, None if arr.labels is None else arr.labels.read_numpy(index)
        features = np.empty((len(index), *arr.sample_shape), arr.numpy_dtype)
        if arr.labels is None:
            return arr.read_numpy(index, out=features), None
        labels = np.empty((len(index), *arr.labels.sample_shape), arr.labels.numpy_dtype)
        arr.read_into(index, features, labels)
        return features, labels

    def read_ids(self, dataset: str, encoder: str, split: str, ids: Any, *, dtype: str | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
        """Features and labels (None without labels) of the samples named by ``ids``, in one
        request; ``dtype`` as :meth:`read_samples` (an int8 split's values with "float32")."""
        from client.by_id import read_ids

        return read_ids(self, dataset, encoder, split, ids, dtype)

    @reopening
    def read_range(self, dataset: str, encoder: str, split: str, start: int, stop: int, *,
                   labels: bool = False) -> np.ndarray:  # fmt: skip
        return self._array(dataset, encoder, split, labels).read_range(start, stop)

    @reopening
    def item(self, dataset: str, encoder: str, split: str, index: int, *,
             labels: bool = False, dtype: str | None = None) -> np.ndarray:  # fmt: skip
        """One sample (storage dtype, int8 codes; or ``dtype`` values: "float32"/"float16"), via
        the single-item route. One row's values weigh less than its codes and scales, so an int8
        sample's values are the server's (its local read, the same bits)."""
        arr = self._array(dataset, encoder, split, labels)
        want = check_read_dtype(dtype, arr.dtype)
        served = want or (wire.CODES if arr.dtype == wire.CODES else arr.dtype)
        out = np.empty(arr.sample_shape, wire.storage_dtype(served))
        parts = [(out, served, wire.SHAPE_HEADER, wire.DTYPE_HEADER)]
        if served == wire.CODES:
            parts.append((np.empty((1, *arr.sample_shape), np.float32), "float32", wire.SCALES_SHAPE_HEADER,
                          wire.SCALES_DTYPE_HEADER))  # fmt: skip
        params = {**arr.params, wire.DTYPE_PARAM: served} if want or served == wire.CODES else arr.params
        path = wire.route(wire.ITEM, **arr.route, index=int(index))
        return self.fetch_parts("GET", path, parts, params=params, generation=arr.structure.generation)[0]


class ServedSplits:
    """The one call of a store the lineage check makes, ``split_metadata``, answered by a server."""

    def __init__(self, client: FeatureClient) -> None:
        self.client = client

    def split_metadata(self, dataset: str, encoder: str, split: str) -> dict[str, Any]:
        # A bag split's metadata comes with its listing; a dense split's from its info route.
        if self.client.split_kinds(dataset, encoder).get(split) == "bags":
            return self.client.bags(dataset, encoder, split).metadata
        return self.client.info(dataset, encoder, split)
