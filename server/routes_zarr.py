"""``GET /zarr/{key}``: the store's raw Zarr key space, read-only, with HTTP ``Range``.

This is what lets any Zarr v3 client open the store through the server, e.g. zarr-python with
``zarr.open_group("http://host:8000/zarr", mode="r")`` over fsspec's HTTPFileSystem.

Safety: a key is a ``/``-joined list of segments of ``[A-Za-z0-9._-]`` that are neither ``.``
nor ``..``, and the raw (undecoded) request path may hold no ``%`` escape, so neither ``..`` nor
``%2e%2e`` / ``%2f`` / ``%5c`` can climb out of the root. On a local store the resolved real path
must also stay under the root's real path, so a symlink inside the store cannot leak files.
Hidden names (a leading ``.``) and writers' temporary files (``.tmp``) are no keys: 404.

Bodies: a key's bytes are charged against ``FEATURESTORE_MAX_INFLIGHT_BYTES`` like every ``/v1``
data body and streamed ``FEATURESTORE_SEND_CHUNK_BYTES`` at a time
(:class:`~server.responses.FileRangeResponse`), never read whole into memory; a local key is
read through one open file descriptor, so a value replaced meanwhile (writers rename) is still
sent whole from the version that was opened.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from server.errors import BadRequest, NotFound, RangeNotSatisfiable, ResponseTooLarge
from server.responses import FileRangeResponse
from server.state import StoreState

router = APIRouter()

_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,255}")
_RANGE = re.compile(r"bytes=([0-9]*)-([0-9]*)")
_MAX_KEY = 1024


def validate_key(key: str, raw_path: bytes) -> str:
    if b"%" in raw_path or "\\" in key:
        raise BadRequest("Zarr keys are plain [A-Za-z0-9._-] segments; escapes are refused")
    if not key or len(key) > _MAX_KEY:
        raise BadRequest(f"bad Zarr key {key[:80]!r}")
    for segment in key.split("/"):
        if segment in (".", "..") or _SEGMENT.fullmatch(segment) is None:
            raise BadRequest(f"bad Zarr key {key[:80]!r}: segment {segment[:80]!r} is not allowed")
    for segment in key.split("/"):
        if _hidden(segment):
            raise NotFound(f"no Zarr key {key!r}")
    return key


def _hidden(segment: str) -> bool:
    """Not part of the Zarr key space: dotfiles and writers' temporary files (``.x.tmp``), which
    the store's own listings skip too."""
    return segment.startswith(".") or segment.endswith(".tmp")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(start, stop)`` for a single satisfiable byte range, None to send the whole key.

    Per RFC 9110 section 14.2 a server may ignore a Range it does not support (other units,
    several ranges): those get the whole key. A malformed ``bytes=`` range is a 400 and a
    well-formed one that starts past the end a 416; never a 500, however many digits a number
    has (Python refuses to parse ints of more than 4300 digits, so lengths are compared first).
    """
    if not header:
        return None
    text = header.strip()
    unit, sep, spec = text.partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None  # another unit: ignore, as the RFC says
    if "," in spec:
        return None  # several ranges: not supported, the whole key instead (allowed by the RFC)
    match = _RANGE.fullmatch("bytes=" + spec.strip())
    if match is None:
        raise BadRequest(f"malformed Range header {text[:60]!r}: use bytes=START-END, "
                         "bytes=START- or bytes=-SUFFIX")  # fmt: skip
    first, last = match.groups()
    if first == "" and last == "":
        raise BadRequest(f"malformed Range header {text[:60]!r}: no positions")
    if first == "":  # suffix: the last N bytes
        length = _bounded(last, size)
        if length == 0:
            raise RangeNotSatisfiable(f"empty suffix range {text[:60]!r}", size=size)
        return max(size - length, 0), size
    start = _bounded(first, size)
    stop = size if last == "" else min(_bounded(last, size) + 1, size)
    if last != "" and _bounded(last, size) < start:
        raise BadRequest(f"malformed Range header {text[:60]!r}: the end is before the start")
    if start >= size:
        raise RangeNotSatisfiable(
            f"range {text[:60]!r} starts beyond the key's {size} bytes", size=size
        )
    return start, stop


def _bounded(digits: str, size: int) -> int:
    """``int(digits)``, or ``size + 1`` for any number too long to matter (no int parse)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else size + 1


