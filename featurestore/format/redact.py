"""Credential redaction for every message and log line that may quote a URL (issue 12.8).

Used by the HTTP client (its repr, errors) and the server (error bodies, log lines); no I/O.
"""

from __future__ import annotations

import re

__all__ = ["redact"]

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s'\"]*@")
_SECRET_PARAM = re.compile(
    r"(?i)\b(token|access_token|secret|password|key|signature|x-amz-signature|x-amz-credential)"
    r"=[^&\s'\"]+"
)
_BEARER = re.compile(r"(?i)\b(bearer)\s+[A-Za-z0-9._~+/=-]+")


def redact(text: str) -> str:
    """``text`` with URL userinfo, bearer tokens and secret-looking query parameters masked.

    Applied to every message and log line that may quote a URL (issue 12.8):
    ``http://alice:pw123@host`` -> ``http://***@host``.
    """
    text = _USERINFO.sub(r"\1***@", text)
    text = _SECRET_PARAM.sub(r"\1=***", text)
    return _BEARER.sub(r"\1 ***", text)
