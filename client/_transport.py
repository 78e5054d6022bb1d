"""A small HTTP/1.1 transport for httpx whose bodies can be read straight into a caller's buffer.

Why: httpx's default transport (httpcore + h11) moves a response body through Python in 64 KiB
pieces, copying each one three times (socket -> bytes -> h11's bytearray -> a slice -> the
caller). For 12 MiB feature batches that alone held the client at ~0.2x of raw loopback TCP, even
against a server that writes its bytes with one ``sendall`` (measured with the scripts behind
``featurestore bench http``). This transport parses the status line and headers itself and
exposes ``response.extensions["readinto"]``, which ``recv_into``s the body directly into the
destination array: one kernel copy, as with a raw socket.

Scope, on purpose: plain ``http://`` only (anything else goes to ``fallback``, httpx's own
transport), HTTP/1.1 keep-alive with a per-(host, port) pool of idle sockets, Content-Length,
chunked and read-to-close bodies. A reused keep-alive socket that turns out to be closed by the
server is retried once on a fresh connection, which is safe for the idempotent reads
``FeatureClient`` makes and the reason this transport is private to it.
"""

from __future__ import annotations

import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx

_MAX_HEAD = 64 * 1024
_READ_BYTES = 1 << 20


class _Stale(Exception):
    """A pooled connection the server had already closed."""


class FastHTTPTransport(httpx.BaseTransport):
    def __init__(self, *, max_idle_per_host: int = 16, fallback: httpx.BaseTransport | None = None
                 ) -> None:  # fmt: skip
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}
        self._lock = threading.Lock()
        self._max_idle = max_idle_per_host
        self._fallback = fallback if fallback is not None else httpx.HTTPTransport()
        self._closed = False

    # ------------------------------------------------------------------ pool
    def _checkout(self, key: tuple[str, int], connect_timeout: float | None) -> tuple[socket.socket, bool]:
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                sock = idle.pop()
                # An idle keep-alive socket must have nothing to read; if it is readable the
                # server closed it (EOF) or broke protocol: drop it.
                readable, _, _ = select.select([sock], [], [], 0)
                if not readable:
                    return sock, True
                sock.close()
        try:
            sock = socket.create_connection(key, timeout=connect_timeout)
        except TimeoutError as error:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]}: {error}") from error
        except OSError as error:
            raise httpx.ConnectError(f"connecting to {key[0]}:{key[1]}: {error}") from error
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _checkin(self, key: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets = [s for idle in self._idle.values() for s in idle]
            self._idle.clear()
        for sock in sockets:
            sock.close()
        self._fallback.close()

    # ------------------------------------------------------------------ requests
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            return self._fallback.handle_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        key = (request.url.host, request.url.port or 80)
        payload = _serialize(request)
        for attempt in (0, 1):
            sock, reused = self._checkout(key, timeouts.get("connect"))
            try:
                sock.settimeout(timeouts.get("write"))
                try:
                    sock.sendall(payload)
                except OSError as error:
                    raise (_Stale() if reused else httpx.WriteError(str(error))) from error
                sock.settimeout(timeouts.get("read"))
                reader = _Reader(sock)
                status, reason, headers = _read_head(reader, stale_ok=reused)
                break
            except _Stale:
                sock.close()
                if attempt == 0:
                    continue
                raise httpx.RemoteProtocolError("server closed the connection") from None
            except TimeoutError as error:
                sock.close()
                raise httpx.ReadTimeout(f"reading from {key[0]}:{key[1]}: {error}") from error
            except OSError as error:  # reset: a reused socket the server dropped meanwhile
                sock.close()
                if reused and attempt == 0:
                    continue
                raise httpx.ReadError(f"reading from {key[0]}:{key[1]}: {error}") from error
            except BaseException:
                sock.close()
                raise
        stream = _Body(self, key, reader, request.method, status, headers)
        return httpx.Response(
            status,
            headers=headers,
            stream=stream,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reason,
                        "readinto": stream.readinto},  # fmt: skip
            request=request,
        )


def _serialize(request: httpx.Request) -> bytes:
    body = request.read()
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if name.lower() in (b"transfer-encoding", b"content-length"):
            continue
        lines.append(name + b": " + value)
    if body or request.method not in ("GET", "HEAD"):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class _Reader:
    """A socket with a small look-ahead buffer (what arrived after the headers)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray()

    def fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def read_some(self, limit: int) -> bytes:
        if self.buffer:
            out = bytes(self.buffer[:limit])
            del self.buffer[:limit]
            return out
        return self.sock.recv(limit)

    def readline(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise httpx.RemoteProtocolError("line too long in response")
            if not self.fill():
                raise httpx.RemoteProtocolError("connection closed mid-response")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 2]
        return line

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` exactly (look-ahead first, then ``recv_into``); bytes read."""
        done = min(len(self.buffer), view.nbytes)
        view[:done] = self.buffer[:done]
        del self.buffer[:done]
        while done < view.nbytes:
            n = self.sock.recv_into(view[done:])
            if n == 0:
                raise httpx.RemoteProtocolError(
                    f"connection closed after {done} of {view.nbytes} body bytes"
                )
            done += n
        return done


