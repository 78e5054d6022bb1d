"""``chunk_seals``: every chunked array's chunks sealed in one table, for every kind of split.

A chunk swapped with another of its array, moved, or copied from another run of the split keeps
a valid crc32c of its own; only a record of which crc32c belongs at which place says it is wrong.
A commit writes that record last before the split document: one uint64 row ``(array code, chunk
index, crc32c, generation)`` per chunk of each sealed array, arrays in code order, the crc32c
read back from each chunk's trailer (docs/FORMAT.md, "Chunk seals"). The codes are one list for
all kinds, so a new kind's arrays get new codes and old tables keep their meaning: a dense split
seals ``features`` (0) and ``labels`` (3), a bag split ``features``, ``coords``, ``offsets`` and
``labels``; an int8 split of either kind its ``scales`` (4) too. Tables written before ``scales``
was sealed have no rows for it: their other rows keep their meaning (:data:`LATER_SEALED`). Dense splits committed before this table existed have none; their statistics rows
(sealed with generation and chunk index) are then the only seal (featurestore.format.metadata).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from featurestore.format import layout

CHUNK_SEALS = "chunk_seals"
# Arrays whose chunks ``chunk_seals`` names, by code (its first column), in its row order.
SEALED_ARRAYS = (layout.FEATURES, "coords", "offsets", layout.LABELS, layout.SCALES)
SEAL_COLUMNS = 4  # array code, chunk index, crc32c, generation
# Arrays sealed only since a later version: a table without rows for one was written before
# (an int8 split's scales), and is compared without it rather than found short.
LATER_SEALED = (layout.SCALES,)


class Generational(Protocol):
    """A split's metadata (format.metadata imports this module, so it is not named here)."""

    @property
    def generation(self) -> str | None: ...


def generation_of(meta: Generational) -> int:
    """The generation as ``chunk_seals`` stores it (0 for a split without one)."""
    return 0 if meta.generation is None else int(meta.generation, 16)


def seal_table(crcs: dict[str, list[int]], generation: int) -> np.ndarray:
    """``chunk_seals``: one uint64 row ``(array code, chunk index, crc32c, generation)`` per chunk
    of each array in ``crcs`` (its chunks' crc32c trailers in index order), arrays in
    ``SEALED_ARRAYS`` order."""
    rows = [(code, index, crc, generation) for code, name in enumerate(SEALED_ARRAYS)
            for index, crc in enumerate(crcs.get(name, ()))]
    return np.asarray(rows, np.uint64).reshape(len(rows), SEAL_COLUMNS)


def sealed_arrays(table: np.ndarray) -> set[str]:
    """The arrays ``table`` is compared on: every sealed array, less those sealed only later that
    it has no rows for (it was written before they were)."""
    codes = set(table[:, 0].astype(np.int64).tolist())
    return {name for code, name in enumerate(SEALED_ARRAYS) if name not in LATER_SEALED or code in codes}


def _compared(table: np.ndarray, crcs: dict[str, list[int | None]]) -> dict[str, list[int | None]]:
    names = sealed_arrays(table)
    return {k: v for k, v in crcs.items() if k in names}


def unsealed(table: np.ndarray, crcs: dict[str, list[int | None]], generation: int) -> set[tuple[str, int]] | None:
    """The chunks whose trailer (None: not compared) is not the one ``table`` seals for their
    place; None when the table does not name the arrays' chunks at all."""
    crcs = _compared(table, crcs)
    expected = seal_table({k: [0 if c is None else c for c in v] for k, v in crcs.items()}, generation)
    if table.shape != expected.shape or not np.array_equal(table[:, :2], expected[:, :2]):
        return None
    out = set()
    for code, index, crc, sealed_generation in table:
        name, index = SEALED_ARRAYS[int(code)], int(index)
        found = crcs[name][index]
        if found is not None and (int(sealed_generation) != generation or found != int(crc)):
            out.add((name, index))
    return out


def seal_problems(table: np.ndarray, crcs: dict[str, list[int | None]], generation: int,
                  ndims: dict[str, int] | None = None) -> list[str]:
    """Why the chunks found (``crcs``: each array's chunk trailers in index order, None for a chunk
    already reported damaged) are not the ones ``table`` sealed: one line per chunk, named as
    ``<array>/c/<index>`` (``ndims``: each array's axes, 2 for features, coords and scales, else 1),
    relative to the split."""
    crcs = _compared(table, crcs)
    expected = seal_table({k: [0 if c is None else c for c in v] for k, v in crcs.items()}, generation)
    if table.shape != expected.shape or not np.array_equal(table[:, :2], expected[:, :2]):
        return [f"{CHUNK_SEALS}: names {len(table)} chunks, the split's arrays have {len(expected)} "
                "(a table from another split or run)"]
    ndims = {layout.FEATURES: 2, "coords": 2, layout.SCALES: 2, **(ndims or {})}

    def where(name: str, index: int) -> str:
        return layout.chunk_key(name, index, ndims.get(name, 1))

    owner = {int(crc): (SEALED_ARRAYS[int(code)], int(index)) for code, index, crc, _ in table}
    problems = []
    for code, index, crc, sealed_generation in table:
        name, index = SEALED_ARRAYS[int(code)], int(index)
        found = crcs[name][index]
        if found is None:
            continue
        if int(sealed_generation) != generation:
            problems.append(f"{CHUNK_SEALS}: row for {where(name, index)} is sealed for generation "
                            f"{int(sealed_generation):x}, the split's is {generation:x}: a file copied from another run")
        elif found != int(crc):
            other = owner.get(found)
            hint = (f"it holds {where(*other)}'s bytes: chunks swapped or moved" if other
                    else "a chunk rewritten with a valid crc32c or copied from another run of the split")
            problems.append(f"{where(name, index)}: crc32c {found:08x}, but the commit sealed {int(crc):08x} "
                            f"for it ({hint})")
    return problems
