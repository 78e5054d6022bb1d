"""The HTTP transport under :class:`client.http.FeatureClient`: one pooled session per process,
retries, the wait while a split is being rewritten (the server's 409 with ``Retry-After``),
server errors mapped to :class:`ClientError` (mixed with the featurestore error the server names,
so ``except SplitNotFound`` works for both sources), and the framed data responses streamed
straight into the caller's arrays (each part described by its own shape/dtype headers, the
response's generation checked before its body is read).

Imports httpx and numpy only; nothing here imports the server stack (fastapi) or torch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import random
import re
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

import httpx
import numpy as np

from client._stdlib_transport import StdlibTransport
from client.framing import fill_views
from client.remote import check_generation
from featurestore import errors as fse
from featurestore.format import wire

if TYPE_CHECKING:
    from client.remote import RemoteFeatureArray

__all__ = ["TOKEN_ENV", "ClientError", "Transport", "make_error"]

_RETRY_STATUS = frozenset({500, 502, 503, 504})
# A damaged store answers 500 too, but asking again cannot help.
_NO_RETRY_ERRORS = frozenset({"CorruptChunk", "MissingChunks"})


class ClientError(fse.FeatureStoreError):
    """An HTTP request to the server failed: ``status`` (None for a connection failure),
    ``detail`` (the server's message) and ``url``."""

    status: int | None = None
    detail: Any = None
    url: str = ""
    max_response_bytes: int | None = None
    retry_after: float | None = None  # the server's Retry-After, in seconds


@functools.lru_cache(maxsize=None)
def _error_class(name: str | None) -> type[ClientError]:
    """``ClientError`` mixed with the featurestore error the server named, if it names one."""
    domain = getattr(fse, name, None) if name else None
    if (
        isinstance(domain, type)
        and issubclass(domain, fse.FeatureStoreError)
        and domain is not fse.FeatureStoreError
    ):
        return type(name, (ClientError, domain), {"__module__": __name__})  # type: ignore[arg-type]
    return ClientError


def make_error(message: str, *, status: int | None, detail: Any, url: str,
               name: str | None = None) -> ClientError:  # fmt: skip
    # Attributes are set after construction: some mixed-in builtins (OSError) refuse kwargs.
    error = _error_class(name)(message)
    error.status, error.detail, error.url = status, detail, url
    return error


def default_transport(max_connections: int) -> httpx.BaseTransport:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # TCP_NODELAY: httpcore writes a POST's headers and body separately; with Nagle on, the body
    # waits for the ACK of the headers, which the server may delay (delayed ACK, up to 40 ms).
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    return StdlibTransport(max_idle_per_host=max_connections,
                           make_fallback=lambda: httpx.HTTPTransport(limits=limits, socket_options=nodelay))


TOKEN_ENV = "FEATURESTORE_TOKEN"  # the server's variable; `featurestore probe` reads it too

# A request target sent as it is (no character httpx would have escaped or normalized).
_PLAIN_TARGET = re.compile(r"[A-Za-z0-9\-._~%!$&'()*+,;=:@/?]*")


def _direct_target(prefix: str, path: str, params: dict[str, str] | None) -> str | None:
    """The request line's target of ``path`` and ``params`` as httpx would send it, or None
    where it might differ (non-str values, characters httpx escapes): such a request goes
    through httpx."""
    if params and not all(type(v) is str for v in params.values()):
        return None
    target = prefix + path + ("?" + urlencode(params) if params else "")
    return target if _PLAIN_TARGET.fullmatch(target) else None


class Transport:
    """Requests to one featurestore server (the options are :class:`client.http.FeatureClient`'s,
    documented there): ``get_json``, ``fetch_into``, ``fetch_samples``, ``fetch_bag``.

    The pooled ``httpx.Client`` is made per process (re-created after a fork, dropped when
    pickled, so a client can live inside a DataLoader's dataset)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.25,
        split_change_wait_s: float = 60.0,
        max_connections: int = 16,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            shown = wire.redact(url) if isinstance(url, str) else repr(url)
            raise fse.InvalidOption(f"url must be an http(s):// URL of a featurestore server, got {shown!r}")
        if not isinstance(retries, int) or retries < 0:
            raise fse.InvalidOption(f"retries must be a non-negative integer, but got: {retries!r}")
        if not timeout or timeout <= 0:
            raise fse.InvalidOption(f"timeout must be a positive number of seconds, but got: {timeout!r}")
        if not isinstance(split_change_wait_s, (int, float)) or split_change_wait_s < 0:
            raise fse.InvalidOption("split_change_wait_s must be a non-negative number of seconds, "
                                    f"but got: {split_change_wait_s!r}")  # fmt: skip
        scheme, rest = url.split("://", 1)
        # The scheme is case-insensitive (RFC 3986 3.1): HTTP://host works like http://host.
        self._base = f"{scheme.lower()}://{rest}".rstrip("/")  # may hold user:password@
        self.url = wire.redact(self._base)  # what messages and reprs show
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.split_change_wait_s = float(split_change_wait_s)
        self.max_connections = int(max_connections)
        # Read once, here, so a DataLoader worker (a pickled copy) sends the token its parent had.
        self._token = (os.environ.get(TOKEN_ENV) if token is None else token) or None
        self._external = http_client
        self._transport = transport
        self._http: httpx.Client | None = None
        self._pid = os.getpid()
        # (pid, (transport, host, port, path prefix) or None): see _direct_route
        self._direct: tuple[int, tuple[StdlibTransport, str, int, str] | None] | None = None
        self._timeouts = {"connect": min(self.timeout, 10.0), "read": self.timeout,
                          "write": self.timeout, "pool": self.timeout}  # fmt: skip

    @property
    def http(self) -> httpx.Client:
        if self._external is not None:
            return self._external
        if self._http is None or self._pid != os.getpid():
            # After a fork the parent's pooled sockets must not be shared: start afresh and
            # leave the inherited client alone (closing it would close the parent's sockets).
            self._http = httpx.Client(
                timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
                transport=self._transport or default_transport(self.max_connections),
            )
            self._pid = os.getpid()
        return self._http

    def close(self) -> None:
        if self._http is not None and self._pid == os.getpid():
            self._http.close()
        self._http = None
        self._direct = None

    def _direct_route(self) -> tuple[StdlibTransport, str, int, str] | None:
        """``(transport, host, port, path prefix)`` when httpx would hand every request to this
        server to the default :class:`StdlibTransport` (plain ``http://``, no proxy from the
        environment, no credentials in the URL): requests then go to it straight, without
        building an ``httpx.Request`` and passing httpx's client (URL parsing, header merging,
        cookies, auth and redirect hooks: about a third of a single item's client time). None:
        every request goes through ``httpx.Client``."""
        if self._direct is None or self._direct[0] != os.getpid():
            route = None
            if self._external is None:
                url = httpx.URL(self._base)
                pick = getattr(self.http, "_transport_for_url", None)  # httpx's own routing (mounts, proxies)
                transport = pick(url) if pick is not None and url.scheme == "http" and not url.userinfo else None
                if isinstance(transport, StdlibTransport):
                    route = (transport, url.host, url.port or 80, url.raw_path.decode("ascii").rstrip("/"))
            self._direct = (os.getpid(), route)
        return self._direct[1]

    @contextlib.contextmanager
    def _exchange(self, method: str, path: str, kwargs: dict[str, Any]) -> Iterator[Any]:
        """One request and its streamed response (closed on exit): an ``httpx.Response``, or
        the default transport's lighter :class:`~client._stdlib_transport.DirectResponse` with
        the same attributes this module reads."""
        route = self._direct_route()
        target = None if route is None else _direct_target(route[3], path, kwargs.get("params"))
        if route is None or target is None:
            with self.http.stream(method, self._base + path, **kwargs) as response:
                yield response
            return
        transport, host, port, _ = route
        response = transport.request(method, host, port, target, list(kwargs["headers"].items()),
                                     kwargs.get("content") or b"", self._timeouts)  # fmt: skip
        try:
            yield response
        finally:
            response.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_http"] = None
        state["_external"] = None
        state["_transport"] = None
        state["_direct"] = None
        return state

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        return {**headers, **(extra or {})}

    def _attempts(self) -> Iterator[int]:
        """Yield attempt numbers, sleeping with exponential backoff between them."""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.0))
            yield attempt

    def _error(self, response: httpx.Response, method: str, url: str) -> ClientError:
        try:
            detail, name, extra = wire.parse_error_body(response.json())
        except ValueError:
            detail, name, extra = response.text[:500], None, {}
        if isinstance(detail, str):
            detail = wire.redact(detail)
        # The server's words are for any HTTP client; this one takes its token as an argument.
        hint = (" (FeatureClient, FeatureDataset and BagDataset take token=, else read $FEATURESTORE_TOKEN)"
                if response.status_code == 401 else "")
        error = make_error(
            f"{method} {url} failed with HTTP {response.status_code}: {detail}{hint}",
            status=response.status_code, detail=detail, url=url, name=name,
        )  # fmt: skip
        if isinstance(cap := extra.get("max_response_bytes"), int):
            error.max_response_bytes = cap
        try:
            error.retry_after = float(response.headers["retry-after"])
        except (KeyError, ValueError):
            pass
        return error

    def _send(self, method: str, path: str, *, stream_into: Any = None, **kwargs: Any) -> Any:
        """One request with retries (:meth:`_send_once`), asked again while the split is being
        rewritten (409 with Retry-After), for at most ``split_change_wait_s``."""
        deadline = time.monotonic() + self.split_change_wait_s
        for attempt in itertools.count():
            try:
                return self._send_once(method, path, stream_into=stream_into, **kwargs)
            except ClientError as error:
                if error.status != 409 or error.retry_after is None:
                    raise
                wait = min(self.backoff * 2**attempt, error.retry_after) * random.uniform(0.5, 1.0)
                if time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    def _send_once(self, method: str, path: str, *, stream_into: Any = None, **kwargs: Any) -> Any:
        """One request with retries; JSON result, or ``stream_into(response)``'s result."""
        shown = self.url + path
        kwargs["headers"] = self._headers(kwargs.get("headers"))
        last: BaseException | None = None
        for attempt in self._attempts():
            try:
                with self._exchange(method, path, kwargs) as response:
                    if response.status_code >= 400:
                        response.read()
                        error = self._error(response, method, shown)
                        retry = (response.status_code in _RETRY_STATUS
                                 and type(error).__name__ not in _NO_RETRY_ERRORS)  # fmt: skip
                        if retry and attempt < self.retries:
                            last = error
                            continue
                        raise error from None
                    if stream_into is not None:
                        return stream_into(response)
                    response.read()
                    return response.json()
            except httpx.TransportError as error:  # connect/read errors, timeouts, cut bodies
                last = error
        if isinstance(last, ClientError):  # a 5xx on every attempt
            raise last
        # httpx messages may quote the URL, credentials included: redact every line we raise.
        refused = isinstance(last, httpx.ConnectError) and "refused" in str(last).lower()
        hint = f": is a server running at {self.url}? (featurestore serve STORE --port ...)" if refused else ""
        raise make_error(
            wire.redact(f"{method} {shown} failed after {self.retries + 1} attempts: {last!r}{hint}"),
            status=None, detail=wire.redact(str(last)), url=shown,
        ) from None

    # ------------------------------------------------------------------ reads
    def get_json(self, path: str, params: dict[str, str] | None = None) -> Any:
        """``GET path`` (a filled-in :mod:`wire <featurestore.format.wire>` route) as JSON."""
        return self._send("GET", path, params=params)

    def fetch_into(self, method: str, path: str, out: np.ndarray, dtype: str, *,
                   params: dict[str, str] | None = None, indices: np.ndarray | None = None,
                   generation: str | None = None) -> np.ndarray:  # fmt: skip
        """One data response (``X-Shape`` must be ``out.shape``, ``X-Dtype`` ``dtype``) streamed
        straight into ``out``; ``indices`` go as a raw int64 body (:data:`wire.INDICES`);
        ``generation``: the split's as the caller opened it (another one is SplitChanged)."""
        parts = [(out, dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER)]
        return self.fetch_parts(method, path, parts, params=params, indices=indices, generation=generation)[0]

    def fetch_samples(self, arr: RemoteFeatureArray, index: np.ndarray, features: np.ndarray,
                      labels: np.ndarray, *, scales: np.ndarray | None = None) -> None:  # fmt: skip
        """Features and labels of ``index`` in one :data:`wire.SAMPLES` response, in place; an
        int8 split's codes ask for their scales too (``?dtype=int8``), into ``scales``."""
        assert arr.labels is not None
        parts = [(features, arr.dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER),
                 (labels, arr.labels.dtype, wire.LABELS_SHAPE_HEADER, wire.LABELS_DTYPE_HEADER)]
        params = None
        if scales is not None:
            params = {wire.DTYPE_PARAM: wire.CODES}
            parts.append((scales, "float32", wire.SCALES_SHAPE_HEADER, wire.SCALES_DTYPE_HEADER))
        self.fetch_parts("POST", wire.route(wire.SAMPLES, **arr.route), parts, params=params, indices=index,
                         generation=arr.structure.generation)

    def fetch_parts(self, method: str, path: str,
                    parts: list[tuple[np.ndarray, str, str, str]], *,
                    params: dict[str, str] | None = None, indices: np.ndarray | None = None,
                    json_body: Any = None, generation: str | None = None) -> list[np.ndarray]:  # fmt: skip
        """Stream one response into ``parts`` (arrays back to back, each described by its own
        shape/dtype headers): no intermediate body buffer. A response from another generation of
        the split than ``generation`` (the caller's) is :class:`SplitChanged`, its body unread."""
        targets = [out.reshape(-1).view(np.uint8).data for out, *_ in parts]

        def fill(response: httpx.Response) -> list[np.ndarray]:
            check_generation(response.headers, generation, self.url + path)
            for out, dtype, shape_header, dtype_header in parts:
                try:
                    shape = wire.parse_shape(response.headers.get(shape_header, ""))
                except wire.WireFormatError as error:
                    raise make_error(str(error), status=response.status_code, detail=None,
                                     url=self.url + path) from None  # fmt: skip
                got = response.headers.get(dtype_header)
                if shape != out.shape or got != dtype:
                    raise make_error(
                        f"{self.url}{path} answered {shape_header} {shape} {dtype_header} {got}, "
                        f"expected {out.shape} {dtype}",
                        status=response.status_code, detail=None, url=self.url + path,
                    )  # fmt: skip
            readinto = response.extensions.get("readinto")
            encoded = response.headers.get("content-encoding", "identity") != "identity"
            if readinto is not None and not encoded:
                for target in targets:
                    readinto(target)  # straight from the socket into the output arrays
                return [out for out, *_ in parts]
            fill_views(response.iter_bytes() if encoded else response.iter_raw(), targets)
            return [out for out, *_ in parts]

        headers = {"Accept": wire.OCTET_STREAM, "Accept-Encoding": "identity"}
        kwargs: dict[str, Any] = {"params": params, "headers": headers}
        if indices is not None:
            headers["Content-Type"] = wire.INDICES
            kwargs["content"] = wire.encode_indices(indices)
        elif json_body is not None:
            headers["Content-Type"] = "application/json"
            kwargs["content"] = json.dumps(json_body).encode()
        result: list[np.ndarray] = self._send(method, path, stream_into=fill, **kwargs)
        return result

    def fetch_bag(self, path: str, features: np.ndarray, coords: np.ndarray, dtype: str, coords_dtype: str, *,
                  params: dict[str, str] | None = None, indices: np.ndarray | None = None,
                  generation: str | None = None, scales: np.ndarray | None = None) -> None:  # fmt: skip
        """One :data:`wire.BAG` response (features, then coordinates) streamed into ``features``
        and ``coords``; rows ``params`` (``start``/``stop``) by GET, or ``indices`` by POST;
        ``generation``: the split's as the caller opened it (another one is SplitChanged);
        ``scales``: an int8 bag's ``[1, D]`` scales row, asked for with its codes (``?dtype=int8``)."""
        parts = [(features, dtype, wire.SHAPE_HEADER, wire.DTYPE_HEADER),
                 (coords, coords_dtype, wire.COORDS_SHAPE_HEADER, wire.COORDS_DTYPE_HEADER)]
        if scales is not None:
            params = {**(params or {}), wire.DTYPE_PARAM: wire.CODES}
            parts.append((scales, "float32", wire.SCALES_SHAPE_HEADER, wire.SCALES_DTYPE_HEADER))
        self.fetch_parts("GET" if indices is None else "POST", path, parts, params=params, indices=indices,
                         generation=generation)
