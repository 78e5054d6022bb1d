"""Credential redaction: the one mechanism behind every message, repr and log line that may quote a
URL or a storage option. No I/O.

Two entry points:

* :func:`redact_url` masks the userinfo of ONE URL value (a store URL, an ``endpoint_url``, a
  server address) before it is put into a message or a repr. Use it wherever the value is known.
* :func:`redact` masks credentials anywhere in free text (a backend's error message, a log line):
  URL userinfo, bearer tokens, secret-looking query parameters and ``"secret": "..."`` fields.

Userinfo is everything between ``scheme://`` and the LAST ``@`` of the URL (RFC 3986 3.2.1: the
host follows the last ``@``; a raw ``@``, ``:``, ``/``, ``?`` or ``#`` typed into a password, which a
strict parser would cut elsewhere, is masked all the same). That errs toward masking: a path that
holds an ``@`` (never a featurestore key, see ``names``) loses its part before the ``@`` in messages.
One exception keeps messages useful: Azure's ``abfs://container@account...`` names a container, not
a credential, and stays visible.
"""

from __future__ import annotations

import re

__all__ = ["MASK", "redact", "redact_url"]

MASK = "***"

_SCHEME = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://")
# Azure URLs put the container where userinfo goes; container names follow this rule.
_AZURE_SCHEMES = ("abfs://", "abfss://", "az://", "adl://")
_AZURE_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9-]{1,61}[a-z0-9])?")
_SECRET_PARAM = re.compile(
    r"(?i)\b(token|access_token|secret|password|key|signature|x-amz-signature|x-amz-credential|"
    r"x-amz-security-token|sig|sas_token)=[^&\s'\"]+"
)
# The credential after "Bearer" is masked unless the whole word is one that names a credential
# rather than being one: "missing or wrong bearer token: send ..." keeps its words. (A server whose
# token is literally "token" shows it; any other value, "token2" or "token.x" too, is masked.)
_TOKEN68 = r"[A-Za-z0-9._~+/=-]"
_BEARER = re.compile(
    rf"(?i)\b(bearer)\s+(?!(?:tokens?|auth|authentication|authorization|credentials?|header|scheme)"
    rf"(?!{_TOKEN68})){_TOKEN68}+"
)
# "secret": "...", 'key': '...', secret=... in a dict's repr or a JSON text (a storage-options dict
# quoted by some library's message): the value goes, the name stays; an empty value is no secret
# and stays visible ("token": "" says the token is empty).
_SECRET_FIELD = re.compile(
    r"""(?ix)(["']?\b(?:key|secret|token|password|passwd|account_key|sas_token|sas_key|client_secret|
    session_token|access_key_id|secret_access_key|aws_access_key_id|aws_secret_access_key|
    aws_session_token|service_account_key)\b["']?\s*:\s*)(["'])(?:\\.|(?!\2).)+\2"""
)


def redact_url(url: str) -> str:
    """``url`` with its userinfo masked: ``http://alice:p@ss@host/x`` -> ``http://***@host/x``.

    A value without a scheme (``alice:pw@host:9000``) is masked up to its last ``@`` too."""
    match = _SCHEME.match(url)
    prefix = match.group(0) if match else ""
    rest = url[len(prefix):]
    userinfo, at, host = rest.rpartition("@")
    if not at or _is_azure_container(prefix, userinfo):
        return url
    return f"{prefix}{MASK}@{host}"


def redact(text: str) -> str:
    """``text`` with URL userinfo, bearer tokens, secret-looking query parameters and secret
    fields masked: ``GET http://alice:pw123@host/x failed`` -> ``GET http://***@host/x failed``.

    A URL in free text runs to the next whitespace, or, when it opens right after a quote, to the
    matching unescaped quote (a ``repr`` or JSON string: a password may hold the other quote)."""
    text = _redact_urls(text)
    text = _SECRET_FIELD.sub(lambda m: f"{m.group(1)}{m.group(2)}{MASK}{m.group(2)}", text)
    text = _SECRET_PARAM.sub(rf"\1={MASK}", text)
    return _BEARER.sub(rf"\1 {MASK}", text)


def _redact_urls(text: str) -> str:
    out: list[str] = []
    position = 0
    for match in _SCHEME.finditer(text):
        if match.start() < position:  # inside a URL already handled (a URL in a URL's query)
            continue
        end = _url_end(text, match.end(), text[match.start() - 1] if match.start() else "")
        out.append(text[position:match.start()])
        out.append(redact_url(text[match.start():end]))
        position = end
    out.append(text[position:])
    return "".join(out)


def _url_end(text: str, start: int, opener: str) -> int:
    """Where the URL that starts before ``start`` ends: the closing quote when it was opened by a
    quote (skipping backslash escapes), else the next whitespace."""
    i = start
    while i < len(text):
        char = text[i]
        if opener in ("'", '"'):
            if char == "\\":
                i += 2
                continue
            if char == opener:
                return i
        if char.isspace():
            return i
        i += 1
    return len(text)


def _is_azure_container(prefix: str, userinfo: str) -> bool:
    return prefix.lower() in _AZURE_SCHEMES and _AZURE_CONTAINER.fullmatch(userinfo) is not None
