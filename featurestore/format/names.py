"""Names of datasets, encoders and splits: the one check that is also the path-traversal guard."""

from __future__ import annotations

import re

from featurestore.errors import InvalidName

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME_RE = re.compile(NAME_PATTERN)


def validate_name(value: object, what: str = "name") -> str:
    """Return ``value`` if it is a valid name, else raise :class:`InvalidName` saying why.

    ``..`` cannot pass (it starts with a dot), nor can anything with a slash, a backslash, a
    percent-encoded byte or a NUL, because only ``[A-Za-z0-9._-]`` is allowed after a leading
    letter or digit.
    """
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None:
        raise InvalidName(
            f"invalid {what} {value!r}: names must match {NAME_PATTERN} "
            "(start with a letter or digit; then letters, digits, '.', '_' or '-'; at most 128 "
            "characters). Rename it, e.g. 'pannuke-fold1'."
        )
    return value
