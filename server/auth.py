"""Bearer-token check for every route but ``/healthz`` (SPEC: ``FEATURESTORE_TOKEN``).

A pure-ASGI middleware rather than a FastAPI dependency so that it also guards the routes
FastAPI adds itself (``/docs``, ``/openapi.json``) and ``/metrics``. Comparison is constant-time
(``hmac.compare_digest``), so response timing does not leak how much of a guess was right.

Browsers sign in to the web page once (``?token=`` or the sign-in form) and then send a session
cookie, accepted for GET and HEAD only (``server/web/session.py`` says why and how). A page
request without a valid token gets the sign-in form with 401; an API request gets the JSON 401.
"""

from __future__ import annotations

import hmac

from starlette.responses import HTMLResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.asgi import HttpMiddleware
from server.errors import Unauthorized, render_error
from server.web import session
from server.web.views import login_page
from server.web.security import PAGE_HEADERS

OPEN_PATHS = frozenset({"/healthz"})


class BearerAuthMiddleware(HttpMiddleware):
    def __init__(self, app: ASGIApp, token: str, pages: bool = True) -> None:
        super().__init__(app)
        self._pages = pages  # whether the web page is served (FEATURESTORE_UI)
        self._expected = token.encode("utf-8")
        self._session = session.session_value(token).encode("ascii")

    def _authorized(self, scope: Scope) -> bool:
        headers = scope.get("headers", ())
        for name, value in headers:
            if name == b"authorization":
                scheme, _, credentials = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                return hmac.compare_digest(credentials.strip(), self._expected)
        if scope.get("method") in session.SAFE_METHODS:
            cookie = session.cookie_from(headers)
            return cookie is not None and hmac.compare_digest(cookie, self._session)
        return False

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        page = self._pages and session.is_page(path)
        if page and scope.get("method") == "GET" and b"token=" in scope.get("query_string", b""):
            token, rest = session.split_token(scope["query_string"])
            if token is not None:
                await self._sign_in_from_query(scope, token, rest, send, receive)
                return
        if path in OPEN_PATHS or (self._pages and session.is_open(path)) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        if page:
            response = HTMLResponse(login_page(session.safe_next(_target(scope))), status_code=401,
                                    headers={**PAGE_HEADERS, "WWW-Authenticate": "Bearer"})  # fmt: skip
        else:
            response = render_error(
                Unauthorized(
                    "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                    "(the server's FEATURESTORE_TOKEN)"
                )
            )
        await response(scope, receive, send)

    async def _sign_in_from_query(self, scope: Scope, token: str, rest: str, send: Send, receive: Receive) -> None:
        if session.matches(token, self._expected):
            target = scope["path"] + (f"?{rest}" if rest else "")
            response = RedirectResponse(target, status_code=303, headers=PAGE_HEADERS)
            response.headers.append("Set-Cookie", session.set_cookie(
                self._session.decode(), secure=scope.get("scheme") == "https"))  # fmt: skip
        else:
            response = HTMLResponse(login_page(session.safe_next(scope["path"]), "wrong token"),
                                    status_code=401, headers=PAGE_HEADERS)  # fmt: skip
        await response(scope, receive, send)


def _target(scope: Scope) -> str:
    query = scope.get("query_string", b"").decode("latin-1")
    return scope["path"] + (f"?{query}" if query else "")
