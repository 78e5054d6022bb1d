"""HTTP client of the featurestore server: ``FeatureClient`` and ``RemoteFeatureArray``.

``client.open(dataset, encoder, split)`` returns a :class:`RemoteFeatureArray` with the same
interface as a local :class:`featurestore.FeatureArray` (``shape``, ``dtype``, ``labels``,
``read``, ``read_numpy(indices, out=None)``, ...), so datasets and loaders treat a store path
and a server URL alike. Server errors come back as :class:`ClientError`; when the server names
a featurestore error class (``SplitNotFound``, ``IndexOutOfRange``, ...) the raised exception
is also an instance of that class, so ``except SplitNotFound`` works for both sources.

Imports httpx and numpy only; torch is imported by :meth:`read` alone, and nothing here imports
the server stack (fastapi).
"""

from __future__ import annotations

import functools
import os
import random
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np

from client._transport import FastHTTPTransport
from client.remote import RemoteFeatureArray
from featurestore import errors as fse
from featurestore.format import wire

__all__ = ["ClientError", "FeatureClient", "RemoteFeatureArray"]

_RETRY_STATUS = frozenset({500, 502, 503, 504})


class ClientError(fse.FeatureStoreError):
    """An HTTP request to the server failed: ``status`` (None for a connection failure),
    ``detail`` (the server's message) and ``url``."""

    status: int | None = None
    detail: Any = None
    url: str = ""
    max_response_bytes: int | None = None


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


def _make_error(message: str, *, status: int | None, detail: Any, url: str,
                name: str | None = None) -> ClientError:  # fmt: skip
    # Attributes are set after construction: some mixed-in builtins (OSError) refuse kwargs.
    error = _error_class(name)(message)
    error.status, error.detail, error.url = status, detail, url
    return error


def _transport(max_connections: int) -> httpx.BaseTransport:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # TCP_NODELAY: httpcore writes a POST's headers and body separately; with Nagle on, the body
    # waits for the ACK of the headers, which the server may delay (delayed ACK, up to 40 ms).
    nodelay = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    fallback = httpx.HTTPTransport(limits=limits, socket_options=nodelay)
    return FastHTTPTransport(max_idle_per_host=max_connections, fallback=fallback)


