"""Listing, metadata and data routes (``/v1/...``), as fixed by SPEC.md.

Handlers are plain ``def``: FastAPI runs them in its thread pool, where the blocking store reads
(memory-mapped files, or fsspec round trips) do not stall the event loop. They raise domain
errors only; ``server/errors.py`` turns those into status codes.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Body, Header, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from featurestore.errors import IndexOutOfRange
from featurestore.format import wire
from featurestore.format.names import NAME_PATTERN, validate_name
from server.buffers import MIN_POOLED
from server.errors import BadRequest, NotFound, ResponseTooLarge
from server.responses import ArrayResponse
from server.state import StoreState

router = APIRouter()

Name = Annotated[str, Path(description=f"matches {NAME_PATTERN}")]
Labels = Annotated[bool, Query(description="labels instead of features")]
Accept = Annotated[str | None, Header(description=f"{wire.NPY} for an .npy body")]
FEATURE = "/v1/features/{dataset}/{encoder}/{split}"


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    indices: list[StrictInt] = Field(description="sample indices, any order, duplicates allowed")


def _state(request: Request) -> StoreState:
    state: StoreState = request.app.state.featurestore
    return state


def _array(request: Request, dataset: str, encoder: str, split: str, labels: bool) -> Any:
    arr = _state(request).open(dataset, encoder, split)
    if not labels:
        return arr
    if arr.labels is None:
        raise NotFound(f"split {dataset}/{encoder}/{split} has no labels")
    return arr.labels


def _check_size(request: Request, arr: Any, rows: int) -> None:
    cap = _state(request).settings.max_response_bytes
    nbytes = rows * int(arr.sample_nbytes)
    if nbytes > cap:
        per_request = max(cap // max(int(arr.sample_nbytes), 1), 0)
        hint = (
            f"request at most {per_request} samples at a time and concatenate"
            if per_request
            else "one sample is larger than the cap: raise FEATURESTORE_MAX_RESPONSE_BYTES"
        )
        raise ResponseTooLarge(
            f"response of {rows} samples x {arr.sample_nbytes} bytes = {nbytes} bytes exceeds "
            f"the server's cap of {cap} bytes (FEATURESTORE_MAX_RESPONSE_BYTES); {hint}",
            max_response_bytes=cap,
        )


def _respond(request: Request, arr: Any, index: np.ndarray, accept: str | None,
             *, single: bool = False) -> ArrayResponse:  # fmt: skip
    """Gather rows ``index`` into one (pooled, for big answers) buffer and wrap it, no copy."""
    state = _state(request)
    shape = (len(index), *arr.sample_shape)
    block = None
    if len(index) * int(arr.sample_nbytes) >= MIN_POOLED:
        block = state.buffers.acquire(len(index) * int(arr.sample_nbytes))
        try:
            data = arr.read_numpy(index, out=state.buffers.array(block, shape, arr.numpy_dtype))
        except BaseException:
            state.buffers.release(block)
            raise
    else:
        data = arr.read_numpy(index)
    release = None
    if block is not None:
        pooled = block

        def release() -> None:
            state.buffers.release(pooled)

        del block
    return ArrayResponse(
        data[0] if single else data,
        arr.dtype,
        npy=wire.wants_npy(accept),
        chunk_bytes=state.settings.send_chunk_bytes,
        on_sent=release,
    )


@router.get("/healthz", tags=["service"])
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/v1/datasets", tags=["listing"])
def datasets(request: Request) -> dict[str, list[str]]:
    return {"datasets": list(_state(request).store.datasets())}


@router.get("/v1/datasets/{dataset}/encoders", tags=["listing"])
def encoders(request: Request, dataset: Name) -> dict[str, Any]:
    validate_name(dataset, "dataset")
    return {"dataset": dataset, "encoders": list(_state(request).store.encoders(dataset))}


@router.get("/v1/datasets/{dataset}/encoders/{encoder}/splits", tags=["listing"])
def splits(request: Request, dataset: Name, encoder: Name) -> dict[str, Any]:
    validate_name(dataset, "dataset")
    validate_name(encoder, "encoder")
    store = _state(request).store
    names = list(store.splits(dataset, encoder))
    status = {name: store.split_status(dataset, encoder, name) for name in names}
    return {"dataset": dataset, "encoder": encoder, "splits": names, "status": status}


@router.get(FEATURE, tags=["features"])
def metadata(request: Request, dataset: Name, encoder: Name, split: Name) -> dict[str, Any]:
    """The split's metadata (see docs/FORMAT.md)."""
    result: dict[str, Any] = wire.json_safe(_state(request).open(dataset, encoder, split).metadata)
    return result


