"""Data routes: one item, a contiguous range, a list of indices, and features+labels together.

Every data request follows one path (:func:`gathered_response`): check the byte cap (413), reserve the
response's bytes against the in-flight budget (wait, or 503 with Retry-After), gather each array
into a pooled buffer with the store's reader, confirm the split did not change meanwhile (409),
then hand the buffers to :class:`~server.responses.ArrayResponse`, which sends them without
copying and gives the reservation back when the last byte left (or the client went away).
``?dtype=`` picks what the features part holds (:func:`requested`, ``wire.served_dtype``): float32
or float16 values (an int8 split dequantized by the store's reader, its default), or an int8
split's codes followed by their chunks' scales as one more part.

Index lists come as raw little-endian int64 (``Content-Type: application/x-featurestore-indices``,
no parsing at all) or JSON ``{"indices": [...]}``; either is capped in bytes
(``FEATURESTORE_MAX_REQUEST_BYTES``, by ``server/limits.py`` before the body is read) and in
count (``FEATURESTORE_MAX_INDICES``, before it is parsed).

Parsing and gathering run in the thread pool, except where a request provably cannot wait: a
small read of page-cached rows this worker has checked already is answered on the event loop
(``server/on_loop.py``), which saves the pool's two thread wake-ups.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Header, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from featurestore.errors import CorruptChunk, DtypeMismatch, IndexOutOfRange, MissingChunks, SplitChanged
from featurestore.format import lineage, wire
from server.errors import BadRequest, NotFound, RequestTooLarge, ResponseTooLarge
from server import on_loop
from server.on_loop import WouldBlock
from server.plain_params import PlainParamsRoute
from server.responses import ArrayResponse
from server.routes_features import Name, state_of
from server.state import OpenedSplit, StoreState

_INLINE_BODY_BYTES = 64 << 10  # an index body parsed on the event loop at most (server/on_loop.py)

router = APIRouter(route_class=PlainParamsRoute)  # parameters read without FastAPI's solver (plain_params.py)

Labels = Annotated[bool, Query(description="labels instead of features")]
Accept = Annotated[str | None, Header(description=f"{wire.NPY} for an .npy body")]
Dtype = Annotated[str | None, Query(description="float32 or float16 values, or int8: an int8 split's codes and "
                                                "their scales (see docs/SERVER.md); default: as stored, int8 as float32")]

_DATA: dict[int | str, dict[str, Any]] = {
    "200": {"content": {wire.OCTET_STREAM: {}, wire.NPY: {}}, "description": "raw bytes"}
}
_SAMPLES: dict[int | str, dict[str, Any]] = {
    "200": {"content": {wire.SAMPLES_MEDIA: {}},
            "description": "features bytes, then labels bytes (see docs/SERVER.md)"}
}  # fmt: skip
_INDEX_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"type": "object", "required": ["indices"],
                                            "properties": {"indices": {"type": "array",
                                                                       "items": {"type": "integer"}}}}},  # fmt: skip
            wire.INDICES: {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def _pick(entry: OpenedSplit, labels: bool, dtype: str | None = None) -> Any:
    arr = entry.reader
    if not labels:
        return arr
    if dtype is not None:  # a float16 cast of integer labels past 2048 would change them
        raise BadRequest(f"dtype={dtype} converts features; labels=true answers the labels in their stored dtype: "
                         "drop dtype")
    if arr.labels is None:
        raise NotFound(f"split {'/'.join(entry.key)} has no labels")
    return arr.labels


def check_size(state: StoreState, rows: int, per_row: int, *, unit: str = "samples",
               how: str = "request at most {rows} {unit} at a time and concatenate", extra: int = 0) -> int:  # fmt: skip
    """The response's bytes, or :class:`ResponseTooLarge` (413) naming the cap and how many
    ``unit`` (rows of ``per_row`` bytes, plus ``extra`` bytes of int8 scales) one request may ask
    for (``how``)."""
    cap = state.settings.max_response_bytes
    nbytes = rows * per_row + extra
    if nbytes > cap:
        per_request = max(cap - extra, 0) // max(per_row, 1)
        hint = (
            how.format(rows=per_request, unit=unit)
            if per_request
            else f"one of the {unit} is larger than the cap: raise FEATURESTORE_MAX_RESPONSE_BYTES"
        )
        raise ResponseTooLarge(
            f"response of {rows} {unit} x {per_row} bytes = {nbytes} bytes exceeds the server's "
            f"cap of {cap} bytes (FEATURESTORE_MAX_RESPONSE_BYTES); {hint}",
            max_response_bytes=cap,
        )
    return nbytes


# One output array of a response: (shape, storage dtype, logical dtype, shape header, dtype header).
Part = tuple[tuple[int, ...], Any, str, str, str]


def gathered_response(state: StoreState, entry: OpenedSplit, nbytes: int, parts: list[Part],
                      fill: Callable[[list[np.ndarray]], None], *, npy: bool = False, single: bool = False,
                      media_type: str = wire.OCTET_STREAM, inline: bool = False) -> ArrayResponse:  # fmt: skip
    """The one path of every data response: reserve ``nbytes`` against the in-flight budget,
    lease a pooled buffer per part, ``fill`` them with the store's reader, confirm the split did
    not change meanwhile (409), and wrap the buffers, no copy; the reservation is given back when
    the last byte left (or on any failure before). A derived split whose source changed since it
    was computed is answered with ``X-Featurestore-Stale`` (featurestore.core.lineage). ``inline``
    (server/on_loop.py): :class:`WouldBlock` rather than read a source's document or wait for room."""
    if inline and lineage.KEY in entry.reader.metadata:
        raise WouldBlock
    stale = state.stale_reason(entry)  # before the reservation: nothing to give back if it raises
    state.reserve(nbytes, inline=inline)
    try:
        outs = [state.buffer(shape, numpy_dtype) for shape, numpy_dtype, *_ in parts]
        try:
            fill(outs)
        except (MissingChunks, CorruptChunk, FileNotFoundError, SplitChanged):
            # Missing or damaged chunks mean a damaged store (500) only if the split is still the
            # one that was opened: an overwrite deletes and rewrites them, and a read caught in it
            # is the retryable 409.
            state.check_unchanged(entry)
            raise
        state.confirm(entry)  # the split did not change while we read it
    except BaseException:
        state.release(nbytes)
        raise
    # ``single``: the item route's one row, sent as a sample (an int8 item's scales keep their [1, *S])
    body = [(out[0] if single and i == 0 else out, dtype, shape_header, dtype_header)
            for i, (out, (_, _, dtype, shape_header, dtype_header)) in enumerate(zip(outs, parts, strict=True))]
    response = ArrayResponse(body, media_type=media_type, npy=npy,
                             chunk_bytes=state.settings.send_chunk_bytes,
                             send_timeout_s=state.settings.send_timeout_s,
                             on_sent=lambda: state.release(nbytes))  # fmt: skip
    if stale is not None:  # a derived split whose source changed since (featurestore.core.lineage)
        response.headers[lineage.STALE_HEADER] = stale
    if entry.generation is not None:  # the client refuses bytes of another generation than it opened
        response.headers[wire.GENERATION_HEADER] = entry.generation
    return response


