"""Binary data responses: gathered numpy buffers, sent without copying them again.

``ArrayResponse`` hands uvicorn memoryview slices of the arrays themselves (no ``tobytes()``), in
pieces of ``chunk_bytes`` (``FEATURESTORE_SEND_CHUNK_BYTES``) with ``more_body=True``. Pieces
rather than one 12 MiB body because the server's transport copies whatever the socket does not
take at once (Python 3.11's asyncio keeps the unsent tail of a ``write`` in its own bytearray),
and uvicorn's flow control (it awaits ``drain()`` before each ``send``) then keeps only part of a
piece buffered; see docs/SERVER.md for the measurements.

Several arrays may follow each other in one body (features, then labels: the
:data:`~featurestore.format.wire.SAMPLES_MEDIA` framing); each is described by its own pair of
shape/dtype headers. ``FileRangeResponse`` streams a ``/zarr`` key's bytes the same way, read a
piece at a time (never the whole key in memory).

A client that stops reading must not hold the in-flight budget (and the memory behind it) for
good: every message goes through :class:`BoundedSend`, which gives each ``send()`` at most
``FEATURESTORE_SEND_TIMEOUT_S`` (uvicorn's ``send`` waits, with no limit of its own, until the
transport's buffer drains below its low-water mark); past that the connection is aborted, so the
unsent bytes the transport still holds are freed too, and the response's reservation is given
back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from featurestore.format import wire

log = logging.getLogger("featurestore.server")

_timeout = getattr(asyncio, "timeout", None)  # Python >= 3.11

#: Where ``server.app`` puts the connection's ``abort()`` in the ASGI scope (uvicorn only).
ABORT_KEY = "featurestore.abort"


def transport_abort(send: Send) -> Callable[[], None] | None:
    """The ``abort()`` of the connection behind uvicorn's own ``send`` (a bound method of its
    request cycle, which holds the asyncio transport), or None under any other server.

    ``transport.close()``, which uvicorn calls when an app gives up mid-body, waits to flush the
    transport's buffer first, i.e. forever for a peer that never reads; ``abort()`` drops it."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    abort = getattr(transport, "abort", None)
    return abort if callable(abort) else None


class ClientStalled(Exception):
    """The client took no bytes for ``FEATURESTORE_SEND_TIMEOUT_S``: its connection was dropped."""


class BoundedSend:
    """``send`` with a deadline per message; on timeout the connection is aborted."""

    def __init__(self, scope: Scope, send: Send, timeout_s: float | None) -> None:
        self._send = send
        self._timeout = timeout_s or None  # 0 or None: wait as long as the client takes
        self._abort: Callable[[], None] | None = (scope.get("extensions") or {}).get(ABORT_KEY)

    async def __call__(self, message: Message) -> None:
        try:
            if _timeout is not None and self._timeout is not None:
                # A deadline on this task itself (a timer, no new task per message as wait_for
                # makes: three per response, ~10% of a single item's server time).
                async with _timeout(self._timeout):
                    await self._send(message)
            else:
                await asyncio.wait_for(self._send(message), self._timeout)
        except asyncio.TimeoutError:
            if self._abort is not None:
                self._abort()
                # Let the transport report the lost connection, so that uvicorn sees a
                # disconnected client and not an app that returned mid-body.
                await asyncio.sleep(0)
            raise ClientStalled(
                f"client took no bytes for {self._timeout} s (FEATURESTORE_SEND_TIMEOUT_S): "
                "connection dropped"
            ) from None


async def send_pieces(scope: Scope, send: Send, start: Message, pieces: Any, timeout_s: float) -> None:
    """Send ``start``, then each body piece ``pieces`` yields (an async iterator), then the
    closing empty message; a client that stalls is dropped and logged, not raised."""
    bounded = BoundedSend(scope, send, timeout_s)
    try:
        await bounded(start)
        async for piece in pieces:
            await bounded({"type": "http.response.body", "body": piece, "more_body": True})
        # The closing empty message waits (uvicorn's flow control) until the transport's buffer
        # has drained into the socket: only then are this response's bytes really out of the
        # process, and only then is its in-flight reservation given back.
        await bounded({"type": "http.response.body", "body": b"", "more_body": False})
    except ClientStalled as stalled:
        log.warning("%s %s: %s", scope.get("method"), scope.get("path"), stalled)


def _little_endian(array: np.ndarray, logical_dtype: str) -> np.ndarray:
    array = np.ascontiguousarray(array)
    # Data on the wire is little-endian; the reader already returns little-endian storage
    # dtypes, so this converts (copies) only if someone hands us a big-endian array.
    wanted = wire.storage_dtype(logical_dtype)
    return array if array.dtype == wanted else array.astype(wanted)