def _describe(arr: Any) -> dict[str, Any]:
    return {
        "shape": list(arr.shape),
        "dtype": arr.dtype,
        "storage_dtype": str(np.dtype(arr.numpy_dtype)),
        "sample_nbytes": int(arr.sample_nbytes),
        "chunk_rows": int(arr.chunk_rows),
    }


@router.get(FEATURE + "/arrays", tags=["features"])
def arrays(request: Request, dataset: Name, encoder: Name, split: Name) -> dict[str, Any]:
    """Shapes and dtypes of the split's arrays, and the byte cap: what a client needs to read."""
    arr = _state(request).open(dataset, encoder, split)
    return {
        "features": _describe(arr),
        "labels": None if arr.labels is None else _describe(arr.labels),
        "has_ids": arr.ids is not None,
        "max_response_bytes": _state(request).settings.max_response_bytes,
    }


@router.get(FEATURE + "/ids", tags=["features"])
def ids(request: Request, dataset: Name, encoder: Name, split: Name) -> dict[str, Any]:
    arr = _state(request).open(dataset, encoder, split)
    if arr.ids is None:
        raise NotFound(f"split {dataset}/{encoder}/{split} has no sample ids")
    return {"ids": list(arr.ids)}


_DATA: dict[int | str, dict[str, Any]] = {"200": {"content": {wire.OCTET_STREAM: {}, wire.NPY: {}}, "description": "raw bytes"}}


@router.get(FEATURE + "/items/{index}", tags=["features"], response_class=ArrayResponse, status_code=200,
            responses=_DATA)  # fmt: skip
def item(
    request: Request, dataset: Name, encoder: Name, split: Name, index: int,
    labels: Labels = False, accept: Accept = None,
) -> ArrayResponse:  # fmt: skip
    """One sample: ``X-Shape`` is the sample shape (``256,384``)."""
    arr = _array(request, dataset, encoder, split, labels)
    if not 0 <= index < len(arr):
        raise IndexOutOfRange(f"index {index} out of range for {len(arr)} samples")
    _check_size(request, arr, 1)
    return _respond(request, arr, np.array([index], dtype=np.int64), accept, single=True)


@router.get(FEATURE + "/batch", tags=["features"], response_class=ArrayResponse, status_code=200,
            responses=_DATA)  # fmt: skip
def batch_range(
    request: Request, dataset: Name, encoder: Name, split: Name,
    start: Annotated[int, Query(description="first index")],
    stop: Annotated[int, Query(description="one past the last index")],
    labels: Labels = False, accept: Accept = None,
) -> ArrayResponse:  # fmt: skip
    """Samples ``start:stop`` (a contiguous read)."""
    arr = _array(request, dataset, encoder, split, labels)
    if start > stop:
        raise BadRequest(f"start={start} is after stop={stop}")
    if start < 0 or stop > len(arr):
        raise IndexOutOfRange(f"range {start}:{stop} out of range for {len(arr)} samples")
    _check_size(request, arr, stop - start)
    return _respond(request, arr, np.arange(start, stop, dtype=np.int64), accept)


@router.post(FEATURE + "/batch", tags=["features"], response_class=ArrayResponse, status_code=200,
             responses=_DATA)  # fmt: skip
def batch_indices(
    request: Request, dataset: Name, encoder: Name, split: Name,
    body: Annotated[BatchRequest, Body()],
    labels: Labels = False, accept: Accept = None,
) -> ArrayResponse:  # fmt: skip
    """Samples at ``indices`` (any order, duplicates allowed), gathered into one buffer."""
    arr = _array(request, dataset, encoder, split, labels)
    indices = body.indices
    n = len(arr)
    # Bounds are checked on Python ints first: a huge index must be a 416, not an int64
    # overflow inside numpy.
    if indices and (min(indices) < 0 or max(indices) >= n):
        bad = next(i for i in indices if not 0 <= i < n)
        raise IndexOutOfRange(f"index {bad} out of range for {n} samples")
    _check_size(request, arr, len(indices))
    return _respond(request, arr, np.asarray(indices, dtype=np.int64), accept)
