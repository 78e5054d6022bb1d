"""The app factory: ``create_app(store_url=None, settings=None)``.

``uvicorn`` runs it as ``server.app:app_from_env`` with ``factory=True`` (what
``featurestore serve`` does, also with ``--workers N``): settings then come from the
``FEATURESTORE_*`` environment.

Nothing here imports torch: the server image ships without it.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

import featurestore
from server import routes_bags, routes_data, routes_features, routes_zarr
from server.auth import BearerAuthMiddleware
from server.errors import install_error_handlers
from server.limits import BodyLimitMiddleware
from server.metrics import Metrics, MetricsMiddleware
from server.responses import ABORT_KEY, transport_abort
from server.settings import Settings
from server.state import StoreState
from server.web import routes as web_routes
from server.web.blas import limit_blas_threads


class FeatureStoreApp(FastAPI):
    """FastAPI, plus the connection's ``abort()`` in each HTTP scope.

    Only here, at the very top, is ``send`` still the server's own (every middleware below wraps
    it): ``server.responses.BoundedSend`` uses it to drop a client that stopped reading.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (abort := transport_abort(send)) is not None:
            scope["extensions"] = {**(scope.get("extensions") or {}), ABORT_KEY: abort}
        await super().__call__(scope, receive, send)


def create_app(store_url: str | None = None, settings: Settings | None = None) -> FastAPI:
    """Build the read-only HTTP face of one store.

    ``store_url`` overrides ``settings.store``; ``settings`` defaults to ``Settings()`` (the
    environment). The store is opened here, so a wrong URL fails at start-up, not per request.
    """
    settings = settings if settings is not None else Settings()
    if store_url is not None:
        settings = settings.model_copy(update={"store": str(store_url)})
    state = StoreState(settings)

    app = FeatureStoreApp(
        title="featurestore",
        version=featurestore.__version__,
        description="Read-only access to a featurestore: listings, split metadata, feature "
        "batches (raw little-endian bytes with X-Shape / X-Dtype), slide bags (features + coordinates of "
        "one bag per request) and the raw Zarr key space.",
    )
    app.state.featurestore = state
    install_error_handlers(app)
    app.include_router(routes_data.router)
    app.include_router(routes_bags.router)
    app.include_router(routes_zarr.router)
    app.include_router(routes_features.router)  # its /v1 catch-all matches anything under /v1
    if settings.ui:
        web_routes.install(app, state)  # /, /ui/...: the web page (docs/SERVER.md, "Web page")

    metrics = Metrics()
    metrics.watch_pool(lambda: state.buffers.free_bytes)
    metrics.watch_on_loop(lambda: state.inline_answers)
    app.state.metrics = metrics

    @app.get("/metrics", tags=["service"], response_class=Response)
    def prometheus(request: Request) -> Response:
        """Prometheus text exposition of this worker's counters."""
        return metrics.render(request)

    # The middleware added last is the outermost: metrics wraps auth, so rejected requests are
    # counted too.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if (warning := settings.empty_token_warning()) is not None:
        logging.getLogger("featurestore.server").warning(warning)
    token = settings.token_value()
    if token is not None:
        app.add_middleware(BearerAuthMiddleware, token=token, pages=settings.ui)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn server.app:app_from_env --factory`` (settings from the env): a
    server process of its own, so it also sets its BLAS threads (``server/web/blas.py``)."""
    settings = Settings()
    limit_blas_threads(settings.ui_blas_threads)
    return create_app(settings=settings)
