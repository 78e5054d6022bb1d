"""Browser sign-in for a server with ``FEATURESTORE_TOKEN``: a browser cannot add an
``Authorization`` header to a link, so the page accepts the token once and keeps a cookie.

* ``GET /ui/...?token=T`` (or ``/?token=T``): right token -> 303 to the same URL without it, with
  the cookie; wrong -> 401 and the sign-in form. The redirect keeps the token out of the address
  bar and bookmarks; ``Referrer-Policy: no-referrer`` keeps it out of Referer headers, and the
  access log masks ``token=`` (:class:`RedactAccessLog`).
* ``POST /ui/login`` (form fields ``token``, ``next``): the same, from the sign-in form, which
  every page answers with 401 when there is no valid cookie. ``POST /ui/logout`` clears it.

The cookie holds ``HMAC-SHA256(token, "featurestore-ui-session-v1")``, never the token: it is
stateless (every ``--workers`` process derives the same value), it changes when the token
changes, and it cannot be replayed as a bearer token against the API. It is ``HttpOnly``,
``SameSite=Strict`` (no cross-site request carries it), ``Secure`` on https, a session cookie,
and it is accepted for GET and HEAD only: the API's one POST route still needs the bearer header.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from urllib.parse import parse_qsl, urlencode

from featurestore.format.redact import redact

COOKIE = "featurestore_session"
LOGIN = "/ui/login"
LOGOUT = "/ui/logout"
STATIC_PREFIX = "/ui/static/"
FAVICON = "/favicon.ico"
SAFE_METHODS = frozenset({"GET", "HEAD"})
_CONTEXT = b"featurestore-ui-session-v1"


def session_value(token: str) -> str:
    return hmac.new(token.encode("utf-8"), _CONTEXT, hashlib.sha256).hexdigest()


def is_page(path: str) -> bool:
    """Whether ``path`` belongs to the web page (answered in HTML, signed in by cookie)."""
    return path == "/" or path == "/ui" or path.startswith("/ui/")


def is_open(path: str) -> bool:
    """Paths served without a token: the sign-in form and the stylesheet and icon it uses (also
    as ``/favicon.ico``, which browsers ask for by themselves, e.g. beside a picture)."""
    return path in (LOGIN, LOGOUT, FAVICON) or path.startswith(STATIC_PREFIX)


def cookie_from(headers: list[tuple[bytes, bytes]] | tuple[tuple[bytes, bytes], ...]) -> bytes | None:
    for name, value in headers:
        if name == b"cookie":
            for part in value.split(b";"):
                key, _, item = part.strip().partition(b"=")
                if key == COOKIE.encode():
                    return item.strip()
    return None


def set_cookie(value: str, *, secure: bool) -> str:
    return f"{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")


def clear_cookie() -> str:
    return f"{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"


def split_token(query: bytes) -> tuple[str | None, str]:
    """``(token, the rest of the query string)`` of a request's query."""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    token = next((v for k, v in pairs if k == "token"), None)
    return token, urlencode([(k, v) for k, v in pairs if k != "token"])


def safe_next(target: str | None) -> str:
    """Where to go after signing in: a path of this server only (no ``//host``, no scheme)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def matches(candidate: str | None, expected: bytes) -> bool:
    return candidate is not None and hmac.compare_digest(candidate.strip().encode("utf-8"), expected)


class RedactAccessLog(logging.Filter):
    """Masks ``token=`` (and every other secret ``redact`` knows) in uvicorn's access-log lines,
    and drops the line of a health check answered 200: docker compose probes every 10 s, and
    those lines buried the requests in ``docker compose logs``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            # uvicorn's args: client address, method, path, HTTP version, status code
            if len(record.args) >= 5 and record.args[2] == "/healthz" and record.args[4] == 200:
                return False
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def redact_access_log() -> None:
    """Add :class:`RedactAccessLog` to uvicorn's access logger, once per process."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactAccessLog) for f in logger.filters):
        logger.addFilter(RedactAccessLog())
