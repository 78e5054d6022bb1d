"""Bag splits: ragged per-slide bags of patch features, as plain Zarr v3 arrays (no I/O here).

A bag split (docs/FORMAT.md, "Slide bags") stores the rows of all its bags concatenated in one
``features`` array ``[total_rows, dim]`` with ``coords`` ``[total_rows, 2]`` beside it, chunked
along rows only like a dense split's features, and an Arrow-style index: ``offsets`` ``[n + 1]``
(bag ``i`` is rows ``offsets[i]:offsets[i + 1]``), ``bag_ids`` ``[n]`` strings, optional
``labels`` ``[n]``, ``bag_attrs`` ``[n]`` (one JSON document per bag), ``bag_stats`` (one
sealed statistics row per bag) and ``chunk_seals`` (each final chunk's crc32c, sealed with the
generation and the chunk's place, so a chunk swapped, moved or copied from another run is
found). Bags are ordered by id (code point order) whoever wrote them, so the same bags give the
same bytes whatever the number of writers and the arrival order.

While a split is written, each writer session appends its bags to its own **segment**
(``segments/<name>/``: chunks of the same geometry, and one record per chunk naming the bags
that end in it). A bag is complete once its record and every chunk its rows lie in are on
storage; ``commit`` lays the complete bags out in id order (chunks already in place are linked,
not copied), writes the index and deletes the segments. This module holds the names, the
split's ``bags`` settings, the record encoding and the layout plan; featurestore.core.bag_writer
and core.bag_commit do the I/O.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.errors import (BagNotFound, IndexOutOfRange, InvalidIndices, InvalidMetadata, InvalidOption,
                                 ShapeMismatch)
from featurestore.format import wire
# The chunk_seals table is every kind's now (format.seals); its names stay importable from here.
from featurestore.format.seals import CHUNK_SEALS, SEAL_COLUMNS, SEALED_ARRAYS, seal_problems, seal_table  # noqa: F401

# Arrays of a bag split (beside the dense split's FEATURES, LABELS: same names, same meaning).
COORDS = "coords"
OFFSETS = "offsets"
BAG_IDS = "bag_ids"
BAG_ATTRS = "bag_attrs"
BAG_STATS = "bag_stats"
SEGMENTS = "segments"
RECORDS = "records"

COORD_UNITS = ("px", "um")
COORD_DTYPES = ("int64", "int32", "float32", "float64")
LABEL_KINDS = "iufb"
MAX_ID_CHARS = 4096
# Coordinates of a bag added without them: "no position" (int) or NaN (float).
NO_COORD_INT = -1


def bag_spec(*, coords_unit: str | None, coords_dtype: str, patch_size_level0: Any,
             label_dtype: Any) -> dict[str, Any]:
    """The ``bags`` entry of a new bag split's metadata (counts are filled in by commit)."""
    if coords_unit is not None and coords_unit not in COORD_UNITS:
        raise InvalidOption(f"coords_unit {coords_unit!r} is not supported: use 'px' (level-0 pixels), "
                            "'um' (micrometres) or None (no coordinates)")
    if str(coords_dtype) not in COORD_DTYPES:
        raise InvalidOption(f"coords_dtype {coords_dtype!r} is not supported: use one of {', '.join(COORD_DTYPES)}")
    if patch_size_level0 is not None and (isinstance(patch_size_level0, bool) or not isinstance(
            patch_size_level0, (int, float, np.integer, np.floating)) or not patch_size_level0 > 0):
        raise InvalidOption(f"patch_size_level0 must be a positive number or None, got {patch_size_level0!r}")
    labels = None
    if label_dtype is not None:
        labels = {"dtype": check_label_dtype(label_dtype)}
    size = patch_size_level0
    if size is not None:
        size = int(size) if float(size).is_integer() else float(size)
    return {"count": 0, "coords": {"unit": coords_unit, "dtype": str(coords_dtype)},
            "patch_size_level0": size, "labels": labels}


def check_label_dtype(label_dtype: Any) -> str:
    try:
        kind = np.dtype(label_dtype)
    except TypeError:
        kind = None
    if kind is None or kind.kind not in LABEL_KINDS:
        raise InvalidOption(f"label_dtype {label_dtype!r} is not numeric: use e.g. 'int64' or 'float32'")
    return kind.name


