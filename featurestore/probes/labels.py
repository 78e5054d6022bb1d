"""A task's labels taken from a table at probe time (``featurestore probe --labels CSV``).

A cohort is imported once; each task (tumour vs normal, a subtype, a grade) is a column of a
table keyed by slide id, read when the probe runs, so a new task needs no re-import. The rules:

- the file is UTF-8 text (a byte-order mark is accepted), comma-separated (tab for ``.tsv``), its
  first row naming the columns (surrounding spaces ignored);
- ``id_column`` (default ``slide_id``) names the slide; an id may carry the slide file's extension
  (``TCGA-xx.svs`` labels bag ``TCGA-xx``), as ``featurestore import --labels`` accepts; an id
  listed twice is one row when its label cells agree (a slide table keyed by ``case_id`` labels
  patient embeddings: a patient's row repeats per slide) and refused when they differ (an empty
  cell agrees with any);
- ``label_column``: if every non-empty cell is ASCII digits only (``0``, ``1``, ``12``), the
  labels are integer class ids as written when they are ``0 .. K-1``; other integers (a grade
  coded ``1, 2, 3``, codes ``0, 1, 5``) are numbered in increasing order and named by their
  values, so the head has no class that no slide can have (``1, 2`` is a binary task, not three
  classes of which one is empty); otherwise every value is a class name, and classes are
  numbered in sorted name order (``"1.0"``, ``"-1"`` or ``"١"`` are names, not numbers); but a
  column of ASCII numbers, not all whole, with more distinct values than half its labelled rows
  (an age, a score) is refused as continuous: measurements, not classes;
- a label cell ``nan``, ``NaN``, ``NA``, ``N/A``, ``null`` or ``None`` (any case: how pandas and R
  write a missing value) is an empty cell, not a class name;
- a row with an empty label cell, a row with an empty id cell (it labels nothing) and a slide the
  table does not list are left out of the probe (one summary line says how many slides); a table
  that labels none of a split's slides is refused.

Errors are one line (:class:`featurestore.errors.InvalidLabels`) naming the file and the fix.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from featurestore.errors import InvalidLabels
from featurestore.extract.label_csv import separator_hint, slide_stem, undecodable_at

__all__ = ["LabelTable", "Matched", "read_label_table", "table_rows"]

_DIGITS = re.compile(r"[0-9]+")  # str.isdigit() would take any Unicode digit
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")  # ASCII, as float() writes one
_SHOWN = 3  # ids named in a message or summary
# Label cells that mean "no value": pandas writes a missing value as nan (NaN), R as NA; a class
# named so would be a class of unlabelled slides. Compared lower-cased.
_MISSING = frozenset({"nan", "na", "n/a", "null", "none"})


@dataclass(frozen=True)
class Matched:
    """A table's labels for one split's ids: ``labels[i]`` for position i (-1: not labelled)."""

    labels: np.ndarray
    positions: np.ndarray  # the labelled positions, ascending
    summary: str
    names: list[str] | None = None  # class names by id (the table's text labels), for messages


@dataclass(frozen=True)
class LabelTable:
    path: str
    label_column: str
    id_column: str
    values: dict[str, int]  # slide id as written -> class id
    classes: list[str] | None  # class names by id (text labels); None: integer labels
    empty: int  # rows whose label cell is empty
    # id without its extension -> the id; None: two ids share that stem (a bag of that name is refused)
    stems: dict[str, str | None] = field(default_factory=dict, repr=False)

    @property
    def num_classes(self) -> int:
        return len(self.classes) if self.classes is not None else max(self.values.values(), default=-1) + 1

    def class_name(self, value: int) -> str:
        return self.classes[value] if self.classes is not None else str(value)

    def match(self, ids: Sequence[str], where: str, noun: str = "slides") -> Matched:
        """The labels of ``ids`` (the slides of split ``where``; ``noun``: what its rows are, e.g. the
        samples of an embedding split, one per slide or per patient), refused when none is labelled."""
        keys = [i if i in self.values else self.stems.get(i) for i in ids]
        for bag, key in zip(ids, keys):
            if key is None and bag in self.stems:
                twins = sorted(s for s in self.values if slide_stem(s) == bag)
                raise InvalidLabels(f"{self.path}: slide {bag!r} of {where} matches rows {twins[0]!r} and {twins[1]!r} "
                                    f"of column {self.id_column!r}: name the slide exactly")
        labels = np.array([-1 if k is None else self.values[k] for k in keys], np.int64)
        positions = np.flatnonzero(labels >= 0)
        if not len(positions):
            raise InvalidLabels(
                f"{self.path}: none of the {len(ids)} {noun} of {where} has a label in column "
                f"{self.label_column!r} (ids in column {self.id_column!r} look like {_some(self.values)}, the "
                f"split's like {_some(ids)}); pass the column holding the split's slide ids with --id-column")
        absent = [i for i, k in zip(ids, keys) if k is None]
        counts = np.bincount(labels[positions], minlength=self.num_classes)
        shown = ", ".join(f"{self.class_name(c)}={int(n)}" for c, n in enumerate(counts) if n)
        summary = (f"labels: column {self.label_column!r} of {self.path}: {len(positions)} of {len(ids)} {noun} of "
                   f"{where} labelled ({shown})")
        if absent:
            summary += f"; {len(absent)} without a label left out ({_some(absent)})"
        return Matched(labels, positions, summary, self.classes)


def column_indices(path: str, header: list[str], columns: Sequence[tuple[str, str]]) -> list[int]:
    """Where each (column, the flag that named it) stands in a table's ``header``; a missing one is
    refused naming the flag and the columns there are."""
    for column, flag in columns:
        if column not in header:
            raise InvalidLabels(f"{path} has no column {column!r} ({flag}); its columns are: "
                                f"{', '.join(repr(h) for h in header if h) or 'none'}{separator_hint(path, header)}")
    return [header.index(column) for column, _ in columns]


def task_record(table: LabelTable | None) -> dict[str, str] | None:
    """Which labels a probe trained on, for what it saves (an attention map's lineage): the table's
    file name and columns, or None for the split's stored labels."""
    if table is None:
        return None
    return {"table": os.path.basename(str(table.path)), "column": table.label_column, "id_column": table.id_column}


def read_label_table(path: str | os.PathLike[str], label_column: str, id_column: str = "slide_id") -> LabelTable:
    """Read ``label_column`` keyed by ``id_column`` from the table at ``path`` (module doc: the rules)."""
    path = os.fspath(path)
    table = table_rows(path, "labels")
    if not any(any(cell.strip() for cell in row) for row in table[1:]):
        raise InvalidLabels(f"{path} is empty: a table needs a header row naming its columns, then one row per "
                            "slide" if not table else f"{path} has a header but no rows: add one row per slide")
    reader = iter(table)
    header = [name.strip() for name in next(reader, [])]
    id_at, label_at = column_indices(path, header, ((id_column, "--id-column"), (label_column, "--label-column")))
    raw: dict[str, str] = {}
    rows: dict[str, int] = {}  # id -> the line its label (or, while it has none, its first row) is on
    for line, row in enumerate(reader, start=2):
        if not any(cell.strip() for cell in row):
            continue  # a blank line
        cells = [cell.strip() for cell in row] + [""] * len(header)
        slide, value = cells[id_at], cells[label_at]
        if value.lower() in _MISSING:
            value = ""
        if not slide:  # labels nothing: a clinical table covers other cohorts too
            continue
        if raw.get(slide) and value and raw[slide] != value:
            raise InvalidLabels(f"{path}: {slide!r} is listed twice in column {id_column!r} with two labels in "
                                f"column {label_column!r} ({raw[slide]!r} on line {rows[slide]}, {value!r} on line "
                                f"{line}); one id needs one label: fix the table or pick another --id-column")
        if not raw.get(slide):  # its first row, or its first label
            rows[slide], raw[slide] = line, value
    labelled = {slide: value for slide, value in raw.items() if value}
    if not raw:
        raise InvalidLabels(f"{path}: no row has an id in column {id_column!r}; give the column of the split's ids "
                            "with --id-column")
    if not labelled:
        raise InvalidLabels(f"{path}: column {label_column!r} has no label in any row; pick the task's column "
                            "with --label-column")
    classes: list[str] | None = None
    if all(_DIGITS.fullmatch(v) for v in labelled.values()):
        values = {slide: int(v) for slide, v in labelled.items()}
        present = sorted(set(values.values()))
        if present != list(range(len(present))):  # 1-based grades, sparse codes: no empty class
            classes, number = [str(v) for v in present], {v: k for k, v in enumerate(present)}
            values = {slide: number[v] for slide, v in values.items()}
    else:
        _refuse_continuous(path, label_column, labelled)
        classes = sorted(set(labelled.values()))
        number = {name: k for k, name in enumerate(classes)}
        values = {slide: number[v] for slide, v in labelled.items()}
    stems: dict[str, str | None] = {}
    for slide in values:
        stem = slide_stem(slide)
        if stem is not None and stem not in values:
            stems[stem] = None if stem in stems else slide
    return LabelTable(path=path, label_column=label_column, id_column=id_column, values=values, classes=classes,
                      empty=len(raw) - len(labelled), stems=stems)


def _refuse_continuous(path: str, column: str, labelled: dict[str, str]) -> None:
    """Refuse a column of measurements (an age, a score): numbers, some not whole, nearly one
    distinct value per row. As class names each value would be a class of one or two slides."""
    if not all(_NUMBER.fullmatch(v) for v in labelled.values()):
        return
    values = sorted(set(labelled.values()), key=float)
    distinct = len({float(v) for v in values})
    if all(float(v).is_integer() for v in values) or distinct < 3 or 2 * distinct <= len(labelled):
        return
    shown = ", ".join(values[:3])
    raise InvalidLabels(f"{path}: column {column!r} looks continuous ({distinct} distinct numbers over "
                        f"{len(labelled)} labelled rows: {shown}, ...), not like classes: the probe needs class "
                        "labels; give a categorical column with --label-column, or bin this one into classes (e.g. "
                        "below / above a cut-off) in a column of its own")


def table_rows(path: str, what: str, limit: int | None = None) -> list[list[str]]:
    """The rows of a probe's table (``what``: labels, groups), the first ``limit`` only when given
    (the header: ``limit=1``): UTF-8 text (a byte-order mark accepted), comma-separated, tab for
    ``.tsv``, a quoted cell may hold line breaks; unreadable, not UTF-8 or not CSV is one line
    naming the file and the line."""
    rows: list[list[str]] = []
    reader: Any = None
    try:
        with open(path, newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle, delimiter="\t" if path.lower().endswith(".tsv") else ",")
            for row in reader:
                rows.append(row)
                if len(rows) == limit:
                    break
    except UnicodeDecodeError as error:
        raise InvalidLabels(f"{path} is not UTF-8 text ({undecodable_at(path, error)}): save the table as UTF-8 "
                            "CSV") from None
    except csv.Error as error:
        raise InvalidLabels(f"{path} line {reader.line_num}: not a table featurestore can read ({error}); save "
                            "it as comma-separated text (tab-separated as .tsv)") from None
    except OSError as error:
        raise InvalidLabels(f"cannot read the {what} table {path!r} ({error.strerror or error})") from None
    return rows


def _some(ids: Any) -> str:
    listed = list(ids)
    shown = ", ".join(repr(i) for i in listed[:_SHOWN])
    return shown + (", ..." if len(listed) > _SHOWN else "")
