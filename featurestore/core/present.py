"""Which chunks are on storage: the one rule, for a split's arrays and a bag segment's alike.

A chunk index counts as present when every array asked for lists it. Locally a listing is not
proof enough: ``c/<i>/`` exists from the moment a put of chunk ``i`` starts (makedirs, then the
atomic rename of the file), and a writer killed in between leaves it empty; so there each
chunk's file itself is asked for, at its full size where that is known. Object stores have no
empty directories and every put is atomic: their listing is the proof (``sizes=True`` asks them
too, one stat per chunk, nothing read).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from featurestore.core.storage import Storage
from featurestore.format import layout

# (array name, ndim, payload bytes of one chunk or None when unknown: compressed)
Array = tuple[str, int, "int | None"]


def present_chunks(storage: Storage, base: str, arrays: Sequence[Array], *, among: Iterable[int] | None = None,
                   sizes: bool | None = None) -> set[int]:
    """The chunk indices (of ``among``, if given) present in every array of ``arrays`` under
    ``base`` (a split or a segment); ``sizes``: each file's size checked too (default: locally)."""
    found: set[int] | None = None
    for name, _, _ in arrays:
        listed = {int(n) for n in storage.listdir(f"{base}/{name}/c") if n.isdigit()}
        found = listed if found is None else found & listed
    out = found or set()
    if among is not None:
        out &= set(among)
    if sizes is None:
        sizes = storage.local_path(base) is not None
    if sizes:
        out = {i for i in out if all(full_size(storage, base, array, i) for array in arrays)}
    return out


def full_size(storage: Storage, base: str, array: Array, index: int) -> bool:
    """Whether chunk ``index`` of ``array`` is a file of its full size (any size when unknown)."""
    name, ndim, nbytes = array
    size = storage.size(layout.chunk_key(f"{base}/{name}", index, ndim))
    return size is not None and (nbytes is None or size == nbytes + layout.CRC_BYTES)
