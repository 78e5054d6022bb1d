"""``StdlibTransport``: httpx's transport interface over the standard library's ``http.client``.

Why (measured in ``featurestore bench http``, docs/SERVER.md): httpx's own transport (httpcore +
h11) moves a body through Python in 64 KiB pieces and copies each several times, which held a
12 MiB batch at a fraction of the wire speed. ``http.client.HTTPResponse.readinto`` copies a
Content-Length body straight from the socket into the caller's buffer, as a raw socket does; the
hand-written HTTP/1.1 client this replaces (300 lines) was not faster than it. So plain
``http://`` requests go through ``http.client`` keep-alive connections (a small pool per host),
and ``response.extensions["readinto"]`` fills the output array in place; ``https://`` and
anything else go to ``fallback`` (httpx's transport). ``FeatureClient`` also calls
:meth:`StdlibTransport.request` straight, past ``httpx.Client``, and reads its
:class:`DirectResponse` (a single item's client time went a third to httpx's client and a
sixth to building its ``httpx.Response``).

A pooled connection the server closed meanwhile fails on reuse; the request is then retried once
on a fresh connection, which is safe for the idempotent reads ``FeatureClient`` makes and the
reason this transport is private to it.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx

_READ_BYTES = 1 << 20
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          ConnectionAbortedError)  # fmt: skip


class StdlibTransport(httpx.BaseTransport):
    def __init__(self, *, max_idle_per_host: int = 16, fallback: httpx.BaseTransport | None = None,
                 make_fallback: Callable[[], httpx.BaseTransport] | None = None) -> None:  # fmt: skip
        """``fallback`` serves what is not plain ``http://``; or ``make_fallback`` makes it on the
        first such request (httpx's transport builds an SSL context and loads the CA bundle when
        made, ~25 ms quiet and 150 ms on a busy host: every new client of an ``http://`` server
        paid it before its first request)."""
        self._idle: dict[tuple[str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._max_idle = max_idle_per_host
        self._fallback = fallback
        self._make_fallback = make_fallback or httpx.HTTPTransport
        self._closed = False

    def _fallback_transport(self) -> httpx.BaseTransport:
        with self._lock:
            if self._fallback is None:
                self._fallback = self._make_fallback()
            return self._fallback

    # ------------------------------------------------------------------ pool
    def _checkout(self, key: tuple[str, int], timeout: float | None) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(key)
            if idle:
                conn = idle.pop()
                conn.timeout = timeout
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                return conn, True
        conn = http.client.HTTPConnection(key[0], key[1], timeout=timeout)
        return conn, False

    def _checkin(self, key: tuple[str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if not self._closed and len(idle) < self._max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()
        if self._fallback is not None:
            self._fallback.close()

    # ------------------------------------------------------------------ requests
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme != "http":
            return self._fallback_transport().handle_request(request)
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in request.headers.raw
                   if n.lower() not in (b"host", b"content-length", b"transfer-encoding")]  # fmt: skip
        stream = self._open(request.method, request.url.host, request.url.port or 80,
                            request.url.raw_path.decode("ascii"), headers, request.read(),
                            request.extensions.get("timeout", {}))  # fmt: skip
        response = stream.response
        return httpx.Response(
            response.status,
            headers=[(n.encode("latin-1"), v.encode("latin-1")) for n, v in response.getheaders()],
            stream=stream,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason.encode("latin-1"),
                        "readinto": stream.readinto},  # fmt: skip
            request=request,
        )

    def request(self, method: str, host: str, port: int, target: str, headers: list[tuple[str, str]],
                body: bytes, timeouts: dict[str, Any]) -> DirectResponse:  # fmt: skip
        """One plain-http request on a pooled connection, answered as a :class:`DirectResponse`:
        ``target`` is the request line's path and query as sent, ``headers`` go as given
        (``Host`` and ``Content-Length`` are added). ``FeatureClient`` calls this, without an
        ``httpx.Request`` or ``httpx.Response``, where httpx would route its server's requests
        here anyway (``client/transport.py``)."""
        return DirectResponse(self._open(method, host, port, target, headers, body, timeouts))

    def _open(self, method: str, host: str, port: int, target: str, headers: list[tuple[str, str]],
              body: bytes, timeouts: dict[str, Any]) -> _Body:  # fmt: skip
        key = (host, port)
        for attempt in (0, 1):
            conn, reused = self._checkout(key, timeouts.get("read"))
            try:
                if conn.sock is None:
                    conn.timeout = timeouts.get("connect")
                    conn.connect()
                    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    conn.sock.settimeout(timeouts.get("read"))
                conn.putrequest(method, target, skip_accept_encoding=True)
                for name, value in headers:
                    conn.putheader(name, value)
                if body or method not in ("GET", "HEAD"):
                    conn.putheader("Content-Length", str(len(body)))
                conn.endheaders(body or None)
                response = conn.getresponse()
                break
            except _STALE as error:
                conn.close()
                if reused and attempt == 0:
                    continue
                raise httpx.RemoteProtocolError(f"{key[0]}:{key[1]}: {error!r}") from error
            except TimeoutError as error:
                conn.close()
                raise httpx.ReadTimeout(f"{key[0]}:{key[1]}: {error}") from error
            except (OSError, http.client.HTTPException) as error:
                conn.close()
                if reused and attempt == 0:
                    continue
                kind = httpx.ConnectError if not reused and conn.sock is None else httpx.ReadError
                raise kind(f"{key[0]}:{key[1]}: {error!r}") from error
        return _Body(self, key, conn, response)


class _Body(httpx.SyncByteStream):
    def __init__(self, transport: StdlibTransport, key: tuple[str, int],
                 conn: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:  # fmt: skip
        self._transport, self._key, self._conn, self._response = transport, key, conn, response
        self._released = False

    @property
    def response(self) -> http.client.HTTPResponse:
        return self._response

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` exactly with the next body bytes, straight from the socket."""
        done = 0
        try:
            while done < view.nbytes:
                n = self._response.readinto(view[done:])
                if not n:
                    raise httpx.RemoteProtocolError(
                        f"connection closed after {done} of {view.nbytes} body bytes"
                    )
                done += n
        except TimeoutError as error:
            raise httpx.ReadTimeout(str(error)) from error
        except (OSError, http.client.HTTPException) as error:
            raise httpx.ReadError(repr(error)) from error
        return done

    def __iter__(self) -> Iterator[bytes]:
        try:
            while chunk := self._response.read1(_READ_BYTES):
                yield chunk
        except TimeoutError as error:
            raise httpx.ReadTimeout(str(error)) from error
        except http.client.IncompleteRead as error:
            raise httpx.RemoteProtocolError(repr(error)) from error
        except (OSError, http.client.HTTPException) as error:
            raise httpx.ReadError(repr(error)) from error

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        response = self._response
        if response.isclosed() and not response.will_close:
            self._transport._checkin(self._key, self._conn)  # body fully read: reuse the socket
        else:  # unread body or close-delimited: the connection cannot be reused
            response.close()
            self._conn.close()


