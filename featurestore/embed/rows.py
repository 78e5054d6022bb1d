"""The rows of an embedding split: one per bag, or one per group of bags (``--group-by``).

A row is a list of bags (positions in the bag split, in id order) and its label. With
``--group-by COLUMN`` bags are grouped by that bag attribute (``bags.attrs(i)[COLUMN]``, e.g. the
``case_id`` column an import keeps), or by a table's column (``--groups CSV``: slides extracted
from whole-slide images carry no case_id): one row per value, rows sorted by the value as text.
Every bag must have a value, and every bag of a group the same label (unless the labels are left
out: ``--no-labels``, the task then given at probe time).

A row's patches are its bags' rows, concatenated in bag order; ``--max-patches K`` keeps a seeded
uniform subset of K of them (sorted), the same whichever rank or run computes the row.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.errors import InvalidLabels, InvalidOption


@dataclass(frozen=True)
class Row:
    id: str
    bags: tuple[int, ...]
    label: Any = None


def plan(bags: Any, group_by: str | None, key: str, *, with_labels: bool = True,
         table_values: list[str] | None = None) -> list[Row]:
    """The rows of ``bags`` (a BagArray), one per bag or one per ``group_by`` value (the bag
    attribute, or ``table_values[i]``, bag i's from a ``--groups CSV``); without ``with_labels``
    every row's label is None."""
    labels = bags.labels if with_labels else None
    if group_by is None:
        return [Row(bag_id, (i,), None if labels is None else labels[i].item()) for i, bag_id in enumerate(bags.ids)]
    groups: dict[str, list[int]] = {}
    for i, bag_id in enumerate(bags.ids):
        if table_values is not None:
            groups.setdefault(table_values[i], []).append(i)
            continue
        attrs = bags.attrs(i)
        if group_by not in attrs:
            raise InvalidOption(f"bag {bag_id!r} of {key} has no attribute {group_by!r} to group by (its attributes: "
                                f"{', '.join(sorted(attrs)) or 'none'}): give every bag that column when importing, "
                                "or give the table holding it (--groups CSV)")
        value = attrs[group_by]
        if value is None or isinstance(value, (dict, list)):
            raise InvalidOption(f"bag {bag_id!r} of {key} has {group_by}={value!r}: group values must be text or "
                                "numbers")
        groups.setdefault(str(value), []).append(i)
    rows = []
    for name in sorted(groups):
        members = tuple(groups[name])
        label = None
        if labels is not None:
            values = {labels[i].item() for i in members}
            if len(values) > 1:
                shown = ", ".join(f"{bags.ids[i]}={labels[i].item()}" for i in members)
                raise InvalidLabels(f"group {group_by}={name!r} of {key} has bags with different labels ({shown}): "
                                    "one row per group needs one label; fix the labels, group by another column, "
                                    "or leave the labels out (--no-labels) and give the task at probe time "
                                    f"(probe --labels CSV --id-column {group_by})")
            label = values.pop()
        rows.append(Row(name, members, label))
    return rows


def groups_record(rows: list[Row], table: str, id_column: str) -> dict[str, Any]:
    """What the lineage keeps of a ``--groups`` table: its name and id column, and a digest of the
    grouping it gave (another grouping is another computation: another cache key)."""
    grouping = json.dumps([[row.id, list(row.bags)] for row in rows], separators=(",", ":"))
    return {"table": os.path.basename(table), "id_column": id_column,
            "sha256": hashlib.sha256(grouping.encode()).hexdigest()}


def patch_count(row: Row, lengths: np.ndarray) -> int:
    return int(sum(int(lengths[i]) for i in row.bags))


def subset(total: int, max_patches: int | None, seed: int, row_id: str) -> np.ndarray | None:
    """Sorted positions (over the row's concatenated patches) of a seeded uniform subset of
    ``max_patches``, or None to keep all. Seeded by the row's id, so any rank draws the same."""
    if max_patches is None or total <= max_patches:
        return None
    rng = np.random.default_rng([seed, zlib.crc32(row_id.encode("utf-8", "surrogatepass"))])
    return np.sort(rng.choice(total, size=max_patches, replace=False)).astype(np.int64)


def split_subset(positions: np.ndarray | None, lengths: list[int]) -> list[np.ndarray | None]:
    """Per bag of a row: its rows (positions within the bag) that ``positions`` keeps, or None (all)."""
    if positions is None:
        return [None] * len(lengths)
    edges = np.concatenate([[0], np.cumsum(lengths)])
    return [positions[(positions >= a) & (positions < b)] - a for a, b in zip(edges[:-1], edges[1:], strict=True)]


def shift_coords(coords: list[np.ndarray], patch_size: int) -> np.ndarray:
    """Concatenate a group's slide coordinates so that no two slides overlap: each later slide's x
    is shifted by the running max x of the slides before it (shifted) plus ``patch_size``. The
    first slide keeps its coordinates; empty slides shift nothing."""
    shifted, running_max = [], None
    for c in coords:
        c = np.asarray(c, dtype=np.int64)
        if running_max is not None and len(c):
            c = c.copy()
            c[:, 0] += running_max + int(patch_size)
        if len(c):
            top = int(c[:, 0].max())
            running_max = top if running_max is None else max(running_max, top)
        shifted.append(c)
    return np.concatenate(shifted) if shifted else np.zeros((0, 2), np.int64)
