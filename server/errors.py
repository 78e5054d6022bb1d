"""Domain errors -> HTTP status codes, in one place.

Every error body is ``{"detail": <message>, "error": <class name>}``; ``detail`` is the SPEC's
contract, ``error`` lets the HTTP client raise an exception of the same class as a local read
would (``except SplitNotFound`` works for both sources).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from featurestore import errors as fse
from featurestore.format import wire

log = logging.getLogger("featurestore.server")


class BadRequest(fse.FeatureStoreError, ValueError):
    """A request the server understood but refuses (bad body, bad range, bad key)."""


class NotFound(fse.FeatureStoreError, LookupError):
    """A resource inside a split (labels, ids, a Zarr key) that does not exist."""


class ResponseTooLarge(fse.FeatureStoreError, ValueError):
    """The response would exceed ``FEATURESTORE_MAX_RESPONSE_BYTES``."""

    def __init__(self, message: str, *, max_response_bytes: int) -> None:
        super().__init__(message)
        self.max_response_bytes = max_response_bytes


class RangeNotSatisfiable(fse.FeatureStoreError, IndexError):
    """An HTTP ``Range`` outside a Zarr key's bytes."""

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size


class Unauthorized(fse.FeatureStoreError, PermissionError):
    pass


class RequestTooLarge(fse.FeatureStoreError, ValueError):
    """A request body or index list beyond the server's caps (checked before parsing)."""


class Busy(fse.FeatureStoreError, RuntimeError):
    """Too many response bytes in flight: 503 with ``Retry-After``."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


# First match in MRO order wins, so subclasses may override their parents.
STATUS: Mapping[type[BaseException], int] = {
    Unauthorized: 401,
    BadRequest: 400,
    fse.InvalidName: 400,
    fse.InvalidIndices: 400,
    NotFound: 404,
    fse.DatasetNotFound: 404,
    fse.EncoderNotFound: 404,
    fse.SplitNotFound: 404,
    fse.BagNotFound: 404,
    fse.SampleNotFound: 404,
    # a dense route on a bag split, a bag route on a dense split: no such resource there
    fse.WrongSplitKind: 404,
    fse.IncompleteSplit: 409,
    # a read dtype (?dtype=) the split does not offer
    fse.DtypeMismatch: 400,
    fse.AttentionNotFound: 404,
    fse.StaleAttention: 409,
    # overwritten while this request read it (a data route answers the retryable 409 instead)
    fse.SplitChanged: 409,
    ResponseTooLarge: 413,
    RequestTooLarge: 413,
    Busy: 503,
    fse.IndexOutOfRange: 416,
    RangeNotSatisfiable: 416,
    # The server's own store is missing or unreadable: not the caller's fault.
    fse.StoreNotFound: 503,
    fse.NotAFeatureStore: 503,
    fse.UnsupportedFormatVersion: 503,
    # The object storage behind the store is away (an outage past the retries) or refuses the
    # server: retryable, a load balancer's "unavailable", not the caller's fault either.
    fse.StorageUnavailable: 503,
    fse.StoreUnreachable: 503,
    fse.StorageAccessDenied: 503,
    # A complete split whose chunks are damaged or missing: the store is broken (see _DAMAGED).
    fse.CorruptChunk: 500,
    fse.MissingChunks: 500,
}

_DAMAGED = "the server's store is damaged (not a problem with the request): {}"
STORAGE_RETRY_AFTER_S = 5  # an object store restarting takes seconds


def status_for(error: BaseException) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


def error_response(status: int, detail: object, error: str, headers: dict[str, str] | None = None
                   ) -> JSONResponse:
    if isinstance(detail, str):
        detail = wire.redact(detail)
    return JSONResponse(wire.error_body(detail, error), status_code=status, headers=headers)


def relative_to_store(message: str, private_paths: Sequence[str]) -> str:
    """``message`` with the store's own location taken out: keys inside it become relative
    (``ds/enc/split/features/c/3/0/0``), the root itself "the store". Callers of a server must not
    learn where its store lives; the server's log keeps the full message."""
    for root in private_paths:  # longest first: a root inside another is not cut in half
        message = message.replace(root + "/", "").replace(root, "the store")
    return message


def render_error(exc: fse.FeatureStoreError, private_paths: Sequence[str] = ()) -> JSONResponse:
    """The one translation of a domain error into a response (also used by the auth middleware).
    ``private_paths``: the store's paths and URL, never shown (see :func:`relative_to_store`)."""
    status = status_for(exc)
    headers: dict[str, str] = {}
    message = relative_to_store(str(exc), private_paths)
    if isinstance(exc, (fse.CorruptChunk, fse.MissingChunks)):
        message = _DAMAGED.format(message)
    extra: dict[str, object] = {}
    if isinstance(exc, RangeNotSatisfiable):
        headers["Content-Range"] = f"bytes */{exc.size}"
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(exc, ResponseTooLarge):
        extra["max_response_bytes"] = exc.max_response_bytes
    # Busy (503), and a split that changed while it was read (409, server/state.py): ask again.
    if (retry_after := getattr(exc, "retry_after", None)) is not None:
        headers["Retry-After"] = str(retry_after)
    elif isinstance(exc, (fse.StorageUnavailable, fse.StoreUnreachable)):
        headers["Retry-After"] = str(STORAGE_RETRY_AFTER_S)
    content = wire.error_body(wire.redact(message), type(exc).__name__, **extra)
    return JSONResponse(content, status_code=status, headers=headers or None)


async def _feature_store_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, fse.FeatureStoreError):  # pragma: no cover - registered for it
        return await _unexpected(request, exc)
    if status_for(exc) >= 500:
        log.error("%s %s failed: %s", request.method, request.url.path, wire.redact(str(exc)))
    state = getattr(request.app.state, "featurestore", None)
    return render_error(exc, getattr(state, "private_paths", ()))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    # FastAPI answers 422 by default; SPEC has one code for a malformed request: 400.
    problems = []
    for item in exc.errors() if isinstance(exc, RequestValidationError) else ():
        where = ".".join(str(part) for part in item.get("loc", ()))
        problems.append(f"{where}: {item.get('msg', 'invalid')}")
    detail = "bad request: " + "; ".join(problems) if problems else "bad request"
    return error_response(400, detail, "BadRequest")


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, StarletteHTTPException):  # pragma: no cover - registered for it
        return await _unexpected(request, exc)
    return error_response(exc.status_code, exc.detail, "HTTPError", dict(exc.headers or {}))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # A bug, never bad input: keep the server up, log the traceback, say little to the caller.
    log.error("%s %s crashed", request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal server error ({type(exc).__name__})", "InternalError")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(fse.FeatureStoreError, _feature_store_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