def check_spec(spec: Any, sample_ndim: int) -> None:
    """Validate a stored ``bags`` entry (``InvalidMetadata`` naming what is wrong)."""
    try:
        if sample_ndim != 1:
            raise ValueError(f"sample_shape has {sample_ndim} axes, a bag split's rows have one (dim)")
        count = spec["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count {count!r}")
        coords = spec["coords"]
        if coords["unit"] is not None and coords["unit"] not in COORD_UNITS:
            raise ValueError(f"coords unit {coords['unit']!r}")
        if coords["dtype"] not in COORD_DTYPES:
            raise ValueError(f"coords dtype {coords['dtype']!r}")
        if spec.get("labels") is not None:
            check_label_dtype(spec["labels"]["dtype"])
    except (KeyError, TypeError, ValueError, InvalidOption) as error:
        raise InvalidMetadata(f"the bags entry of a bag split's metadata is damaged ({error}): "
                              "rewrite the split (--overwrite)") from None


def check_bag_id(bag_id: Any) -> str:
    """A bag id is data (a slide name), never a path: any non-empty string that UTF-8 encodes."""
    if not isinstance(bag_id, str) or not bag_id:
        raise ShapeMismatch(f"bag id {bag_id!r} is not a non-empty string: pass the slide's name as str")
    if len(bag_id) > MAX_ID_CHARS:
        raise ShapeMismatch(f"bag id {bag_id[:40]!r}... has {len(bag_id)} characters, at most {MAX_ID_CHARS} are allowed")
    try:
        bag_id.encode("utf-8")
    except UnicodeEncodeError:
        raise ShapeMismatch(f"bag id {bag_id!r} is not valid unicode (a lone surrogate): decode the name first") from None
    return bag_id


