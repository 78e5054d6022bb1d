"""Binary data responses: gathered numpy buffers, sent without copying them again.

``ArrayResponse`` hands uvicorn memoryview slices of the arrays themselves (no ``tobytes()``), in
pieces of ``chunk_bytes`` (``FEATURESTORE_SEND_CHUNK_BYTES``) with ``more_body=True``. Pieces
rather than one 12 MiB body because the server's transport copies whatever the socket does not
take at once (Python 3.11's asyncio keeps the unsent tail of a ``write`` in its own bytearray),
and uvicorn's flow control (it awaits ``drain()`` before each ``send``) then keeps only part of a
piece buffered; see docs/SERVER.md for the measurements.

Several arrays may follow each other in one body (features, then labels: the
:data:`~featurestore.format.wire.SAMPLES_MEDIA` framing); each is described by its own pair of
shape/dtype headers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from featurestore.format import wire


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
    ) -> None:
        arrays = [_little_endian(array, dtype) for array, dtype, _, _ in parts]
        if npy and len(arrays) != 1:
            raise ValueError("an .npy body holds exactly one array")
        self._arrays = arrays  # keep the buffers alive while the views are sent
        self._prefix = wire.npy_header(arrays[0].shape, arrays[0].dtype) if npy else b""
        self._chunk_bytes = chunk_bytes
        self._on_sent = on_sent  # e.g. give the in-flight bytes back
        headers = {"content-length": str(len(self._prefix) + sum(a.nbytes for a in arrays))}
        for array, (_, dtype, shape_header, dtype_header) in zip(arrays, parts, strict=True):
            headers[shape_header] = wire.encode_shape(array.shape)
            headers[dtype_header] = dtype
        super().__init__(content=None, status_code=200, headers=headers,
                         media_type=wire.NPY if npy else media_type)  # fmt: skip

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            views = [a.reshape(-1).view(np.uint8).data for a in self._arrays if a.nbytes]
            if self._prefix:
                views.insert(0, memoryview(self._prefix))
            step = self._chunk_bytes
            pieces = [(v, o) for v in views for o in range(0, v.nbytes, step)]
            for view, offset in pieces:
                await send({"type": "http.response.body", "body": view[offset : offset + step],
                            "more_body": True})  # fmt: skip
            # The closing empty message waits (uvicorn's flow control) until the transport's
            # buffer has drained into the socket: only then are this response's bytes really
            # out of the process, and only then is its in-flight reservation given back.
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            # Every view of the buffers must be gone before they go back to their pool.
            views = pieces = []
            self._arrays = []
            if self._on_sent is not None:
                on_sent, self._on_sent = self._on_sent, None
                on_sent()


def single(array: np.ndarray, logical_dtype: str, *, npy: bool = False, chunk_bytes: int = 4 << 20,
           on_sent: Callable[[], None] | None = None) -> ArrayResponse:  # fmt: skip
    """One array: ``X-Shape``/``X-Dtype``, octet-stream or ``.npy``."""
    return ArrayResponse([(array, logical_dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER)], npy=npy,
                         chunk_bytes=chunk_bytes, on_sent=on_sent)  # fmt: skip
