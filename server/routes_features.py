"""Listing, metadata and split-structure routes (``/v1/...``), as fixed by SPEC.md; the data
routes are in ``server/routes_data.py``.

Handlers are plain ``def`` (FastAPI runs them in its thread pool, where blocking store reads do
not stall the event loop), except ``/healthz``, which answers on the event loop itself so that
it keeps answering while every pool thread is busy. They raise domain errors only;
``server/errors.py`` turns those into status codes. Route strings come from
``featurestore/format/wire.py``, the one wire contract.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import unquote

from fastapi import APIRouter, Path, Request

from featurestore.errors import FeatureStoreError
from featurestore.format import wire
from featurestore.format.names import NAME_PATTERN, validate_name
from server.errors import NotFound, relative_to_store
from server.state import StoreState

router = APIRouter()

Name = Annotated[str, Path(description=f"matches {NAME_PATTERN}")]


def state_of(request: Request) -> StoreState:
    state: StoreState = request.app.state.featurestore
    return state


@router.get(wire.HEALTHZ, tags=["service"])
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(wire.DATASETS, tags=["listing"])
def datasets(request: Request) -> dict[str, list[str]]:
    return {"datasets": list(state_of(request).store.datasets())}


@router.get(wire.ENCODERS, tags=["listing"])
def encoders(request: Request, dataset: Name) -> dict[str, Any]:
    validate_name(dataset, "dataset")
    return {"dataset": dataset, "encoders": list(state_of(request).store.encoders(dataset))}


@router.get(wire.SPLITS, tags=["listing"])
def splits(request: Request, dataset: Name, encoder: Name) -> dict[str, Any]:
    validate_name(dataset, "dataset")
    validate_name(encoder, "encoder")
    state = state_of(request)
    store = state.store
    names = list(store.splits(dataset, encoder))
    status, kind, unreadable = {}, {}, {}
    for name in names:
        try:
            meta = store.split_info(dataset, encoder, name)
        except FeatureStoreError as error:  # one damaged document must not hide its siblings
            status[name] = "unreadable"
            unreadable[name] = wire.redact(relative_to_store(str(error), state.private_paths))
            continue
        # "dense" (read through /v1/features/...) or "bags" (through /v1/bags/...).
        status[name], kind[name] = meta.status, meta.kind
    return {"dataset": dataset, "encoder": encoder, "splits": names, "status": status, "kind": kind,
            **({"unreadable": unreadable} if unreadable else {})}


@router.get(wire.SPLIT, tags=["features"])
def metadata(request: Request, dataset: Name, encoder: Name, split: Name) -> dict[str, Any]:
    """The split's metadata (see docs/FORMAT.md)."""
    result: dict[str, Any] = wire.json_safe(state_of(request).open(dataset, encoder, split).metadata)
    return result


def structure_of(arr: Any, max_response_bytes: int) -> wire.SplitStructure:
    labels = arr.labels
    return wire.SplitStructure(
        features=wire.ArrayStructure.of(arr),
        labels=None if labels is None else wire.ArrayStructure.of(labels),
        # From the metadata ("ids": whether ids/ exists), never by reading every id.
        has_ids=bool(arr.metadata.get("ids", False)),
        max_response_bytes=max_response_bytes,
        metadata=arr.metadata,
    )


@router.get(wire.ARRAYS, tags=["features"])
def arrays(request: Request, dataset: Name, encoder: Name, split: Name) -> dict[str, Any]:
    """Everything a client needs to read the split, in one request: shapes, dtypes and chunking
    of ``features`` and ``labels`` (or ``null``), ``has_ids``, the byte cap, the generation and
    the metadata (``wire.SplitStructure``)."""
    state = state_of(request)
    arr = state.open(dataset, encoder, split)
    return structure_of(arr, state.settings.max_response_bytes).to_json()


@router.get(wire.IDS, tags=["features"])
def ids(request: Request, dataset: Name, encoder: Name, split: Name) -> dict[str, Any]:
    arr = state_of(request).open(dataset, encoder, split)
    if not arr.metadata.get("ids"):
        raise NotFound(f"split {dataset}/{encoder}/{split} has no sample ids")
    return {"ids": list(arr.ids or [])}


@router.api_route("/v1/{rest:path}", methods=["GET", "POST", "HEAD"], include_in_schema=False)
def unknown(request: Request, rest: str) -> None:
    """No route matched. A bad name (``a%2Fb`` decodes to a slash and so lands here) is an
    ``InvalidName`` (400) naming it, not a bare 404."""
    raw = (request.scope.get("raw_path") or b"").decode("latin-1").split("?")[0]
    segments = [unquote(part) for part in raw.split("/")[2:]]  # after "", "v1"
    names = {"features": (1, 2, 3), "bags": (1, 2, 3), "datasets": (1, 3)}.get(segments[0] if segments else "", ())
    for position in names:
        if position < len(segments):
            validate_name(segments[position], "name")
    raise NotFound(f"no route /v1/{rest[:200]}: see /docs for the routes")
