"""The one array checker of ``featurestore verify`` and of a resume's damage check, every kind.

An array is checked as its split's metadata describes it (:class:`Expected`): its document
(present, JSON, an array, shape, chunk rows, data type, compression), then each chunk (present,
a file, its size, its crc32c) and chunk files beyond the array's count. A kind adds what only it
knows through ``each`` (a dense split's statistics rows and features against them) and compares
the trailers collected in ``crcs`` with its ``chunk_seals`` (featurestore.format.seals).
Every problem goes into ``found``; nothing stops at the first one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.core.split_kind import Findings
from featurestore.core.storage import Storage
from featurestore.format import chunks, layout
from featurestore.format.seals import CHUNK_SEALS, LATER_SEALED, SEAL_COLUMNS, SEALED_ARRAYS, seal_problems


@dataclass(frozen=True)
class Expected:
    """An array as the split metadata describes it."""

    shape: list[int]
    data_type: str
    stored: np.dtype  # the dtype of its stored values (bfloat16: uint16 bits)
    chunk_rows: int | None = None  # None: any (the index arrays chose their own)
    compressed: bool = False

    @property
    def chunk_bytes(self) -> int | None:
        """Payload bytes of one chunk, None when compressed (then any size)."""
        if self.compressed or self.chunk_rows is None:
            return None
        return self.chunk_rows * int(np.prod(self.shape[1:], dtype=np.int64)) * self.stored.itemsize


def read_json(storage: Storage, where: str, found: Findings) -> dict[str, Any] | None:
    """The JSON object at ``where``, or None with the problem in ``found``."""
    try:
        raw = storage.read(where)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        found.problems.append(f"{where}: missing")
        return None
    try:
        doc = layout.load_document(raw)
    except ValueError as error:
        found.problems.append(f"{where}: not valid JSON ({error})")
        return None
    if not isinstance(doc, dict):
        found.problems.append(f"{where}: not a JSON object")
        return None
    return doc


def check_document(storage: Storage, key: str, name: str, expected: Expected, found: Findings) -> int | None:
    """The array's document against ``expected``: its chunk rows, or None when it is wrong."""
    where = f"{key}/{name}/{layout.ZARR_JSON}"
    doc = read_json(storage, where, found)
    if doc is None:
        return None
    if doc.get("node_type") != "array":
        found.problems.append(f"{where}: not an array document")
        return None
    try:
        rows = layout.array_chunk_rows(doc)
        got = (list(doc["shape"]), rows, doc["data_type"], layout.is_compressed(doc))
    except (KeyError, TypeError, IndexError, ValueError) as error:
        found.problems.append(f"{where}: damaged ({type(error).__name__}: {error})")
        return None
    want = (expected.shape, rows if expected.chunk_rows is None else expected.chunk_rows, expected.data_type,
            expected.compressed)
    ok = True
    for what, a, b in zip(("shape", "chunk rows", "data type", "compressed"), got, want):
        if a != b:
            found.problems.append(f"{where}: {what} {a!r}, but the split metadata says {b!r}")
            ok = False
    return rows if ok else None


