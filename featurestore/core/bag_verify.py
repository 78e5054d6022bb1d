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
from dataclasses import dataclass, field

import numpy as np

from featurestore.core import block_verify
from featurestore.core.bag_commit import read_strings
from featurestore.core.array_check import Expected, check_array, check_seals, seal_rows, seals_expected
from featurestore.core.split_kind import Findings
from featurestore.core.storage import Storage
from featurestore.format import bags, dtypes, layout
from featurestore.format.chunk_checks import MEAN_RTOL
from featurestore.format.metadata import SplitMetadata, unseal
from featurestore.format.seals import generation_of, unsealed
from featurestore.format.stats import ChunkStats, row_length



@dataclass
class _Found:
    """The problems a repair's check found (the two fields of a ``SplitCheck`` it fills)."""

    problems: list[str] = field(default_factory=list)
    chunks_checked: int = 0


@dataclass
class BagIndex:
    """A complete bag split's index as its commit wrote it, every part checked (``read_index``)."""

    ids: list[str]
    attrs: list[str]
    offsets: np.ndarray
    labels: np.ndarray | None
    stats: np.ndarray  # the sealed statistics rows
    seals: np.ndarray  # the chunk_seals table


def _expected(meta: SplitMetadata) -> dict[str, Expected]:
    """Each array as the split metadata describes it."""
    spec = meta.bags or {}
    n, total, dim, rows = int(spec["count"]), int(meta.num_samples), int(meta.sample_shape[0]), meta.chunk_rows
    width = row_length(dim) + (2 if meta.generation is not None else 0)
    coords = spec["coords"]["dtype"]
    expected = {
        layout.FEATURES: Expected([total, dim], dtypes.zarr_data_type(meta.logical_dtype),
                                  dtypes.storage_dtype(meta.logical_dtype), rows),
        bags.COORDS: Expected([total, 2], coords, np.dtype(coords), rows),
        bags.OFFSETS: Expected([n + 1], "int64", np.dtype(np.int64)),
        bags.BAG_STATS: Expected([n, width], "float64", np.dtype(np.float64)),
    }
    if spec.get("labels") is not None:
        label = spec["labels"]["dtype"]
        expected[layout.LABELS] = Expected([n], label, np.dtype(label))
    if dtypes.is_int8(meta.logical_dtype):  # one float32 row per bag: its codes are nothing without it
        expected[layout.SCALES] = Expected([n, dim], "float32", np.dtype(np.float32))
    return expected


def read_index(storage: Storage, key: str, meta: SplitMetadata) -> tuple[BagIndex | None, list[str]]:
    """The split's index, or None with the problems when any part of it is missing, damaged or
    inconsistent (as verify checks it; the seals of ``offsets`` and ``labels`` too). Without a
    sound index no damaged chunk can be traced to its bags."""
    found, expected = _Found(), _expected(meta)
    n, total = int((meta.bags or {})["count"]), int(meta.num_samples)
    crcs: dict[str, list[int | None]] = {name: [None] * layout.num_chunks(total, meta.chunk_rows)
                                         for name in (layout.FEATURES, bags.COORDS)}
    values = {name: check_array(storage, key, name, expected[name], found, keep=True, crcs=crcs)
              for name in expected if name not in (layout.FEATURES, bags.COORDS)}
    seals = check_array(storage, key, bags.CHUNK_SEALS, seals_expected(seal_rows(storage, key, crcs)), found, keep=True)
    ids, attrs = (_strings(storage, f"{key}/{name}", n, found) for name in (bags.BAG_IDS, bags.BAG_ATTRS))
    offsets, stats = values[bags.OFFSETS], values[bags.BAG_STATS]
    if seals is not None and all(v is not None for v in values.values()):
        wrong = unsealed(seals, crcs, generation_of(meta))
        if wrong is None or wrong:
            found.problems.append(f"{key}/{bags.CHUNK_SEALS}: does not seal the index chunks found")
    if ids is not None and ids != sorted(set(ids)):
        found.problems.append(f"{key}/{bags.BAG_IDS}: bag ids are not unique and in id order")
    if offsets is not None:
        _offsets_problem(key, offsets, total, found)
    if stats is not None and meta.generation is not None:
        for i, sealed in enumerate(stats):
            _, generation, at = unseal(sealed, meta)
            if generation != meta.generation_number or at != i:
                found.problems.append(f"{key}/{bags.BAG_STATS}: row {i} is sealed for another run or bag")
                break
    if found.problems or ids is None or attrs is None or offsets is None or stats is None or seals is None:
        return None, found.problems
    return BagIndex(ids, attrs, offsets, values.get(layout.LABELS), stats, seals), []


