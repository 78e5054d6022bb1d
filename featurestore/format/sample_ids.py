"""A dense split's samples by id: the positions of given ids, with one error for an unknown one.

Used by ``FeatureArray.positions_of`` and the server's by-id route (``wire.BY_ID``), so a store read
and an HTTP read name a missing id the same way. No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from featurestore.errors import InvalidIndices, SampleNotFound

__all__ = ["id_positions", "positions_of"]

_SHOWN = 3


def id_positions(ids: Sequence[str]) -> dict[str, int]:
    """``{id: position}`` of a split's ids (ids are unique by the format's rule)."""
    return {str(sample): i for i, sample in enumerate(ids)}


def positions_of(wanted: Sequence[str], table: Mapping[str, int], where: str) -> np.ndarray:
    """int64 positions of ``wanted`` ids (any order, repeats allowed) in ``table``
    (:func:`id_positions`); :class:`SampleNotFound` naming the first unknown id."""
    if isinstance(wanted, (str, bytes)):
        raise InvalidIndices(f"ids must be a list of sample ids, not one {type(wanted).__name__}: "
                             f"pass [{wanted!r}]")
    out = np.empty(len(wanted), np.int64)
    for k, sample in enumerate(wanted):
        if not isinstance(sample, str):
            raise InvalidIndices(f"a sample id is a str, but got {type(sample).__name__} {sample!r}; "
                                 "use positions for integer reads")
        found = table.get(sample)
        if found is None:
            some = ", ".join(repr(i) for i in list(table)[:_SHOWN]) + (", ..." if len(table) > _SHOWN else "")
            raise SampleNotFound(f"no sample {sample[:200]!r} in {where} ({len(table)} samples: {some or 'none'}): "
                                 "check the id (.ids lists them)")
        out[k] = found
    return out