class FeatureClient:
    """Read a featurestore server: ``FeatureClient("http://host:8000", token=None)``.

    One pooled ``httpx.Client`` per process (re-created after a fork, dropped when pickled, so
    the client can live inside a DataLoader's dataset). Idempotent reads are retried
    ``retries`` times on connection errors and 5xx, waiting ``backoff * 2**attempt`` seconds.
    ``transport`` replaces the default one (``client/_transport.py``: plain-HTTP keep-alive
    pool that reads bodies straight into the output array; https goes through httpx's own), e.g.
    ``httpx.HTTPTransport()``. ``http_client`` lets tests pass
    ``fastapi.testclient.TestClient(app)``.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 3,
        backoff: float = 0.25,
        max_connections: int = 16,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s):// URL of a featurestore server, got {url!r}")
        if not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be a non-negative integer, but got: {retries!r}")
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, but got: {timeout!r}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff = float(backoff)
        self.max_connections = int(max_connections)
        self._token = token
        self._external = http_client
        self._transport = transport
        self._http: httpx.Client | None = None
        self._pid = os.getpid()
        self._layouts: dict[tuple[str, str, str], RemoteFeatureArray] = {}

    def __repr__(self) -> str:
        return f"FeatureClient({self.url!r}, token={'***' if self._token else None})"

    # ------------------------------------------------------------------ plumbing
    @property
    def http(self) -> httpx.Client:
        if self._external is not None:
            return self._external
        if self._http is None or self._pid != os.getpid():
            # After a fork the parent's pooled sockets must not be shared: start afresh and
            # leave the inherited client alone (closing it would close the parent's sockets).
            self._http = httpx.Client(
                timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 10.0)),
                transport=self._transport or _transport(self.max_connections),
            )
            self._pid = os.getpid()
        return self._http

    def close(self) -> None:
        if self._http is not None and self._pid == os.getpid():
            self._http.close()
        self._http = None

    def __enter__(self) -> FeatureClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_http"] = None
        state["_external"] = None
        state["_transport"] = None
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

    def _error(self, response: httpx.Response, url: str) -> ClientError:
        name = None
        try:
            body = response.json()
            detail, name = body.get("detail"), body.get("error")
        except (ValueError, AttributeError):
            detail = response.text[:500]
        error = _make_error(
            f"{response.request.method} {url} failed with HTTP {response.status_code}: {detail}",
            status=response.status_code, detail=detail, url=url, name=name,
        )  # fmt: skip
        if isinstance(body_cap := _cap_from(response), int):
            error.max_response_bytes = body_cap
        return error

    def _send(self, method: str, path: str, *, stream_into: Any = None, **kwargs: Any) -> Any:
        """One request with retries; JSON result, or ``stream_into(response)``'s result."""
        url = self.url + path
        kwargs["headers"] = self._headers(kwargs.get("headers"))
        last: BaseException | None = None
        for attempt in self._attempts():
            try:
                with self.http.stream(method, url, **kwargs) as response:
                    if response.status_code >= 400:
                        response.read()
                        error = self._error(response, url)
                        if response.status_code in _RETRY_STATUS and attempt < self.retries:
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
        raise _make_error(
            f"{method} {url} failed after {self.retries + 1} attempts: {last!r}",
            status=None, detail=str(last), url=url,
        ) from last

    # ------------------------------------------------------------------ listings
    def datasets(self) -> list[str]:
        return list(self._send("GET", "/v1/datasets")["datasets"])

    def encoders(self, dataset: str) -> list[str]:
        return list(self._send("GET", f"/v1/datasets/{dataset}/encoders")["encoders"])

    def splits(self, dataset: str, encoder: str) -> list[str]:
        return list(self._send("GET", f"/v1/datasets/{dataset}/encoders/{encoder}/splits")["splits"])

    def info(self, dataset: str, encoder: str, split: str) -> dict[str, Any]:
        """The split's metadata dict (what ``FeatureArray.metadata`` holds locally)."""
        result: dict[str, Any] = self._send("GET", f"/v1/features/{dataset}/{encoder}/{split}")
        return result

    def healthy(self) -> bool:
        try:
            return self._send("GET", "/healthz").get("status") == "ok"
        except ClientError:
            return False

    # ------------------------------------------------------------------ data
    def open(self, dataset: str, encoder: str, split: str) -> RemoteFeatureArray:
        """The split's features as a :class:`RemoteFeatureArray` (two small requests, cached)."""
        key = (dataset, encoder, split)
        arr = self._layouts.get(key)
        if arr is None:
            base = f"/v1/features/{dataset}/{encoder}/{split}"
            layout = self._send("GET", base + "/arrays")
            metadata = self.info(dataset, encoder, split)
            arr = RemoteFeatureArray(self, key, layout, metadata, labels=False)
            self._layouts[key] = arr
        return arr

    def _array(self, dataset: str, encoder: str, split: str, labels: bool) -> RemoteFeatureArray:
        arr = self.open(dataset, encoder, split)
        if labels:
            if arr.labels is None:
                raise _make_error(f"split {dataset}/{encoder}/{split} has no labels",
                                  status=None, detail=None, url=self.url)
            return arr.labels
        return arr

    def read_numpy(self, dataset: str, encoder: str, split: str, indices: Any, *,
                   labels: bool = False, out: np.ndarray | None = None) -> np.ndarray:  # fmt: skip
        """Rows ``indices`` in the storage dtype (uint16 bits for bfloat16); no torch needed."""
        return self._array(dataset, encoder, split, labels).read_numpy(indices, out=out)

    def read(self, dataset: str, encoder: str, split: str, indices: Any, *,
             labels: bool = False) -> Any:  # fmt: skip
        """Rows ``indices`` as a torch tensor of the stored dtype (torch.bfloat16 for bfloat16)."""
        return self._array(dataset, encoder, split, labels).read(indices)

    def read_range(self, dataset: str, encoder: str, split: str, start: int, stop: int, *,
                   labels: bool = False) -> np.ndarray:  # fmt: skip
        return self._array(dataset, encoder, split, labels).read_range(start, stop)

    def item(self, dataset: str, encoder: str, split: str, index: int, *,
             labels: bool = False) -> np.ndarray:  # fmt: skip
        """One sample (storage dtype), via the single-item route."""
        arr = self._array(dataset, encoder, split, labels)
        out = np.empty(arr.sample_shape, arr.numpy_dtype)
        path = f"{arr._base}/items/{int(index)}"
        return self._fetch(arr, "GET", path, out, params=arr._params)

    def _fetch(self, arr: RemoteFeatureArray, method: str, path: str, out: np.ndarray,
               **kwargs: Any) -> np.ndarray:  # fmt: skip
        """Stream one data response straight into ``out`` (no intermediate body buffer)."""
        target = out.reshape(-1).view(np.uint8).data  # a memoryview of `out`

        def fill(response: httpx.Response) -> np.ndarray:
            try:
                shape = wire.parse_shape(response.headers.get(wire.SHAPE_HEADER, ""))
            except wire.WireFormatError as error:
                raise _make_error(str(error), status=response.status_code, detail=None,
                                  url=str(response.url)) from None  # fmt: skip
            dtype = response.headers.get(wire.DTYPE_HEADER)
            if shape != out.shape or dtype != arr.dtype:
                raise _make_error(
                    f"{response.url} answered shape {shape} dtype {dtype}, expected {out.shape} "
                    f"{arr.dtype}", status=response.status_code, detail=None, url=str(response.url),
                )  # fmt: skip
            readinto = response.extensions.get("readinto")
            encoded = response.headers.get("content-encoding", "identity") != "identity"
            if readinto is not None and not encoded:
                readinto(target)  # straight from the socket into `out`
                return out
            filled = 0
            for chunk in response.iter_bytes() if encoded else response.iter_raw():
                size = len(chunk)
                if filled + size > target.nbytes:
                    raise httpx.RemoteProtocolError("response body longer than X-Shape says")
                target[filled : filled + size] = chunk
                filled += size
            if filled != target.nbytes:
                raise httpx.RemoteProtocolError(f"body of {filled} bytes, expected {target.nbytes}")
            return out

        headers = {"Accept": wire.OCTET_STREAM, "Accept-Encoding": "identity"}
        result: np.ndarray = self._send(method, path, stream_into=fill, headers=headers, **kwargs)
        return result


def _cap_from(response: httpx.Response) -> int | None:
    try:
        value = response.json().get("max_response_bytes")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, int) else None