def damaged_row_chunks(storage: Storage, key: str, meta: SplitMetadata, index: BagIndex, *,
                       crc: bool) -> set[int] | None:
    """The ``features``/``coords`` chunks to rewrite: missing, of the wrong size, beyond the count
    and, with ``crc`` (every chunk read), damaged or not the chunk ``chunk_seals`` holds for its
    place. None when an array document is wrong (nothing can be traced to bags then)."""
    found, expected = _Found(), _expected(meta)
    bad: set[int] = set()
    crcs: dict[str, list[int | None]] = {}
    for name in (layout.FEATURES, bags.COORDS):
        check_array(storage, key, name, expected[name], found, crcs=crcs, bad=bad, read=crc)
        if name not in crcs:
            return None
    if crc:
        for name in (bags.OFFSETS, layout.LABELS, layout.SCALES):
            if name in expected:  # checked by read_index: None, not compared again
                rows = layout.num_chunks(expected[name].shape[0], _chunk_rows(storage, f"{key}/{name}"))
                crcs[name] = [None] * rows
        wrong = unsealed(index.seals, crcs, generation_of(meta))
        if wrong is None:
            return None
        bad.update(i for _, i in wrong)
    return bad


def _chunk_rows(storage: Storage, array_key: str) -> int:
    return layout.array_chunk_rows(layout.load_document(storage.read(f"{array_key}/{layout.ZARR_JSON}")))


def verify_bags(storage: Storage, key: str, meta: SplitMetadata, result: Findings) -> None:
    spec = meta.bags or {}
    n, total = int(spec["count"]), int(meta.num_samples)
    expected = _expected(meta)
    values: dict[str, np.ndarray | None] = {}
    crcs: dict[str, list[int | None]] = {}
    blocks = block_verify.table(storage, key, meta, result)
    rows = block_verify.RowChecks(blocks, meta)
    bad: set[int] = set()

    def features_chunk(index: int, raw: bytes) -> str | None:
        rows.check(index, raw)
        return None

    for name, spec_of in expected.items():
        features = name == layout.FEATURES
        values[name] = check_array(storage, key, name, spec_of, result,
                                   keep=name not in (layout.FEATURES, bags.COORDS), crcs=crcs,
                                   each=features_chunk if features else None, bad=bad if features else None)
    block_verify.name_damaged_blocks(storage, key, meta, result, blocks, bad)
    if all(name in crcs for name in expected if name in bags.SEALED_ARRAYS):
        check_seals(storage, key, generation_of(meta), crcs, result)
    rows.report(key, result)
    for name in (bags.BAG_IDS, bags.BAG_ATTRS):
        strings = _strings(storage, f"{key}/{name}", n, result)
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
        scales = values.get(layout.SCALES)
        # int8 values are codes times scales: damaged or missing scales are already reported
        # above, and every bag would then look unlike its statistics row, for no fault of its own.
        if stats is not None and values.get(layout.FEATURES) is not None and (
                scales is not None or layout.SCALES not in expected):
            _check_bags(storage, key, meta, offsets, stats, scales, result)


def _strings(storage: Storage, array_key: str, n: int, result: Findings) -> list[str] | None:
    try:
        strings = read_strings(storage, array_key)
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


def _offsets_problem(key: str, offsets: np.ndarray, total: int, result: Findings) -> str | None:
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


def _check_bags(storage: Storage, key: str, meta: SplitMetadata, offsets: np.ndarray,
                stats: np.ndarray, scales: np.ndarray | None, result: Findings) -> None:
    """Seals, then each bag's rows against its statistics row, one features chunk at a time
    (int8: the sums of a bag's codes times its ``scales`` row)."""
    rows, dim, total = meta.chunk_rows, int(meta.sample_shape[0]), int(meta.num_samples)
    expected_rows: list[ChunkStats] = []
    for i, sealed in enumerate(stats):
        row, generation, at = unseal(sealed, meta)
        if meta.generation is not None and (generation != meta.generation_number or at != i):
            result.problems.append(f"{key}/{bags.BAG_STATS}: row {i} is sealed for another run or bag "
                                   f"(generation {int(generation or 0):x}, bag {at}): a file moved or copied")
            return
        expected_rows.append(ChunkStats.from_row(row))
    stored = dtypes.storage_dtype(meta.logical_dtype)
    bag, sums = 0, np.zeros(dim, np.float64)
    n = len(expected_rows)
    for index in range(layout.num_chunks(total, rows)):
        raw = storage.read(layout.chunk_key(f"{key}/{layout.FEATURES}", index, 2))
        lo, hi = index * rows, min(total, (index + 1) * rows)
        values = dtypes.stored_as_float32(np.frombuffer(raw[: -layout.CRC_BYTES], stored), meta.logical_dtype)
        values = values.reshape(rows, dim)
        while bag < n:
            start, stop = int(offsets[bag]), int(offsets[bag + 1])
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                sums += values[a - lo : b - lo].sum(axis=0, dtype=np.float64)
            if stop > hi:
                break
            _bag_matches(key, bag, stop - start, sums if scales is None else sums * scales[bag], expected_rows[bag], result)
            bag, sums = bag + 1, np.zeros(dim, np.float64)
    while bag < n:  # empty bags at the end
        _bag_matches(key, bag, int(offsets[bag + 1] - offsets[bag]), sums, expected_rows[bag], result)
        bag += 1


def _bag_matches(key: str, bag: int, count: int, sums: np.ndarray, stats: ChunkStats, result: Findings) -> None:
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