def requested(arr: Any, dtype: str | None, npy: bool = False) -> str:
    """The logical dtype the features part is served as (``?dtype=``, wire.served_dtype): a bad
    one is a 400 naming the offered ones; codes and scales are two arrays, which no .npy holds."""
    try:
        served = wire.served_dtype(dtype, arr.dtype)
    except DtypeMismatch as error:
        raise BadRequest(str(error)) from None
    if npy and served == wire.CODES:
        raise BadRequest(f"dtype={wire.CODES} answers codes and their scales, two arrays, which an .npy body cannot "
                         "hold: ask for dtype=float32 or float16 with Accept: application/x-npy")
    return served


def _respond(state: StoreState, entry: OpenedSplit, arrays: list[Any], index: np.ndarray, *,
             served: str | None = None, npy: bool = False, single: bool = False,
             media_type: str = wire.OCTET_STREAM, inline: bool = False) -> ArrayResponse:  # fmt: skip
    """Gather rows ``index`` of each array into pooled buffers and wrap them, no copy; the first
    array's rows as ``served`` (wire.served_dtype: as stored, values, or codes + their scales).
    ``inline`` (server/on_loop.py): :class:`WouldBlock` unless the read is small, needs no
    conversion and is wholly in memory."""
    first = arrays[0]
    served = served or first.dtype
    elements = math.prod(first.sample_shape)
    chunks = wire.scale_chunks(index, first.chunk_rows)[0] if served == wire.CODES else None
    scales_bytes = 0 if chunks is None else len(chunks) * elements * 4
    per_row = elements * wire.storage_dtype(served).itemsize + sum(int(a.sample_nbytes) for a in arrays[1:])
    nbytes = check_size(state, len(index), per_row, extra=scales_bytes)
    if inline and (nbytes > state.settings.inline_read_bytes or served not in (first.dtype, wire.CODES)
                   or not all(arr.in_memory(index) for arr in arrays)):  # fmt: skip
        raise WouldBlock
    headers = [(wire.SHAPE_HEADER, wire.DTYPE_HEADER),
               (wire.LABELS_SHAPE_HEADER, wire.LABELS_DTYPE_HEADER)]  # fmt: skip
    parts: list[Part] = [((len(index), *arr.sample_shape), wire.storage_dtype(dtype), dtype, *names)
                         for arr, dtype, names in zip(arrays, [served] + [a.dtype for a in arrays[1:]],
                                                      headers, strict=False)]  # fmt: skip
    if chunks is not None:
        parts.append(((len(chunks), *first.sample_shape), np.dtype(np.float32), "float32",
                      wire.SCALES_SHAPE_HEADER, wire.SCALES_DTYPE_HEADER))  # fmt: skip

    def fill(outs: list[np.ndarray]) -> None:
        # values: the store's own dequantizing read, so they equal a local read_numpy(dtype=) bit for bit
        first.read_numpy(index, out=outs[0], dtype=None if served in (first.dtype, wire.CODES) else served)
        for arr, out in zip(arrays[1:], outs[1:len(arrays)], strict=True):
            arr.read_numpy(index, out=out)
        if chunks is not None:
            outs[-1][...] = first.scales.rows(chunks)

    return gathered_response(state, entry, nbytes, parts, fill, npy=npy, single=single,
                             media_type=media_type, inline=inline)  # fmt: skip


