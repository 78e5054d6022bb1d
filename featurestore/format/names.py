"""Names of datasets, encoders and splits: the one check that is also the path-traversal guard.

A name is one path segment at a fixed depth (``<dataset>/<encoder>/<split>``, docs/FORMAT.md), so
it can collide only with what the store's layout puts beside it at that depth. Two things do:

* ``zarr.json``: the group document of the root, of every dataset and of every encoder. Locally a
  split named so cannot be created (the file is there); on object storage it could, and then
  sits beside its encoder's document, hidden from ``verify`` and deleted with it by an overwrite.
  Refused in any letter case: on a case-insensitive file system (macOS, Windows) ``ZARR.JSON``
  is the same file.
* names ending in ``.tmp``: the temporary files of atomic local writes
  (``.<name>.<pid>.<id>.tmp``, featurestore.core.storage) are skipped by every listing and
  removed by a resume's clean-up, so such a dataset, encoder or split would vanish.

The arrays inside a split (``features``, ``labels``, ``ids``, ``chunk_stats``) and their chunk
directories (``c``) live one level below the split's name, never beside a name, so they stay
valid names (a split may be called ``features``).
"""

from __future__ import annotations

import re

from featurestore.errors import InvalidName
from featurestore.format import layout

# Temporary files of atomic local writes: ``.<final name>.<pid>.<random hex>.tmp`` in the final
# file's directory (featurestore.core.storage). The pid lets a resume tell a dead writer's leftover
# from a live writer's file (featurestore.core.leftovers).
TMP_SUFFIX = ".tmp"
_TMP_RE = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)\.(?P<token>[0-9a-f]+)\.tmp")

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_NAME_RE = re.compile(NAME_PATTERN)
# Reserved whole names (compared in lower case) and suffixes, with the reason each is refused.
RESERVED_NAMES = {layout.ZARR_JSON: "it is the group document at every level of the store"}
RESERVED_SUFFIXES = {TMP_SUFFIX: "it marks the temporary files of atomic writes, which listings skip"}


def validate_name(value: object, what: str = "name") -> str:
    """Return ``value`` if it is a valid name, else raise :class:`InvalidName` saying why.

    ``..`` cannot pass (it starts with a dot), nor can anything with a slash, a backslash, a
    percent-encoded byte or a NUL, because only ``[A-Za-z0-9._-]`` is allowed after a leading
    letter or digit. Names the layout uses beside datasets, encoders and splits are refused too
    (see the module docstring).
    """
    if not isinstance(value, str) or _NAME_RE.fullmatch(value) is None:
        raise InvalidName(
            f"invalid {what} {value!r}: names must match {NAME_PATTERN} "
            "(start with a letter or digit; then letters, digits, '.', '_' or '-'; at most 128 "
            "characters). Rename it, e.g. 'pannuke-fold1'."
        )
    reason = reserved_reason(value)
    if reason is not None:
        raise InvalidName(f"invalid {what} {value!r}: reserved by the store's layout ({reason}). "
                          "Rename it, e.g. 'pannuke-fold1'.")
    return value


def reserved_reason(value: str) -> str | None:
    """Why ``value`` is reserved by the store's layout, or None if it is not."""
    lower = value.lower()
    if lower in RESERVED_NAMES:
        return f"{value!r}: {RESERVED_NAMES[lower]}"
    for suffix, reason in RESERVED_SUFFIXES.items():
        if lower.endswith(suffix):
            return f"names ending in {suffix!r}: {reason}"
    return None


def tmp_name(final: str, pid: int, token: str) -> str:
    """The temporary file name under which ``final`` is written before its atomic rename."""
    return f".{final}.{pid}.{token}{TMP_SUFFIX}"


def tmp_writer_pid(name: str) -> int | None:
    """The pid of the process that writes the temporary file ``name``; None if ``name`` is not
    one (any other ``*.tmp`` entry: a leftover of an unknown writer)."""
    match = _TMP_RE.fullmatch(name)
    return int(match.group("pid")) if match else None
