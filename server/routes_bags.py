"""Bag-split routes: the listing of a bag split and one bag's features + coordinates.

``GET /v1/bags/{dataset}/{encoder}/{split}`` answers :class:`~featurestore.format.bag_listing.BagsListing`
(ids, lengths, labels, dim, dtypes, coordinate unit, the byte cap; pages of at most
:data:`~featurestore.format.wire.BAGS_PAGE` bags, ``?offset=`` for the next). ``GET .../{bag_id}``
answers one bag in the :data:`~featurestore.format.wire.BAG_MEDIA` framing (features, then
coordinates; an int8 split's scales row last with ``?dtype=int8``), optionally rows ``?start=&stop=`` of it; ``POST .../{bag_id}`` with an index body
(as ``POST .../batch``) answers the rows it lists, in its order. Every bag response goes through
the data routes' one path (:func:`server.routes_data.gathered_response`: byte cap 413, in-flight
budget 503, pooled zero-copy body, 409 if the split changed meanwhile).

A bag id is data, never a path: it arrives percent-encoded in one segment (or several, if a
client sent its slashes raw: the route's converter takes the rest of the path, newlines included), is decoded
exactly once, from the request's raw path (:func:`bag_id_of`), and is only ever looked up in the
split's id index (``bags.index``); an unknown id is :class:`~featurestore.errors.BagNotFound` (404).
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import unquote

import numpy as np
from fastapi import APIRouter, Query, Request
from starlette.concurrency import run_in_threadpool
from starlette.convertors import Convertor, register_url_convertor

from featurestore.errors import IndexOutOfRange
from featurestore.format import wire
from featurestore.format.bag_listing import BagsListing
from server.errors import BadRequest
from server.responses import ArrayResponse
from server.routes_data import (
    _INDEX_BODY,
    Dtype,
    Part,
    check_size,
    gathered_response,
    parse_indices,
    requested,
)
from server.routes_features import Name, state_of
from server.state import OpenedSplit, StoreState

router = APIRouter()


class BagIdConvertor(Convertor[str]):
    """The rest of the path, whatever it holds. Starlette's ``path`` converter is ``.*``, and a dot
    stops at a newline: an id with one (``%0A`` on the wire, decoded before routing) matched no
    route at all, while every other character did."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


# Registered before the routes below compile wire.BAG_ROUTE, which names this converter.
register_url_convertor("bag_id", BagIdConvertor())

_BAG: dict[int | str, dict[str, Any]] = {
    "200": {"content": {wire.BAG_MEDIA: {}},
            "description": "features bytes, then coordinates bytes (see docs/SERVER.md)"}
}  # fmt: skip
BagId = Annotated[str, "any string; percent-encode it (wire.quote_bag_id)"]