@router.get(wire.ITEM, tags=["features"], response_class=ArrayResponse, status_code=200,
            responses=_DATA)  # fmt: skip
async def item(
    request: Request, dataset: Name, encoder: Name, split: Name, index: int,
    labels: Labels = False, accept: Accept = None, dtype: Dtype = None,
) -> Response:  # fmt: skip
    """One sample: ``X-Shape`` is the sample shape (``256,384``)."""
    state = state_of(request)

    def work(inline: bool) -> ArrayResponse:
        entry = state.open_split(dataset, encoder, split, inline=inline)
        arr = _pick(entry, labels, dtype)
        if not 0 <= index < len(arr):
            raise IndexOutOfRange(f"index {index} out of range for {len(arr)} samples")
        npy = wire.wants_npy(accept)
        return _respond(state, entry, [arr], np.array([index], dtype=np.int64), served=requested(arr, dtype, npy),
                        npy=npy, single=True, inline=inline)  # fmt: skip

    return await on_loop.answer(state, work)


@router.get(wire.BATCH, tags=["features"], response_class=ArrayResponse, status_code=200,
            responses=_DATA)  # fmt: skip
async def batch_range(
    request: Request, dataset: Name, encoder: Name, split: Name,
    start: Annotated[int, Query(description="first index")],
    stop: Annotated[int, Query(description="one past the last index")],
    labels: Labels = False, accept: Accept = None, dtype: Dtype = None,
) -> Response:  # fmt: skip
    """Samples ``start:stop`` (a contiguous read)."""
    state = state_of(request)

    def work(inline: bool) -> ArrayResponse:
        entry = state.open_split(dataset, encoder, split, inline=inline)
        arr = _pick(entry, labels, dtype)
        if start > stop:
            raise BadRequest(f"start={start} is after stop={stop}")
        if start < 0 or stop > len(arr):
            raise IndexOutOfRange(f"range {start}:{stop} out of range for {len(arr)} samples")
        if inline and (stop - start) * arr.sample_nbytes > state.settings.inline_read_bytes:
            raise WouldBlock  # before np.arange builds a large index on the loop
        npy = wire.wants_npy(accept)
        return _respond(state, entry, [arr], np.arange(start, stop, dtype=np.int64),
                        served=requested(arr, dtype, npy), npy=npy, inline=inline)  # fmt: skip

    return await on_loop.answer(state, work)


