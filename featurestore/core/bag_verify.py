"""``featurestore verify`` on a complete bag split (docs/FORMAT.md, "Slide bags": verify).

Checked, every problem listed: the array documents against the split metadata; every chunk of
``features``, ``coords``, ``offsets``, ``labels`` and ``bag_stats`` (size and crc32c; chunk files
beyond the array's chunk count); ``bag_ids`` and ``bag_attrs`` decoded by zarr (whose crc32c codec
checks their bytes); the index (offsets start at 0, never decrease and end at the row count; one
id, label, attribute document and statistics row per bag; ids unique and in order); every
chunk's crc32c trailer against ``chunk_seals`` (a chunk swapped, moved, or copied from another
run keeps a valid crc32c of its own; only its place in the sealed table says it is wrong); each
statistics row's seal; and each bag's rows against its statistics row (row count and channel
means), streamed chunk by chunk, one bag's sums at a time.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from featurestore.core.bag_commit import generation_of, read_strings
from featurestore.format import bags, chunks, dtypes, layout
from featurestore.format.chunk_checks import MEAN_RTOL
from featurestore.format.metadata import SplitMetadata, unseal
from featurestore.format.stats import ChunkStats, row_length

if TYPE_CHECKING:
    from featurestore.core.store import FeatureStore
    from featurestore.core.verify import SplitCheck


def verify_bags(store: FeatureStore, key: str, meta: SplitMetadata, result: SplitCheck) -> None:
    spec = meta.bags or {}
    n, total, dim = int(spec["count"]), int(meta.num_samples), int(meta.sample_shape[0])
    width = row_length(dim) + (2 if meta.generation is not None else 0)
    expected: dict[str, tuple[list[int], str]] = {
        layout.FEATURES: ([total, dim], dtypes.zarr_data_type(meta.logical_dtype)),
        bags.COORDS: ([total, 2], spec["coords"]["dtype"]),
        bags.OFFSETS: ([n + 1], "int64"),
        bags.BAG_STATS: ([n, width], "float64"),
    }
    if spec.get("labels") is not None:
        expected[layout.LABELS] = ([n], spec["labels"]["dtype"])
    values: dict[str, np.ndarray | None] = {}
    crcs: dict[str, list[int | None]] = {}
    for name, (shape, data_type) in expected.items():
        values[name] = _check_array(store, key, name, shape, data_type, meta, result,
                                    keep=name not in (layout.FEATURES, bags.COORDS), crcs=crcs)
    if all(name in crcs for name in expected if name in bags.SEALED_ARRAYS):
        _check_seals(store, key, meta, crcs, result)
    for name in (bags.BAG_IDS, bags.BAG_ATTRS):
        strings = _strings(store, f"{key}/{name}", n, result)
        if strings is not None and name == bags.BAG_IDS:
            if len(set(strings)) != len(strings):
                dup = next(s for i, s in enumerate(strings) if s in strings[:i])
                result.problems.append(f"{key}/{name}: bag id {dup!r} appears more than once")
            elif strings != sorted(strings):
                result.problems.append(f"{key}/{name}: bag ids are not in id order")
        elif strings is not None:
            bad = next((i for i, s in enumerate(strings) if not _is_json_object(s)), None)
            if bad is not None:
                result.problems.append(f"{key}/{name}: entry {bad} is not a JSON object")
    offsets = values.get(bags.OFFSETS)
    if offsets is not None and _offsets_problem(key, offsets, total, result) is None:
        stats = values.get(bags.BAG_STATS)
        if stats is not None and values.get(layout.FEATURES) is not None:
            _check_bags(store, key, meta, offsets, stats, result)


def _check_array(store: FeatureStore, key: str, name: str, shape: list[int], data_type: str,
                 meta: SplitMetadata, result: SplitCheck, *, keep: bool,
                 crcs: dict[str, list[int | None]] | None = None) -> np.ndarray | None:
    """Check one array's document and chunks; its values when ``keep`` (index arrays), else an
    empty marker; None when damaged. ``crcs[name]`` gets each chunk's crc32c trailer (None for a
    chunk missing or damaged)."""
    where = f"{key}/{name}/{layout.ZARR_JSON}"
    try:
        doc = layout.load_document(store.storage.read(where))
        found = (list(doc["shape"]), doc["data_type"], layout.is_compressed(doc))
        rows = layout.array_chunk_rows(doc)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        result.problems.append(f"{where}: missing")
        return None
    except (ValueError, KeyError, TypeError, IndexError) as error:
        result.problems.append(f"{where}: damaged ({type(error).__name__}: {error})")
        return None
    ok = True
    for what, got, want in zip(("shape", "data type", "compressed"), found, (shape, data_type, False)):
        if got != want:
            result.problems.append(f"{where}: {what} {got!r}, but the split metadata says {want!r}")
            ok = False
    if name in (layout.FEATURES, bags.COORDS) and rows != meta.chunk_rows:
        result.problems.append(f"{where}: chunk rows {rows}, but the split metadata says {meta.chunk_rows}")
        ok = False
    if not ok:
        return None
    numpy_dtype = dtypes.storage_dtype(meta.logical_dtype if name == layout.FEATURES else data_type)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * numpy_dtype.itemsize
    count = layout.num_chunks(shape[0], rows)
    present = {int(c) for c in store.storage.listdir(f"{key}/{name}/c") if c.isdigit()}
    extra = sorted(c for c in present if c >= count)
    if extra:
        result.problems.append(f"{key}/{name}: chunk(s) {extra} beyond the array's {count} chunks")
    parts = []
    trailers: list[int | None] = [None] * count
    if crcs is not None:
        crcs[name] = trailers
    for index in range(count):
        chunk = layout.chunk_key(f"{key}/{name}", index, len(shape))
        try:
            raw = store.storage.read(chunk)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            result.problems.append(f"{chunk}: missing")
            ok = False
            continue
        result.chunks_checked += 1
        problem = chunks.check(raw, rows * row_bytes)
        if problem:
            result.problems.append(f"{chunk}: {problem}")
            ok = False
            continue
        trailers[index] = int.from_bytes(raw[-layout.CRC_BYTES :], "little")
        if keep:
            parts.append(np.frombuffer(raw[: -layout.CRC_BYTES], numpy_dtype).reshape(rows, *shape[1:]))
    if not ok:
        return None
    if not keep:
        return np.empty(0)
    joined = np.concatenate(parts) if parts else np.empty((0, *shape[1:]), numpy_dtype)
    return joined[: shape[0]]


def _check_seals(store: FeatureStore, key: str, meta: SplitMetadata, crcs: dict[str, list[int | None]],
                 result: SplitCheck) -> None:
    """Each chunk's crc32c trailer against the one ``chunk_seals`` holds for its place (called
    once every sealed array's document was readable: their chunk counts size the table)."""
    count = sum(len(crcs.get(name, ())) for name in bags.SEALED_ARRAYS)
    table = _check_array(store, key, bags.CHUNK_SEALS, [count, bags.SEAL_COLUMNS], "uint64", meta, result, keep=True)
    if table is not None:
        result.problems.extend(f"{key}/{p}" for p in bags.seal_problems(table, crcs, generation_of(meta)))


