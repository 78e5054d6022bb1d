"""Binary data responses: one gathered numpy buffer, sent without copying it again.

``ArrayResponse`` hands uvicorn memoryview slices of the array itself (no ``tobytes()``), in
pieces of ``chunk_bytes`` (default 4 MiB, ``FEATURESTORE_SEND_CHUNK_BYTES``) with
``more_body=True``. Pieces rather than one 12 MiB body because the server's transport copies
whatever the socket does not take at once (h11 joins the event, asyncio buffers the rest of a
write), and uvicorn's flow control (it awaits ``drain()`` before each ``send``) then keeps only
a piece buffered; one big write measured ~3x slower than 4 MiB pieces on loopback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from featurestore.format import wire


class ArrayResponse(Response):
    def __init__(
        self,
        array: np.ndarray,
        logical_dtype: str,
        *,
        npy: bool = False,
        chunk_bytes: int = 4 << 20,
        headers: Mapping[str, str] | None = None,
        background: BackgroundTask | None = None,
        on_sent: Callable[[], None] | None = None,
    ) -> None:
        array = np.ascontiguousarray(array)
        # Data on the wire is little-endian; the reader already returns little-endian storage
        # dtypes, so this converts (copies) only if someone hands us a big-endian array.
        wanted = wire.storage_dtype(logical_dtype)
        if array.dtype != wanted:
            array = array.astype(wanted)
        self._array = array  # keeps the buffer alive while the views are sent
        self._data = array.reshape(-1).view(np.uint8).data  # a memoryview, no copy
        self._prefix = wire.npy_header(array.shape, array.dtype) if npy else b""
        self._chunk_bytes = chunk_bytes
        self._on_sent = on_sent  # e.g. return the buffer to its pool
        all_headers = {
            "content-length": str(len(self._prefix) + self._data.nbytes),
            wire.SHAPE_HEADER: wire.encode_shape(array.shape),
            wire.DTYPE_HEADER: logical_dtype,
            **(headers or {}),
        }
        super().__init__(
            content=None,
            status_code=200,
            headers=all_headers,
            media_type=wire.NPY if npy else wire.OCTET_STREAM,
            background=background,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        if self._prefix:
            await send({"type": "http.response.body", "body": self._prefix, "more_body": True})
        data, step = self._data, self._chunk_bytes
        total = data.nbytes
        try:
            if total == 0:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            for offset in range(0, total, step):
                end = min(offset + step, total)
                await send(
                    {"type": "http.response.body", "body": data[offset:end], "more_body": end < total}
                )
        finally:
            # Every view of the buffer must be gone before it is handed back for reuse.
            data = self._data = memoryview(b"")
            self._array = np.empty(0, np.uint8)
            if self._on_sent is not None:
                self._on_sent()
        if self.background is not None:
            await self.background()