def parse_indices(body: bytes, content_type: str, length: int, max_indices: int,
                  what: str = "this split") -> np.ndarray:  # fmt: skip
    """An index body (raw int64 or JSON), counted before it is parsed and bounds-checked against
    ``length`` rows of ``what``."""
    if content_type.split(";")[0].strip().lower() == wire.INDICES:
        if len(body) // 8 > max_indices:
            raise RequestTooLarge(f"{len(body) // 8} indices exceed the server's cap of "
                                  f"{max_indices} (FEATURESTORE_MAX_INDICES): split the batch")  # fmt: skip
        try:
            index = wire.decode_indices(body)
        except wire.WireFormatError as error:
            raise BadRequest(str(error)) from None
        wire.check_bounds(index, length, what)
        return index
    # JSON: commas bound the count, so a huge list is refused before json.loads builds it.
    if body.count(b",") + 1 > max_indices:
        raise RequestTooLarge(f"more than {max_indices} indices (FEATURESTORE_MAX_INDICES): "
                              "split the batch")  # fmt: skip
    doc = _load_index_json(body)
    if not isinstance(doc, dict) or set(doc) != {"indices"} or not isinstance(doc["indices"], list):
        raise BadRequest('body must be exactly {"indices": [<int>, ...]}')
    values = doc["indices"]
    if any(type(v) is not int for v in values):  # bools and floats are not indices
        raise BadRequest("indices must be a JSON list of integers")
    # Bounds on Python ints first: a huge index must be a 416, not an int64 overflow in numpy.
    if values and (min(values) < 0 or max(values) >= length):
        bad = next(i for i in values if not 0 <= i < length)
        raise IndexOutOfRange(f"index {bad} out of range for {what} with {length} rows")
    return np.array(values, dtype=np.int64)


def _load_index_json(body: bytes) -> Any:
    """The JSON document of an index body: one 400 line for anything that is not plain JSON
    (a nesting too deep for the parser, a key given twice: which one would count?)."""
    try:
        return json.loads(body, object_pairs_hook=_unique_keys)
    except _DuplicateKey as error:
        raise BadRequest(f"index body gives the key {error.key!r} more than once: give it once, "
                         'as {"indices": [<int>, ...]}') from None  # fmt: skip
    except RecursionError:
        raise BadRequest('index body nests too deeply: send {"indices": [<int>, ...]}, a flat '
                         "list of integers") from None  # fmt: skip
    except (ValueError, UnicodeDecodeError):
        raise BadRequest('body must be JSON {"indices": [...]} (or raw int64 with Content-Type '
                         f"{wire.INDICES})") from None  # fmt: skip


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise _DuplicateKey(key[:80])
        doc[key] = value
    return doc