def attrs_json(attrs: Any) -> str:
    """A bag's attributes as the canonical JSON stored per bag (sorted keys, strict)."""
    if attrs is None:
        attrs = {}
    if not isinstance(attrs, dict):
        raise ShapeMismatch(f"bag attrs must be a dict of JSON values, got {type(attrs).__name__}")
    try:
        bad = unplain(attrs)
        text = None if bad else json.dumps(_plain(attrs), sort_keys=True, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as error:  # e.g. a dict that holds itself
        raise ShapeMismatch(f"bag attrs are not plain JSON ({type(error).__name__}: {error}): pass "
                            "str/int/float/bool/None/list/dict values") from None
    if bad is not None or text is None:
        where, value = bad or ("", attrs)
        raise ShapeMismatch(f"bag attrs are not plain JSON: attrs{where} is {describe(value)}: pass "
                            "str/int/float/bool/None/list/dict values (text as valid unicode)")
    return text


def unplain(value: Any, where: str = "") -> tuple[str, Any] | None:
    """``(where, value)`` of the first value in ``value`` that ``attrs_json`` cannot store (a
    complex number, an HDF5 reference or compound, text with a lone surrogate, ...), ``where``
    as a subscript path (``['root']['c']``); None when every value is plain."""
    if isinstance(value, dict):
        for key, item in value.items():  # keys are stored as str(key)
            found = unplain(str(key), f"{where} (a key)") or unplain(item, f"{where}[{str(key)!r}]")
            if found is not None:
                return found
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = unplain(item, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(value, np.ndarray):
        return unplain(value.tolist(), where) if value.dtype.kind in "biufSUO" else (where, value)
    if isinstance(value, np.generic) and value.dtype.kind in "biufSU":
        return unplain(value.item(), where)
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # a lone surrogate passes json.dumps, then fails the commit's UTF-8
        except UnicodeEncodeError:
            return where, value
        return None
    if value is None or isinstance(value, (bool, int, float, bytes)):
        return None
    return where, value


def describe(value: Any) -> str:
    """A value that is not plain JSON, in a few words (its type and a short repr)."""
    text = repr(value)
    return f"a {type(value).__name__} ({text[:60] + '...' if len(text) > 60 else text})"


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (h5 attributes) as their JSON twins."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# ---------------------------------------------------------------------- segment records
@dataclass(frozen=True)
class BagRecord:
    """One complete bag in a segment: where its rows are, and what goes in the index."""

    bag_id: str
    start: int  # first row within the segment
    length: int
    label: int | float | None
    attrs: str  # canonical JSON (attrs_json)
    stats: np.ndarray  # the bag's statistics row (format.stats.row_length(dim) float64)
    scales: np.ndarray | None = None  # int8 splits: the bag's float32 scale per channel

    def chunks(self, chunk_rows: int) -> range:
        """The segment chunks this bag's rows lie in."""
        if self.length == 0:
            return range(0)
        return range(self.start // chunk_rows, (self.start + self.length - 1) // chunk_rows + 1)


def encode_records(records: list[BagRecord], filled: int) -> np.ndarray:
    """A segment chunk's record (bags ending in it; ``filled``: rows the chunk holds) as bytes."""
    doc = {"filled": int(filled), "bags": [
        {"id": r.bag_id, "start": int(r.start), "length": int(r.length), "label": r.label,
         "attrs": r.attrs, "stats": base64.b64encode(np.ascontiguousarray(r.stats, "<f8").tobytes()).decode(),
         **({} if r.scales is None else
            {"scales": base64.b64encode(np.ascontiguousarray(r.scales, "<f4").tobytes()).decode()})}
        for r in records]}
    return np.frombuffer(json.dumps(doc, ensure_ascii=False, allow_nan=False).encode(), np.uint8)


def decode_records(payload: bytes) -> tuple[int, list[BagRecord]]:
    """``(filled, records)`` of a record payload (crc already checked); ValueError if damaged."""
    try:
        doc = json.loads(bytes(payload))
        out = [BagRecord(str(b["id"]), int(b["start"]), int(b["length"]), b["label"], str(b["attrs"]),
                         np.frombuffer(base64.b64decode(b["stats"]), "<f8").astype(np.float64),
                         np.frombuffer(base64.b64decode(b["scales"]), "<f4").astype(np.float32)
                         if "scales" in b else None)
               for b in doc["bags"]]
        return int(doc["filled"]), out
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"damaged bag record ({error})") from None


# ---------------------------------------------------------------------- the layout at commit
@dataclass(frozen=True)
class Piece:
    """Rows ``[seg_start, seg_start + length)`` of segment ``segment`` land at final row ``start``."""

    start: int
    segment: str
    seg_start: int
    length: int


def id_order(ids: list[str]) -> list[int]:
    """Positions of ``ids`` in the order bags are stored: by id, code point order."""
    return sorted(range(len(ids)), key=ids.__getitem__)


def offsets_of(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(np.asarray(lengths, np.int64), out=out[1:])
    return out


def chunk_pieces(pieces: list[Piece], total_rows: int, chunk_rows: int) -> list[list[Piece]]:
    """For each final chunk, the pieces (clipped to it) that fill it, in row order."""
    out: list[list[Piece]] = [[] for _ in range(math.ceil(total_rows / chunk_rows) if total_rows else 0)]
    for piece in pieces:
        row, end = piece.start, piece.start + piece.length
        while row < end:
            chunk = row // chunk_rows
            stop = min(end, (chunk + 1) * chunk_rows)
            out[chunk].append(Piece(row, piece.segment, piece.seg_start + (row - piece.start), stop - row))
            row = stop
    return out


def in_place(parts: list[Piece], chunk: int, chunk_rows: int, total_rows: int,
             filled: dict[tuple[str, int], int]) -> tuple[str, int] | None:
    """The segment chunk ``(segment, index)`` that already holds final chunk ``chunk`` byte for
    byte (same rows at the same place, same padding), or None if it must be assembled."""
    lo = chunk * chunk_rows
    rows = min(chunk_rows, total_rows - lo)
    if not parts or any(p.segment != parts[0].segment for p in parts):
        return None
    first = parts[0]
    if first.seg_start % chunk_rows != 0 or sum(p.length for p in parts) != rows:
        return None
    if any(b.seg_start != a.seg_start + a.length for a, b in zip(parts, parts[1:])):
        return None
    index = first.seg_start // chunk_rows
    if filled.get((first.segment, index), chunk_rows) != rows:
        return None
    return first.segment, index


class BagLookup:
    """A bag by position or by id, with the same errors in every bag reader (the store's
    ``BagArray``, the server's ``RemoteBagArray``): a reader sets ``ids`` and names itself in
    :meth:`_where`."""

    ids: list[str]
    patch_size_level0: Any = None
    _positions: dict[str, int] | None = None

    def _where(self) -> str:
        raise NotImplementedError

    def attrs(self, i_or_id: int | str) -> dict[str, Any]:
        raise NotImplementedError

    def patch_size_of(self, i_or_id: int | str) -> int | None:
        """The bag's patch side in level-0 units: its own where it records one (slide extraction
        records one per slide, since slides differ in magnification; an import keeps each file's
        coords attributes, and a TRIDENT job mixing 40x and 20x scans differs file to file), else
        the split's ``patch_size_level0``; None when neither is recorded."""
        attrs = self.attrs(i_or_id)
        size = attrs.get("patch_size_level0")
        if not _positive(size):
            size = recorded_patch_size(attrs.get("coords"), attrs.get("root"))
        size = size if _positive(size) else self.patch_size_level0
        return int(size) if _positive(size) else None

    def patch_sizes(self) -> list[int | None]:
        """:meth:`patch_size_of` of every bag, in order."""
        return [self.patch_size_of(i) for i in range(len(self.ids))]

    def index(self, bag_id: str) -> int:
        """The position of ``bag_id`` (:class:`BagNotFound` if the split has no such bag)."""
        if self._positions is None:
            self._positions = {bag: i for i, bag in enumerate(self.ids)}
        try:
            return self._positions[bag_id]
        except (KeyError, TypeError):
            sample = ", ".join(repr(b) for b in self.ids[:3]) + (", ..." if len(self.ids) > 3 else "")
            raise BagNotFound(f"no bag {bag_id!r} in {self._where()} ({len(self.ids)} bags: {sample or 'none'}): "
                              "check the id (.ids lists them)") from None

    def position(self, i_or_id: int | str) -> int:
        """The position of a bag named by its position (int) or its id (str)."""
        if isinstance(i_or_id, str):
            return self.index(i_or_id)
        if isinstance(i_or_id, (bool, np.bool_, float)) or not isinstance(i_or_id, (int, np.integer)):
            raise InvalidIndices(f"a bag is named by its position (int) or id (str), got "
                                 f"{type(i_or_id).__name__} {i_or_id!r}")
        if not 0 <= int(i_or_id) < len(self.ids):
            raise IndexOutOfRange(f"bag position {int(i_or_id)} is outside [0, {len(self.ids)}) of {self._where()}: "
                                  "use 0 <= i < the number of bags, or a bag id")
        return int(i_or_id)


def recorded_patch_size(coords: Any, root: Any) -> Any:
    """The patch side at level 0 a per-slide file records, in its coordinates' unit: the coords'
    ``patch_size_level0`` (TRIDENT), the root's ``tile_size_um`` (STAMP), or CLAM's ``patch_size``
    with ``patch_level`` 0; None when it records none."""
    coords = coords if isinstance(coords, dict) else {}
    root = root if isinstance(root, dict) else {}
    if "patch_size_level0" in coords:
        size = coords["patch_size_level0"]
    elif "tile_size_um" in root:
        size = root["tile_size_um"]
    elif "patch_size" in coords and coords.get("patch_level") == 0:  # TRIDENT's is at its target magnification
        size = coords["patch_size"]
    else:
        return None
    return size if _positive(size) else None


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def select_rows(rows: Any, length: int, bag: str) -> slice | np.ndarray:
    """The one rule for a bag's ``rows`` (every bag reader and the server's bag routes): which
    patches of a bag of ``length`` patches, as a ``slice(start, stop)`` of step 1 or an int64
    array of positions within the bag.

    - ``None``: the whole bag;
    - a ``slice`` or ``range``: what it selects of the bag's patches as a Python sequence
      (bounds clipped, negative bounds from the end, any step);
    - anything else is patch positions, normalised as every reader's indices are
      (:func:`wire.as_index_array`: a 1-D integer list, tuple, numpy or torch array; a scalar is
      one row): any order, duplicates allowed, each in ``[0, length)`` (a negative position is
      ``IndexOutOfRange``, never counted from the end).
    """
    if rows is None:
        return slice(0, length)
    if isinstance(rows, range):
        rows = slice(rows.start, rows.stop, rows.step)
    if isinstance(rows, slice):
        start, stop, step = rows.indices(length)
        if step != 1:
            return np.arange(start, stop, step, dtype=np.int64)
        return slice(start, max(start, stop))
    index = wire.as_index_array(rows)
    wire.check_bounds(index, length, f"bag {bag!r}")
    return index


def selected_count(selection: slice | np.ndarray) -> int:
    """How many patches a :func:`select_rows` selection reads."""
    return selection.stop - selection.start if isinstance(selection, slice) else len(selection)


def check_out(out: np.ndarray, count: int, dim: int, numpy_dtype: Any) -> None:
    """``out`` of a bag read: a C-contiguous ``[count, dim]`` array of the storage dtype."""
    if out.shape != (count, dim) or out.dtype != numpy_dtype or not out.flags.c_contiguous:
        raise ShapeMismatch(f"out has shape {out.shape} and dtype {out.dtype}; this bag read needs a "
                            f"C-contiguous ({count}, {dim}) array of {np.dtype(numpy_dtype)}")