def _read_head(reader: _Reader, *, stale_ok: bool) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    while True:
        while (end := reader.buffer.find(b"\r\n\r\n")) < 0:
            if len(reader.buffer) > _MAX_HEAD:
                raise httpx.RemoteProtocolError("response headers larger than 64 KiB")
            if not reader.fill():
                if stale_ok and not reader.buffer:
                    raise _Stale()
                raise httpx.RemoteProtocolError("server closed the connection before answering")
        head = bytes(reader.buffer[:end])
        del reader.buffer[: end + 4]
        status_line, *header_lines = head.split(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise httpx.RemoteProtocolError(f"bad status line {status_line[:80]!r}")
        status = int(parts[1])
        headers = []
        for line in header_lines:
            name, sep, value = line.partition(b":")
            if not sep or not name.strip():
                raise httpx.RemoteProtocolError(f"bad header line {line[:80]!r}")
            headers.append((name.strip(), value.strip()))
        if 100 <= status < 200 and status != 101:  # interim (100 Continue): the real one follows
            continue
        return status, parts[2] if len(parts) > 2 else b"", headers


class _Body(httpx.SyncByteStream):
    def __init__(self, transport: FastHTTPTransport, key: tuple[str, int], reader: _Reader,
                 method: str, status: int, headers: list[tuple[bytes, bytes]]) -> None:  # fmt: skip
        self._transport, self._key, self._reader = transport, key, reader
        values = {name.lower(): value.lower() for name, value in headers}
        self._keep_alive = b"close" not in values.get(b"connection", b"")
        self._chunked = b"chunked" in values.get(b"transfer-encoding", b"")
        self._remaining: int | None = None  # None: until the server closes
        if method == "HEAD" or status in (204, 304):
            self._remaining = 0
        elif not self._chunked and b"content-length" in values:
            try:
                self._remaining = int(values[b"content-length"])
            except ValueError:
                raise httpx.RemoteProtocolError("bad Content-Length") from None
        elif not self._chunked:
            self._keep_alive = False
        self._done = self._remaining == 0
        self._released = False

    def readinto(self, view: memoryview) -> int:
        """Read the next ``view.nbytes`` body bytes (Content-Length bodies) into ``view``."""
        if self._chunked or self._remaining is None or view.nbytes > self._remaining:
            raise httpx.RemoteProtocolError(
                f"body of {self._remaining} bytes cannot fill a {view.nbytes}-byte buffer"
            )
        try:
            self._reader.readinto(view)
        except TimeoutError as error:
            raise httpx.ReadTimeout(str(error)) from error
        except OSError as error:
            raise httpx.ReadError(str(error)) from error
        self._remaining -= view.nbytes
        self._done = self._remaining == 0
        return view.nbytes

    def __iter__(self) -> Iterator[bytes]:
        try:
            if self._chunked:
                yield from self._iter_chunked()
            else:
                while not self._done:
                    limit = _READ_BYTES if self._remaining is None else min(_READ_BYTES, self._remaining)
                    chunk = self._reader.read_some(limit)
                    if not chunk:
                        if self._remaining is not None:
                            raise httpx.RemoteProtocolError("connection closed mid-body")
                        self._done = True
                        break
                    if self._remaining is not None:
                        self._remaining -= len(chunk)
                        self._done = self._remaining == 0
                    yield chunk
        except TimeoutError as error:
            raise httpx.ReadTimeout(str(error)) from error
        except OSError as error:
            raise httpx.ReadError(str(error)) from error

    def _iter_chunked(self) -> Iterator[bytes]:
        reader = self._reader
        while True:
            size_line = reader.readline().split(b";", 1)[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                raise httpx.RemoteProtocolError(f"bad chunk size {size_line[:20]!r}") from None
            if size == 0:
                while reader.readline():  # trailers, up to the empty line
                    pass
                self._done = True
                return
            while size:
                chunk = reader.read_some(min(size, _READ_BYTES))
                if not chunk:
                    raise httpx.RemoteProtocolError("connection closed mid-chunk")
                size -= len(chunk)
                yield chunk
            if reader.readline() != b"":
                raise httpx.RemoteProtocolError("missing CRLF after chunk")

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        sock = self._reader.sock
        if self._done and self._keep_alive and not self._reader.buffer:
            self._transport._checkin(self._key, sock)
        else:  # unread body or close-delimited: the connection cannot be reused
            sock.close()
