"""HTML built from Python strings, escaped by default.

Every value put into a template goes through :func:`esc` unless it is already :class:`Html`
(markup this package built itself), so a bag id or a metadata string holding ``<script>`` shows
as text. Templates are string literals of this package, never data.
"""

from __future__ import annotations

import html
import json
import numbers
from collections.abc import Iterable
from typing import Any

STATIC = "/ui/static"


class Html(str):
    """A string of markup that is safe to insert as it is."""

    __slots__ = ()


def esc(value: Any) -> Html:
    """``value`` as text: markup passes through, anything else is ``str()``-ed and escaped."""
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def _arg(value: Any) -> Any:
    # Numbers stay numbers (their text is markup-free, and ``{:.1f}`` still applies to them).
    return value if isinstance(value, numbers.Real) and not isinstance(value, bool) else esc(value)


def h(template: str, *args: Any, **kwargs: Any) -> Html:
    """``template.format(...)`` with every argument escaped (:class:`Html` arguments as they are)."""
    return Html(template.format(*(_arg(a) for a in args), **{k: _arg(v) for k, v in kwargs.items()}))


def join(parts: Iterable[Html], sep: str = "") -> Html:
    return Html(sep.join(esc(part) for part in parts))


def compact_json(value: Any, limit: int = 400) -> str:
    """A metadata value as one line of JSON (strings shown without quotes), cut at ``limit``."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def size_text(nbytes: float | None) -> str:
    if nbytes is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{int(nbytes)} B" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def figure(value: Any, spec: str = ".3g") -> str:
    """A number of the quantization report; ``null`` (not representable) shows as n/a."""
    if value is None:
        return "n/a"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return format(value, spec)


def page(title: str, body: Html, crumbs: Iterable[tuple[str, str | None]] = ()) -> Html:
    """A whole document: head (the packaged stylesheet, no script), breadcrumbs, ``body``."""
    trail = [h('<a href="/">store</a>')]
    for label, href in crumbs:
        trail.append(h('<a href="{}">{}</a>', href, label) if href else h("<span>{}</span>", label))
    return h(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        "<title>{title} \u00b7 featurestore</title>"
        '<link rel="icon" href="{static}/favicon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="{static}/style.css"></head>\n'
        '<body><header><nav class="crumbs">{trail}</nav></header>\n<main>{body}</main>\n'
        '<footer>featurestore {version} \u00b7 JSON API under <a href="/v1/datasets">/v1</a> '
        '(docs/SERVER.md)</footer>'
        "</body></html>\n",
        title=title, static=STATIC, version=_version(), trail=join(trail, " / "), body=body,
    )


def _version() -> str:
    from featurestore import __version__

    return __version__