async def _indexed(request: Request, dataset: str, encoder: str, split: str, labels: bool,
                   accept: str | None, dtype: str | None, *, samples: bool) -> Response:  # fmt: skip
    state = state_of(request)
    body = await request.body()  # capped by server/limits.py while it arrives

    def work(inline: bool) -> ArrayResponse:
        if inline and len(body) > _INLINE_BODY_BYTES:
            raise WouldBlock  # parsed in the pool
        entry = state.open_split(dataset, encoder, split, inline=inline)
        if samples:
            arrays = [entry.reader] + ([entry.reader.labels] if entry.reader.labels is not None else [])
        else:
            arrays = [_pick(entry, labels, dtype)]
        index = parse_indices(body, request.headers.get("content-type", ""), len(arrays[0]),
                              state.settings.max_indices)  # fmt: skip
        npy = not samples and wire.wants_npy(accept)
        served = requested(arrays[0], dtype, npy)
        if samples:
            return _respond(state, entry, arrays, index, served=served, media_type=wire.SAMPLES_MEDIA,
                            inline=inline)  # fmt: skip
        return _respond(state, entry, arrays, index, served=served, npy=npy, inline=inline)

    return await on_loop.answer(state, work)


@router.post(wire.BATCH, tags=["features"], response_class=ArrayResponse, status_code=200,
             responses=_DATA, openapi_extra=_INDEX_BODY)  # fmt: skip
async def batch_indices(request: Request, dataset: Name, encoder: Name, split: Name,
                        labels: Labels = False, accept: Accept = None, dtype: Dtype = None) -> Response:  # fmt: skip
    """Samples at ``indices`` (any order, duplicates allowed), gathered into one buffer."""
    return await _indexed(request, dataset, encoder, split, labels, accept, dtype, samples=False)


@router.post(wire.SAMPLES, tags=["features"], response_class=ArrayResponse, status_code=200,
             responses=_SAMPLES, openapi_extra=_INDEX_BODY)  # fmt: skip
async def samples(request: Request, dataset: Name, encoder: Name, split: Name,
                  dtype: Dtype = None) -> Response:  # fmt: skip
    """Features and labels of ``indices`` in one response: the features' bytes (``X-Shape``,
    ``X-Dtype``), then the labels' (``X-Labels-Shape``, ``X-Labels-Dtype``; absent, and no bytes,
    when the split has none); with ``?dtype=int8`` the scales last (``X-Scales-Shape``)."""
    return await _indexed(request, dataset, encoder, split, False, None, dtype, samples=True)


# ------------------------------------------------------------------ samples by id


_IDS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["ids"], "properties": {"ids": {"type": "array", "items": {"type": "string"}}}}}}}}


def parse_ids(body: bytes, max_indices: int) -> list[str]:
    """A by-id body ``{"ids": [<str>, ...]}``, counted before it is parsed."""
    if body.count(b",") + 1 > max_indices:
        raise RequestTooLarge(f"more than {max_indices} ids (FEATURESTORE_MAX_INDICES): split the request")
    try:
        doc = json.loads(body, object_pairs_hook=_unique_keys)
    except (_DuplicateKey, RecursionError, ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or set(doc) != {"ids"} or not isinstance(doc["ids"], list) \
            or any(type(v) is not str for v in doc["ids"]):
        raise BadRequest('body must be JSON {"ids": [<sample id>, ...]}: a list of strings')
    return doc["ids"]


@router.post(wire.BY_ID, tags=["features"], response_class=ArrayResponse, status_code=200,
             responses=_SAMPLES, openapi_extra=_IDS_BODY)  # fmt: skip
async def samples_by_id(request: Request, dataset: Name, encoder: Name, split: Name,
                        dtype: Dtype = None) -> ArrayResponse:  # fmt: skip
    """Features and labels of the samples named by ``ids`` (a split with sample ids, e.g. slide
    embeddings), in the order asked, framed as ``/samples`` answers; an unknown id is a 404."""
    state = state_of(request)
    body = await request.body()  # capped by server/limits.py while it arrives

    def work() -> ArrayResponse:
        entry = state.open_split(dataset, encoder, split)
        index = entry.reader.positions_of(parse_ids(body, state.settings.max_indices))
        arrays = [entry.reader] + ([entry.reader.labels] if entry.reader.labels is not None else [])
        return _respond(state, entry, arrays, index, served=requested(entry.reader, dtype),
                        media_type=wire.SAMPLES_MEDIA)  # fmt: skip

    return await run_in_threadpool(work)