def check_array(storage: Storage, key: str, name: str, expected: Expected, found: Findings, *,
                keep: bool = False, crcs: dict[str, list[int | None]] | None = None, bad: set[int] | None = None,
                read: bool = True, each: Callable[[int, bytes], str | None] | None = None) -> np.ndarray | None:
    """Check one array's document and chunks; its values when ``keep`` (small arrays), else an
    empty marker; None when damaged. ``crcs[name]`` gets each chunk's crc32c trailer (None for a
    chunk missing or damaged); ``bad`` the indices of chunks missing, damaged or beyond the
    count. ``each(index, raw)``: the kind's own check of a chunk whose crc32c is valid (its
    problem is reported, the chunk counted damaged). ``read=False``: chunk sizes only (a stat
    each, nothing read)."""
    rows = check_document(storage, key, name, expected, found)
    if rows is None:
        return None
    ok = True
    ndim = len(expected.shape)
    payload = Expected(expected.shape, expected.data_type, expected.stored, rows, expected.compressed).chunk_bytes
    count = layout.num_chunks(expected.shape[0], rows)
    present = {int(c) for c in storage.listdir(f"{key}/{name}/c") if c.isdigit()}
    extra = sorted(c for c in present if c >= count)
    if extra:
        found.problems.append(f"{key}/{name}: chunk(s) {extra} beyond the array's {count} chunks")
        if bad is not None:
            bad.update(extra)
    parts = []
    trailers: list[int | None] = [None] * count
    if crcs is not None:
        crcs[name] = trailers

    def damaged(index: int, problem: str) -> None:
        nonlocal ok
        found.problems.append(f"{layout.chunk_key(f'{key}/{name}', index, ndim)}: {problem}")
        ok = False
        if bad is not None:
            bad.add(index)

    for index in range(count):
        chunk = layout.chunk_key(f"{key}/{name}", index, ndim)
        if not read:
            size = storage.size(chunk)  # a directory (a put begun, never renamed) has another size
            if size is None or (payload is not None and size != payload + layout.CRC_BYTES):
                damaged(index, "missing" if size is None else f"{size} bytes")
            continue
        try:
            raw = storage.read(chunk)
        except (FileNotFoundError, NotADirectoryError):
            damaged(index, "missing")
            continue
        except IsADirectoryError:
            damaged(index, "is a directory, not a chunk file")
            continue
        found.chunks_checked += 1
        problem = chunks.check(raw, payload)
        if problem is None and each is not None:
            problem = each(index, raw)
        if problem:
            damaged(index, problem)
            continue
        trailers[index] = int.from_bytes(raw[-layout.CRC_BYTES :], "little")
        if keep:
            parts.append(np.frombuffer(raw[: -layout.CRC_BYTES], expected.stored).reshape(rows, *expected.shape[1:]))
    if not ok:
        return None
    if not keep:
        return np.empty(0)
    joined = np.concatenate(parts) if parts else np.empty((0, *expected.shape[1:]), expected.stored)
    return joined[: expected.shape[0]]


def seals_expected(count: int) -> Expected:
    """``chunk_seals`` sealing ``count`` chunks."""
    return Expected([count, SEAL_COLUMNS], "uint64", np.dtype(np.uint64))


def seal_rows(storage: Storage, key: str, crcs: dict[str, list[int | None]]) -> int:
    """How many rows split ``key``'s ``chunk_seals`` must have for the chunks in ``crcs``: one per
    chunk of each sealed array, less the arrays sealed only later when the stored table has
    exactly the rows of the others (written before they were sealed: format.seals.LATER_SEALED)."""
    count = sum(len(crcs.get(name, ())) for name in SEALED_ARRAYS)
    later = sum(len(crcs.get(name, ())) for name in LATER_SEALED)
    if later:
        try:
            stored = layout.load_document(storage.read(f"{key}/{CHUNK_SEALS}/{layout.ZARR_JSON}"))["shape"][0]
        except (OSError, ValueError, KeyError, IndexError, TypeError):  # missing or damaged: check_array says which
            return count
        if stored == count - later:
            return count - later
    return count


def check_seals(storage: Storage, key: str, generation: int, crcs: dict[str, list[int | None]], found: Findings,
                ndims: dict[str, int] | None = None) -> None:
    """Each chunk's crc32c trailer in ``crcs`` (from :func:`check_array`; every sealed array's
    document was readable, so their chunk counts size the table) against the one ``chunk_seals``
    holds for its place; ``ndims`` names the chunks (format.seals.seal_problems)."""
    table = check_array(storage, key, CHUNK_SEALS, seals_expected(seal_rows(storage, key, crcs)), found, keep=True)
    if table is not None:
        found.problems.extend(f"{key}/{p}" for p in seal_problems(table, crcs, generation, ndims))