def _resolve(state: StoreState, key: str) -> str:
    path = f"{state.root}/{key}"
    if _is_local(state.fs):
        root = state.real_root
        real = os.path.realpath(path)
        if real != root and not real.startswith(root + os.sep):
            raise NotFound(f"no Zarr key {key!r}")
        return real
    return path


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return "file" in protocol or "local" in protocol


def _opener(state: StoreState, path: str) -> tuple[Callable[[int, int], bytes], Callable[[], None]]:
    """``(read(offset, size), close())`` over one value. Locally one file descriptor serves every
    piece (positional reads, no shared offset); elsewhere each piece is a ranged GET."""
    if _is_local(state.fs):
        fd = os.open(path, os.O_RDONLY)
        return (lambda offset, size: os.pread(fd, size, offset)), (lambda: os.close(fd))
    return (lambda offset, size: state.fs.cat_file(path, start=offset, end=offset + size)), (lambda: None)


@router.get("/zarr/{key:path}", tags=["zarr"], responses={206: {"description": "partial"}})
def zarr_key(request: Request, key: str) -> Response:
    """One key of the store (``zarr.json``, ``<dataset>/<encoder>/<split>/features/c/0/0/0``)."""
    state: StoreState = request.app.state.featurestore
    key = validate_key(key, request.scope.get("raw_path") or request.url.path.encode())
    path = _resolve(state, key)
    try:
        info = state.fs.info(path)
    except OSError:  # missing, a path through a file, unreadable: all "no such key"
        raise NotFound(f"no Zarr key {key!r}") from None
    if info.get("type") != "file":
        raise NotFound(f"no Zarr key {key!r} (a directory)")
    size = int(info["size"])
    byte_range = parse_range(request.headers.get("range"), size)
    start, stop = byte_range if byte_range is not None else (0, size)
    cap = state.settings.max_response_bytes
    if stop - start > cap:
        raise ResponseTooLarge(
            f"Zarr key {key!r} range of {stop - start} bytes exceeds the server's cap of {cap} "
            "bytes (FEATURESTORE_MAX_RESPONSE_BYTES); request it in Range pieces of at most "
            f"{cap} bytes",
            max_response_bytes=cap,
        )
    headers = {"Accept-Ranges": "bytes"}
    status = 200
    if byte_range is not None:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        status = 206
    media = "application/json" if key.endswith(".json") else "application/octet-stream"
    if request.method == "HEAD":  # fsspec's HTTPFileSystem asks for sizes this way: no read
        headers["Content-Length"] = str(stop - start)
        return Response(b"", status_code=status, media_type=media, headers=headers)
    return _stream(state, key, path, start, stop, status=status, headers=headers, media=media)


def _stream(state: StoreState, key: str, path: str, start: int, stop: int, *, status: int,
            headers: dict[str, str], media: str) -> FileRangeResponse:  # fmt: skip
    """The body, charged against the in-flight budget until its last byte left (or the client
    was dropped); its first piece is read here, so a key that vanished is still a 404."""
    nbytes = stop - start
    state.reserve(nbytes)
    close: Callable[[], None] = lambda: None  # noqa: E731
    try:
        read, close = _opener(state, path)
        first = read(start, min(state.settings.send_chunk_bytes, nbytes)) if nbytes else b""
        if len(first) < min(state.settings.send_chunk_bytes, nbytes):
            raise FileNotFoundError(path)  # replaced by a shorter value since its size was read
    except BaseException as error:
        close()
        state.release(nbytes)
        if isinstance(error, OSError):
            raise NotFound(f"no Zarr key {key!r}") from None
        raise
    return FileRangeResponse(read, close, start=start, stop=stop, first=first, status_code=status,
                             headers=headers, media_type=media,
                             chunk_bytes=state.settings.send_chunk_bytes,
                             send_timeout_s=state.settings.send_timeout_s,
                             on_sent=lambda: state.release(nbytes))  # fmt: skip


# HEAD (sizes for fsspec's HTTPFileSystem) answers from the same handler; kept out of the OpenAPI
# schema, where it would duplicate the GET operation.
router.add_api_route("/zarr/{key:path}", zarr_key, methods=["HEAD"], include_in_schema=False)
