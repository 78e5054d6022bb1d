"""The base of the server's pure-ASGI middlewares (``auth``, ``limits``, ``metrics``).

Pure ASGI rather than Starlette's ``BaseHTTPMiddleware``, so that response bodies stream through
untouched. Lifespan (and any other non-HTTP) scopes pass straight to the app; an HTTP request goes
to the subclass's :meth:`HttpMiddleware.handle`.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send


class HttpMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError
