"""The labels CSV of slide bags (``featurestore import DIR --labels CSV``, ``wsi:`` extraction).

One row per slide, comma-separated (tab-separated when the file is named ``.tsv``): an id column
(default ``slide_id``; an id may carry its file extension, ``TCGA-xx.svs``), a label column
(default ``label``) and any others (``case_id``, ``site``...), which an import keeps as bag
attributes so later steps can group slides by patient.

Parsing is strict, so a table means one thing whatever the locale or the spreadsheet that wrote
it: the file is UTF-8 (a BOM is fine; anything else is refused naming the line, not guessed);
a label is an integer only in ASCII digits (``1_000`` and Arabic-Indic digits are text), within
int64; ``nan``/``inf`` labels are refused (pandas writes a missing value as ``nan``); text labels
become class indices in sorted name order. An attribute column holds numbers only when every
cell is a JSON number (``05`` keeps its zero: a code, not a count); an empty cell is null.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from featurestore.errors import InvalidLabels

__all__ = ["LabelTable", "read_label_csv", "read_label_table", "separator_hint", "slide_stem", "undecodable_at"]

_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?\Z")
_JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
_NON_FINITE = ("nan", "inf", "infinity")
_INT64 = (-(2**63), 2**63 - 1)
# A file extension an id may carry (.svs, .tiff, .h5): a letter first, so "S1.1" names a slide
# "S1.1", not slide "S1" with an extension ".1".
_EXTENSION = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}\Z")


@dataclass
class LabelTable:
    labels: dict[str, int | float]  # by bag id
    names: list[str] | None  # class names of text labels (index = class), else None
    digest: str  # of the table and the columns chosen: part of an import's cache key
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by bag id: the other columns
    unused: list[str] = field(default_factory=list)  # ids of rows that name no slide
    columns: list[str] = field(default_factory=list)  # the other columns, in the table's order


def read_label_csv(path: str, bag_ids: list[str]) -> tuple[dict[str, Any], list[str] | None, str]:
    """``(labels by bag id, class names or None, digest)`` from the ``slide_id`` and ``label``
    columns; every bag needs a label."""
    table = read_label_table(path, bag_ids)
    return table.labels, table.names, table.digest


def read_label_table(path: str, bag_ids: list[str], label_column: str = "label",
                     id_column: str = "slide_id") -> LabelTable:
    """The labels (and other columns) of ``bag_ids`` from the CSV at ``path``; InvalidLabels,
    one line naming the file and the fix, for anything it cannot read without guessing."""
    if label_column == id_column:
        raise InvalidLabels(f"--label-column and --id-column are both {label_column!r}: the label is another "
                            "column than the slide id")
    raw = _text(path)
    header, rows = _rows(path, raw)
    for wanted, option in ((id_column, "--id-column"), (label_column, "--label-column")):
        if wanted not in header:
            raise InvalidLabels(f"labels CSV {path!r} has no column {wanted!r} (it has: "
                                f"{', '.join(c for c in header if c) or 'none'}): name the column with {option}"
                                f"{separator_hint(path, header)}")
    others = [c for c in header if c and c not in (id_column, label_column)]
    numeric = {c: all(_is_number(r[c]) for r in rows if r[c]) for c in others}
    table: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}  # slide id as written -> its rows
    stems: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}  # id without its extension -> rows
    for row in rows:
        slide = row[id_column]
        entry = (slide, row[label_column], {c: _attr(row[c], numeric[c]) for c in others})
        earlier = table.get(slide, [entry])[0]
        if earlier[1] != entry[1]:  # a slide listed twice with two labels: which is right?
            raise InvalidLabels(f"labels CSV {path!r} gives slide {slide!r} two labels ({earlier[1]!r} and "
                                f"{entry[1]!r}): keep one row per slide")
        if earlier[2] != entry[2]:
            raise InvalidLabels(f"labels CSV {path!r} has two rows for slide {slide!r} that differ "
                                f"({_difference(earlier, entry, label_column)}): keep one row per slide")
        table.setdefault(slide, [entry])
        stem = slide_stem(slide)
        if stem is not None and all(e[1:] != entry[1:] for e in stems.get(stem, [])):
            stems.setdefault(stem, []).append(entry)
    chosen: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for bag in bag_ids:  # the row naming the slide exactly, else the one row naming it with an extension
        if bag in table:
            chosen[bag] = table[bag][0]
        elif len(stems.get(bag, ())) > 1:
            first, second = sorted(stems[bag])[:2]
            raise InvalidLabels(f"labels CSV {path!r}: slide {bag!r} matches rows {first[0]!r} and {second[0]!r}, "
                                f"which differ ({_difference(first, second, label_column)}): name the slide "
                                "exactly (its file name without extension)")
        elif bag in stems:
            chosen[bag] = stems[bag][0]
    missing = [b for b in bag_ids if not chosen.get(b, ("", ""))[1]]
    if missing:
        raise InvalidLabels(f"labels CSV {path!r} has no row, or an empty {label_column!r}, for slide {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + f": add a {id_column},{label_column} row for each slide, or move the slide's file out "
                            "of the directory")
    labels, names = _labels(path, {b: chosen[b][1] for b in bag_ids})
    used = {chosen[b][0] for b in bag_ids}
    digest = hashlib.sha256(raw.encode()).hexdigest()
    if (label_column, id_column) != ("label", "slide_id"):  # the default keeps the digests of earlier imports
        digest = hashlib.sha256(json.dumps([digest, label_column, id_column]).encode()).hexdigest()
    return LabelTable(labels, names, digest, {b: chosen[b][2] for b in bag_ids},
                      [slide for slide in table if slide not in used], others)


def _text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as error:
        raise InvalidLabels(f"cannot read the labels CSV {path!r} ({error.strerror or error})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InvalidLabels(f"labels CSV {path!r} is not UTF-8 ({_where(error)}): save it as UTF-8 ('CSV UTF-8' "
                            "in a spreadsheet, or iconv -f latin1 -t utf-8 IN > OUT for a Latin-1 file)") from None


def slide_stem(sample_id: str) -> str | None:
    """``TCGA-xx`` for ``TCGA-xx.svs`` (an id written with its slide file's extension), else None."""
    found = _EXTENSION.search(sample_id)
    return sample_id[: found.start()] if found and found.start() else None


def undecodable_at(path: str, error: UnicodeDecodeError) -> str:
    """Where the file at ``path``, which a streaming reader failed to decode (``error``), stops being
    UTF-8: ``byte 0xe9 on line 3``. The reader's own line count is no use: its decoder fails on a
    read-ahead, before csv has parsed the lines before the byte, so the file is read again whole."""
    try:
        with open(path, "rb") as f:
            f.read().decode("utf-8-sig")
    except UnicodeDecodeError as whole:
        return _where(whole)
    except OSError:
        pass
    return f"byte {error.object[error.start]:#04x}"  # the file changed, or went, since the failed read


def _where(error: UnicodeDecodeError) -> str:
    # error.object, not the bytes decoded: utf-8-sig strips a byte-order mark first, and error.start
    # counts from after it.
    data = error.object
    line = data[: error.start].count(b"\n") + 1
    return f"byte {data[error.start]:#04x} on line {line}"


def separator_hint(path: str, header: list[str]) -> str:
    """What a header of one cell says about the file: another separator than the one its name
    implies (a TSV or a European spreadsheet's semicolons saved as .csv); else nothing."""
    if len(header) != 1:
        return ""
    tsv = path.lower().endswith(".tsv")
    if not tsv and "\t" in header[0]:
        return "; the header looks tab-separated: save it as comma-separated text or name it .tsv"
    if ";" in header[0]:
        fix = "save it as comma-separated text" + ("" if tsv else " (or tab-separated as .tsv)")
        return f"; the header looks semicolon-separated: {fix}"
    if tsv and "," in header[0]:
        return "; the header looks comma-separated: name the file .csv"
    return ""


def _rows(path: str, raw: str) -> tuple[list[str], list[dict[str, str]]]:
    """The header (names stripped: ``slide_id, label`` names the same columns) and the rows as
    ``{column: cell stripped}`` (a short row's missing cells are empty; blank lines skipped).
    Comma-separated, tab for ``.tsv``, as the probe's tables (featurestore.probes.labels)."""
    delimiter = "\t" if path.lower().endswith(".tsv") else ","
    try:
        lines = [line for line in csv.reader(io.StringIO(raw, newline=""), delimiter=delimiter)
                 if any(cell.strip() for cell in line)]
    except csv.Error as error:
        raise InvalidLabels(f"labels CSV {path!r} is not a CSV file ({error}): save it as comma-separated "
                            "text (tab-separated as .tsv)") from None
    if not lines:
        raise InvalidLabels(f"labels CSV {path!r} is empty: it needs a header row and one row per slide")
    header = [name.strip() for name in lines[0]]
    dup = next((c for i, c in enumerate(header) if c and c in header[:i]), None)
    if dup is not None:
        raise InvalidLabels(f"labels CSV {path!r} has two columns named {dup!r}: which one holds the values is "
                            "a guess; rename or remove one")
    rows = [{c: (line[i].strip() if i < len(line) else "") for i, c in enumerate(header) if c} for line in lines[1:]]
    return header, rows


def _is_number(cell: str) -> bool:
    """A JSON number JSON can store (``1e999`` is text: it would read back as null)."""
    return bool(_JSON_NUMBER.match(cell)) and math.isfinite(float(cell))


def _attr(cell: str, numeric: bool) -> Any:
    if not cell:
        return None
    if not numeric:
        return cell
    return int(cell) if _INT.match(cell) else float(cell)


def _difference(a: tuple[str, str, dict[str, Any]], b: tuple[str, str, dict[str, Any]], label_column: str) -> str:
    if a[1] != b[1]:
        return f"{label_column} {a[1]!r} and {b[1]!r}"
    column = next(c for c in a[2] if a[2][c] != b[2][c])
    return f"{column} {a[2][column]!r} and {b[2][column]!r}"


def _labels(path: str, given: dict[str, str]) -> tuple[dict[str, int | float], list[str] | None]:
    """Numbers kept (integers only in ASCII digits, within int64); text labels -> class indices."""
    for bag, value in given.items():
        if value.lower().lstrip("+-") in _NON_FINITE:
            raise InvalidLabels(f"labels CSV {path!r}: slide {bag!r} has label {value!r}, not a finite number (a "
                                "missing value?): give the slide its label, or move its file out of the directory")
    values = list(given.values())
    if all(_INT.match(v) for v in values):
        parsed = {bag: int(v) for bag, v in given.items()}
        beyond = next((b for b, v in parsed.items() if not _INT64[0] <= v <= _INT64[1]), None)
        if beyond is not None:
            raise InvalidLabels(f"labels CSV {path!r}: slide {beyond!r} has label {given[beyond]}, beyond int64 "
                                f"[{_INT64[0]}, {_INT64[1]}], the type integer labels are stored as: use class "
                                "indices (or text class names)")
        return dict(parsed), None
    if all(_FLOAT.match(v) for v in values):
        floats = {bag: float(v) for bag, v in given.items()}
        beyond = next((b for b, v in floats.items() if v in (float("inf"), float("-inf"))), None)
        if beyond is not None:
            raise InvalidLabels(f"labels CSV {path!r}: slide {beyond!r} has label {given[beyond]}, beyond float64: "
                                "give it a finite label")
        return dict(floats), None
    names = sorted(set(values))
    index = {name: i for i, name in enumerate(names)}
    return {bag: index[v] for bag, v in given.items()}, names
