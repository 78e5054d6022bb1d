"""Prometheus metrics: a per-app registry and a pure-ASGI middleware that fills it.

Each app gets its own ``CollectorRegistry`` (not the process-global one), so several apps in one
test process do not collide. With ``--workers N`` each worker counts its own requests; scrape
them behind one port and sum, or run one worker per container.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.asgi import HttpMiddleware


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "featurestore_http_requests_total",
            "HTTP requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "featurestore_http_request_duration_seconds",
            "time to the last byte handed to the server, by route template",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.bytes_sent = Counter(
            "featurestore_http_response_bytes_total",
            "response body bytes (Content-Length) by route template",
            ["route"],
            registry=self.registry,
        )

    def watch_pool(self, free_bytes: Callable[[], float]) -> None:
        gauge = Gauge(
            "featurestore_buffer_pool_free_bytes",
            "response buffers kept warm for reuse (featurestore/core/buffers.py)",
            registry=self.registry,
        )
        gauge.set_function(free_bytes)

    def watch_on_loop(self, answered: Callable[[], float]) -> None:
        self.registry.register(_CountedElsewhere(
            "featurestore_data_requests_on_event_loop",
            "data requests answered on the event loop, without the thread-pool hand-over (server/on_loop.py)",
            answered))  # fmt: skip

    def render(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _CountedElsewhere(Collector):
    """A counter whose value another object keeps (read at each scrape)."""

    def __init__(self, name: str, documentation: str, value: Callable[[], float]) -> None:
        self._name, self._documentation, self._value = name, documentation, value

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self._name, self._documentation, value=self._value())


class MetricsMiddleware(HttpMiddleware):
    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        status = 500
        length = 0

        async def send_wrapper(message: Message) -> None:
            nonlocal status, length
            if message["type"] == "http.response.start":
                status = int(message["status"])
                for name, value in message.get("headers", ()):
                    if name.lower() == b"content-length":
                        length = int(value)
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            # The route template, not the path: label cardinality stays bounded.
            route = scope.get("route")
            label = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(label, scope["method"], str(status)).inc()
            self.metrics.latency.labels(label).observe(time.perf_counter() - started)
            self.metrics.bytes_sent.labels(label).inc(length)