def _strings(store: FeatureStore, array_key: str, n: int, result: SplitCheck) -> list[str] | None:
    try:
        strings = read_strings(store.storage, array_key)
    except Exception as error:  # zarr raises its own types for a missing or damaged array
        result.problems.append(f"{array_key}: unreadable ({type(error).__name__}: {error})")
        return None
    result.chunks_checked += -(-len(strings) // 65536)
    if len(strings) != n:
        result.problems.append(f"{array_key}: {len(strings)} entries, the split metadata counts {n} bags")
        return None
    return strings


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _offsets_problem(key: str, offsets: np.ndarray, total: int, result: SplitCheck) -> str | None:
    problem = None
    if len(offsets) == 0 or offsets[0] != 0:
        problem = "does not start at 0"
    elif np.any(np.diff(offsets) < 0):
        problem = f"decreases at bag {int(np.argmax(np.diff(offsets) < 0))}"
    elif offsets[-1] != total:
        problem = f"ends at row {int(offsets[-1])}, but features hold {total} rows"
    if problem:
        result.problems.append(f"{key}/{bags.OFFSETS}: {problem}")
    return problem


def _check_bags(store: FeatureStore, key: str, meta: SplitMetadata, offsets: np.ndarray,
                stats: np.ndarray, result: SplitCheck) -> None:
    """Seals, then each bag's rows against its statistics row, one features chunk at a time."""
    rows, dim, total = meta.chunk_rows, int(meta.sample_shape[0]), int(meta.num_samples)
    expected_rows: list[ChunkStats] = []
    for i, sealed in enumerate(stats):
        row, generation, at = unseal(sealed, meta)
        if meta.generation is not None and (generation != meta.generation_number or at != i):
            result.problems.append(f"{key}/{bags.BAG_STATS}: row {i} is sealed for another run or bag "
                                   f"(generation {int(generation or 0):x}, bag {at}): a file moved or copied")
            return
        expected_rows.append(ChunkStats.from_row(row))
    storage = dtypes.storage_dtype(meta.logical_dtype)
    bag, sums = 0, np.zeros(dim, np.float64)
    n = len(expected_rows)
    for index in range(layout.num_chunks(total, rows)):
        raw = store.storage.read(layout.chunk_key(f"{key}/{layout.FEATURES}", index, 2))
        lo, hi = index * rows, min(total, (index + 1) * rows)
        values = dtypes.stored_as_float32(np.frombuffer(raw[: -layout.CRC_BYTES], storage), meta.logical_dtype)
        values = values.reshape(rows, dim)
        while bag < n:
            start, stop = int(offsets[bag]), int(offsets[bag + 1])
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                sums += values[a - lo : b - lo].sum(axis=0, dtype=np.float64)
            if stop > hi:
                break
            _bag_matches(key, bag, stop - start, sums, expected_rows[bag], result)
            bag, sums = bag + 1, np.zeros(dim, np.float64)
    while bag < n:  # empty bags at the end
        _bag_matches(key, bag, int(offsets[bag + 1] - offsets[bag]), sums, expected_rows[bag], result)
        bag += 1


def _bag_matches(key: str, bag: int, count: int, sums: np.ndarray, stats: ChunkStats, result: SplitCheck) -> None:
    if stats.values != count * stats.channels:
        result.problems.append(f"{key}: bag {bag} has {count} rows, its statistics row counts "
                               f"{stats.values // max(1, stats.channels)}")
        return
    if count == 0:
        return
    mean = sums / count
    scale = max(1.0, float(np.abs(stats.mean).max(initial=0.0)))
    if not np.allclose(mean, stats.mean, rtol=MEAN_RTOL, atol=MEAN_RTOL * scale):
        worst = int(np.argmax(np.abs(mean - stats.mean)))
        result.problems.append(f"{key}: the rows of bag {bag} do not match its statistics row (channel {worst}: "
                               f"{mean[worst]:.6g} vs {stats.mean[worst]:.6g}): rows moved or swapped")

