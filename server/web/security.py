"""Response headers of every page and picture: nothing but this server's own files may load
(the page works offline and no injected markup could fetch or run anything), no framing, no
Referer (a ``?token=`` URL never leaks through it), no MIME sniffing."""

from __future__ import annotations

CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")  # fmt: skip

PAGE_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
