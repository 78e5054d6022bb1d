"""Bearer-token check for every route but ``/healthz`` (SPEC: ``FEATURESTORE_TOKEN``).

A pure-ASGI middleware rather than a FastAPI dependency so that it also guards the routes
FastAPI adds itself (``/docs``, ``/openapi.json``) and ``/metrics``. Comparison is constant-time
(``hmac.compare_digest``), so response timing does not leak how much of a guess was right.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import Unauthorized, render_error

OPEN_PATHS = frozenset({"/healthz"})


class BearerAuthMiddleware:
    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self._expected = token.encode("utf-8")

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                return hmac.compare_digest(credentials.strip(), self._expected)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = render_error(
            Unauthorized(
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                "(the server's FEATURESTORE_TOKEN)"
            )
        )
        await response(scope, receive, send)