def bag_id_of(request: Request, dataset: str, encoder: str, split: str, decoded: str) -> str:
    """The bag id as the client sent it, percent-decoded once from the raw request path.

    The ASGI ``path`` is decoded already, by the server; Starlette's TestClient decodes it a second
    time (an id ``%2e%2e`` arrives as ``..``), so the raw path is the one source both agree on.
    Without a raw path (it is optional in ASGI) the route's ``decoded`` value is used.
    """
    raw = request.scope.get("raw_path")
    prefix = wire.route(wire.BAGS, dataset=dataset, encoder=encoder, split=split) + "/"
    text = raw.decode("latin-1").split("?", 1)[0] if raw else ""
    at = text.find(prefix)
    if at < 0:
        return decoded
    try:
        return unquote(text[at + len(prefix) :], encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise BadRequest("the bag id in the path is not UTF-8 once percent-decoded: encode the id's "
                         "UTF-8 bytes (wire.quote_bag_id)") from None  # fmt: skip


def listing(entry: OpenedSplit, max_response_bytes: int, offset: int, limit: int,
            attrs: bool) -> BagsListing:  # fmt: skip
    """Bags ``offset .. offset + limit`` of an opened bag split, as the wire listing."""
    bags = entry.reader
    count = len(bags)
    stop = min(count, offset + limit)
    labels = bags.labels
    return BagsListing(
        ids=list(bags.ids[offset:stop]),
        lengths=np.asarray(bags.lengths[offset:stop], dtype=np.int64),
        labels=None if labels is None else np.asarray(labels[offset:stop]).tolist(),
        dim=int(bags.dim), dtype=str(bags.dtype),
        coords_dtype=str(bags.coords_dtype), coords_unit=bags.coords_unit,
        max_response_bytes=max_response_bytes, count=count, offset=min(offset, count),
        attrs=[bags.attrs(i) for i in range(offset, stop)] if attrs else None,
        metadata=bags.metadata,
    )  # fmt: skip


@router.get(wire.BAGS, tags=["bags"])
def bags_listing(
    request: Request, dataset: Name, encoder: Name, split: Name,
    offset: Annotated[int, Query(ge=0, description="first bag of this page")] = 0,
    limit: Annotated[int, Query(ge=1, le=wire.BAGS_PAGE, description="bags per page")] = wire.BAGS_PAGE,
    attrs: Annotated[bool, Query(description="also each bag's slide attributes")] = False,
) -> dict[str, Any]:  # fmt: skip
    """The bag split's bags in their stored order: ``ids``, ``lengths`` (patches), ``labels``
    (or null), ``dim``, ``dtype``, ``coords_dtype``, ``coords_unit``, ``max_response_bytes``,
    ``generation`` and the split's ``metadata``; ``count`` bags in all, ``next_offset`` (null on
    the last page). With ``?attrs=true`` also ``attrs``, each bag's slide attributes."""
    state = state_of(request)
    entry = state.open_split(dataset, encoder, split, kind="bags")
    return listing(entry, state.settings.max_response_bytes, offset, limit, attrs).to_json()


def bag_response(state: StoreState, entry: OpenedSplit, bag_id: str, rows: slice | np.ndarray,
                 dtype: str | None = None) -> ArrayResponse:  # fmt: skip
    """Rows ``rows`` of bag ``bag_id``: features (as ``?dtype=`` asks, wire.served_dtype) then
    coordinates, then for int8 codes the bag's scales row, through the one data path."""
    bags = entry.reader
    served = requested(bags, dtype)
    position = bags.index(bag_id)  # the id is looked up, never joined into a path (BagNotFound: 404)
    length = int(bags.lengths[position])
    # ?start=&stop= are wire parameters, not a Python slice: out of the bag is an error, not clipped.
    if isinstance(rows, slice) and not 0 <= rows.start <= rows.stop <= length:
        raise IndexOutOfRange(f"rows {rows.start}:{rows.stop} are outside bag {bag_id!r} of {length} "
                              f"patches: use 0 <= start <= stop <= {length}")  # fmt: skip
    index = bags.rows_of(position, rows)  # the one bag-selection rule (format.bags.select_rows)
    features, coords = bags.features, bags.coords
    codes = served == wire.CODES
    per_row = int(bags.dim) * wire.storage_dtype(served).itemsize + int(coords.sample_nbytes)
    nbytes = check_size(state, len(index), per_row, unit="patches", extra=4 * int(bags.dim) if codes else 0,
                        how="read the bag in row ranges of at most {rows} {unit} (?start=&stop=) and "
                        "concatenate; FeatureClient.read_bag does this itself")  # fmt: skip
    parts: list[Part] = [
        ((len(index), *features.sample_shape), wire.storage_dtype(served), served, wire.SHAPE_HEADER,
         wire.DTYPE_HEADER),
        ((len(index), *coords.sample_shape), coords.numpy_dtype, coords.dtype, wire.COORDS_SHAPE_HEADER,
         wire.COORDS_DTYPE_HEADER),
    ]  # fmt: skip
    if codes:
        parts.append(((1, bags.dim), np.dtype(np.float32), "float32", wire.SCALES_SHAPE_HEADER,
                      wire.SCALES_DTYPE_HEADER))  # fmt: skip

    def fill(outs: list[np.ndarray]) -> None:
        if served in (bags.dtype, wire.CODES):
            features.read_numpy(index, out=outs[0])
            coords.read_numpy(index, out=outs[1])
        else:  # values: the bag reader's own dequantizing read, equal to a local one bit for bit
            outs[1][...] = bags.read_numpy(position, rows, out=outs[0], dtype=served)[1]
        if codes:
            outs[2][0] = bags.scales[position]

    return gathered_response(state, entry, nbytes, parts, fill, media_type=wire.BAG_MEDIA)


@router.get(wire.BAG_ROUTE, tags=["bags"], response_class=ArrayResponse, status_code=200, responses=_BAG)
def bag(
    request: Request, dataset: Name, encoder: Name, split: Name, bag_id: BagId,
    start: Annotated[int | None, Query(description="first patch (default 0)")] = None,
    stop: Annotated[int | None, Query(description="one past the last patch (default: the bag's length)")] = None,
    dtype: Dtype = None,
) -> ArrayResponse:  # fmt: skip
    """One bag (or its patches ``start:stop``): the features' bytes (``X-Shape`` ``n,D``,
    ``X-Dtype``), then the coordinates' (``X-Coords-Shape`` ``n,2``, ``X-Coords-Dtype``)."""
    state = state_of(request)
    bag_id = bag_id_of(request, dataset, encoder, split, bag_id)
    entry = state.open_split(dataset, encoder, split, kind="bags")
    length = int(entry.reader.lengths[entry.reader.index(bag_id)])
    first, last = 0 if start is None else start, length if stop is None else stop
    if first > last:
        raise BadRequest(f"start={first} is after stop={last}")
    return bag_response(state, entry, bag_id, slice(first, last), dtype)


@router.post(wire.BAG_ROUTE, tags=["bags"], response_class=ArrayResponse, status_code=200,
             responses=_BAG, openapi_extra=_INDEX_BODY)  # fmt: skip
async def bag_rows(request: Request, dataset: Name, encoder: Name, split: Name, bag_id: BagId,
                   dtype: Dtype = None) -> ArrayResponse:  # fmt: skip
    """Patches ``indices`` of one bag (any order, duplicates allowed; body as ``POST .../batch``),
    framed as ``GET`` answers a bag."""
    state = state_of(request)
    bag_id = bag_id_of(request, dataset, encoder, split, bag_id)
    body = await request.body()  # capped by server/limits.py while it arrives

    def work() -> ArrayResponse:
        entry = state.open_split(dataset, encoder, split, kind="bags")
        length = int(entry.reader.lengths[entry.reader.index(bag_id)])
        rows = parse_indices(body, request.headers.get("content-type", ""), length,
                             state.settings.max_indices, f"bag {bag_id!r}")  # fmt: skip
        return bag_response(state, entry, bag_id, rows, dtype)

    return await run_in_threadpool(work)