class ArrayResponse(Response):
    """``parts``: ``(array, logical dtype, shape header, dtype header)`` sent back to back."""

    def __init__(
        self,
        parts: Sequence[tuple[np.ndarray, str, str, str]],
        *,
        media_type: str = wire.OCTET_STREAM,
        npy: bool = False,
        chunk_bytes: int = 4 << 20,
        on_sent: Callable[[], None] | None = None,
        send_timeout_s: float = 0,
    ) -> None:
        arrays = [_little_endian(array, dtype) for array, dtype, _, _ in parts]
        if npy and len(arrays) != 1:
            raise ValueError("an .npy body holds exactly one array")
        self._arrays = arrays  # keep the buffers alive while the views are sent
        self._prefix = wire.npy_header(arrays[0].shape, arrays[0].dtype) if npy else b""
        self._chunk_bytes = chunk_bytes
        self._on_sent = on_sent  # e.g. give the in-flight bytes back
        self._send_timeout_s = send_timeout_s
        headers = {"content-length": str(len(self._prefix) + sum(a.nbytes for a in arrays))}
        for array, (_, dtype, shape_header, dtype_header) in zip(arrays, parts, strict=True):
            headers[shape_header] = wire.encode_shape(array.shape)
            headers[dtype_header] = dtype
        super().__init__(content=None, status_code=200, headers=headers,
                         media_type=wire.NPY if npy else media_type)  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}

        async def pieces() -> Any:
            views = [a.reshape(-1).view(np.uint8).data for a in self._arrays if a.nbytes]
            if self._prefix:
                views.insert(0, memoryview(self._prefix))
            step = self._chunk_bytes
            for view in views:
                for offset in range(0, view.nbytes, step):
                    yield view[offset : offset + step]

        def done() -> None:
            # Every view of the buffers is gone (the generator is finished or closed) before
            # they go back to their pool.
            self._arrays = []
            if self._on_sent is not None:
                on_sent, self._on_sent = self._on_sent, None
                on_sent()

        body = pieces()
        try:
            await send_pieces(scope, send, start, body, self._send_timeout_s)
        finally:
            await body.aclose()
            done()


class FileRangeResponse(Response):
    """Bytes ``[start, stop)`` of one stored value, read and sent ``chunk_bytes`` at a time.

    ``read(offset, size)`` returns up to ``size`` bytes at ``offset`` (run in the thread pool);
    ``close()`` runs once at the end. The value's first piece is read by the caller (so a
    missing key is a 404 before any header goes out) and passed as ``first``.
    """

    def __init__(self, read: Callable[[int, int], bytes], close: Callable[[], None], *,
                 start: int, stop: int, first: bytes, status_code: int, headers: dict[str, str],
                 media_type: str, chunk_bytes: int, send_timeout_s: float = 0,
                 on_sent: Callable[[], None] | None = None) -> None:  # fmt: skip
        super().__init__(content=None, status_code=status_code,
                         headers={**headers, "content-length": str(stop - start)},
                         media_type=media_type)  # fmt: skip
        self._read, self._close = read, close
        self._start, self._stop, self._first = start, stop, first
        self._chunk_bytes = chunk_bytes
        self._send_timeout_s = send_timeout_s
        self._on_sent = on_sent

    async def _pieces(self) -> Any:
        offset = self._start + len(self._first)
        first, self._first = self._first, b""
        yield first
        while offset < self._stop:
            piece = await run_in_threadpool(self._read, offset, min(self._chunk_bytes, self._stop - offset))
            if not piece:  # the value shrank under us (replaced): the body cannot be completed
                raise OSError(f"stored value ended at byte {offset} of {self._stop}")
            offset += len(piece)
            yield piece

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        body = self._pieces()
        try:
            await send_pieces(scope, send, start, body, self._send_timeout_s)
        finally:
            await body.aclose()
            self._close()
            if self._on_sent is not None:
                on_sent, self._on_sent = self._on_sent, None
                on_sent()


def single(array: np.ndarray, logical_dtype: str, *, npy: bool = False, chunk_bytes: int = 4 << 20,
           on_sent: Callable[[], None] | None = None, send_timeout_s: float = 0) -> ArrayResponse:  # fmt: skip
    """One array: ``X-Shape``/``X-Dtype``, octet-stream or ``.npy``."""
    return ArrayResponse([(array, logical_dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER)], npy=npy,
                         chunk_bytes=chunk_bytes, on_sent=on_sent,
                         send_timeout_s=send_timeout_s)  # fmt: skip