class _Headers(dict):  # type: ignore[type-arg]
    """Response headers by lower-cased name, repeated ones joined with ", " (as ``httpx.Headers``)."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__()
        for name, value in pairs:
            key = name.lower()
            dict.__setitem__(self, key, f"{dict.__getitem__(self, key)}, {value}" if dict.__contains__(self, key)
                             else value)  # fmt: skip

    def __getitem__(self, name: str) -> str:
        return str(dict.__getitem__(self, name.lower()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)


class DirectResponse:
    """A plain-http answer as ``client.transport.Transport`` reads it: ``status_code``,
    ``headers``, ``extensions["readinto"]``, ``read``/``content``/``json``/``text``,
    ``iter_raw``/``iter_bytes``, ``close``, without building an ``httpx.Response`` (its header
    normalisation and set-up cost about as much as ``http.client`` parsing the head). A body
    with a content-encoding, and ``text``, are handed to a real ``httpx.Response``, which
    decodes them."""

    def __init__(self, stream: _Body) -> None:
        response = stream.response
        self.status_code = response.status
        self._pairs = response.getheaders()
        self.headers = _Headers(self._pairs)
        self.extensions = {"readinto": stream.readinto}
        self._stream = stream
        self._content: bytes | None = None
        self._httpx: httpx.Response | None = None

    def _encoded(self) -> bool:
        return self.headers.get("content-encoding", "identity") != "identity"

    def _as_httpx(self, content: bytes | None = None) -> httpx.Response:
        if self._httpx is None:
            headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in self._pairs]
            self._httpx = (httpx.Response(self.status_code, headers=headers, stream=self._stream) if content is None
                           else httpx.Response(self.status_code, headers=headers, content=content))  # fmt: skip
        return self._httpx

    def iter_raw(self) -> Iterator[bytes]:
        return iter(self._stream)

    def iter_bytes(self) -> Iterator[bytes]:
        return self._as_httpx().iter_bytes() if self._encoded() else iter(self._stream)

    def read(self) -> bytes:
        if self._content is None:
            self._content = self._as_httpx().read() if self._encoded() else b"".join(self._stream)
        return self._content

    @property
    def content(self) -> bytes:
        return self.read()

    def json(self) -> Any:
        return json.loads(self.read())

    @property
    def text(self) -> str:
        content = self.read()
        if self._httpx is None:
            self._as_httpx(content)
        assert self._httpx is not None
        return self._httpx.text

    def close(self) -> None:
        self._stream.close()
