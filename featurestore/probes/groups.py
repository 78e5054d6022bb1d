"""Which group (patient, site) each sample of a probe belongs to, for grouped folds
(``featurestore probe --folds K --group-by COLUMN``).

- a table given to the probe wins: ``--groups CSV``, else the ``--labels CSV`` when it holds
  ``COLUMN`` (the clinical table a task's labels come from), keyed by the id column;
- else, bag splits: the bag attribute ``COLUMN`` (``featurestore import --labels CSV`` keeps the CSV's
  other columns, ``case_id`` say, as bag attributes): :func:`bag_groups`;
- else, dense splits with sample ids (slide embeddings): the attributes of the bag split the
  embeddings were derived from, named by the split's metadata (``lineage``, as ``featurestore embed``
  records it: :func:`lineage_of`; when that derivation already grouped by ``COLUMN`` (``group_by``),
  each id is its own group, whatever the table): :func:`dense_groups`.

Every failure is one line naming the sample, the column or the file, and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from featurestore.errors import InvalidLabels, InvalidOption
from featurestore.probes.labels import column_indices, slide_stem, table_rows

__all__ = ["GroupSpec", "bag_groups", "dense_groups", "group_lookup", "lineage_of", "read_group_table",
           "table_groups", "table_has_column"]

LINEAGE_KEYS = ("lineage", "source")


@dataclass(frozen=True)
class GroupSpec:
    """``--group-by COLUMN`` [``--groups CSV`` keyed by ``--id-column``]."""

    column: str
    table: str | None = None
    id_column: str = "slide_id"

    @classmethod
    def of(cls, value: GroupSpec | str | None) -> GroupSpec | None:
        """A spec from a spec, a column name (groups from the lineage) or None."""
        return cls(value) if isinstance(value, str) else value


def bag_groups(bags: Any, positions: Sequence[int], spec: GroupSpec | str, where: str) -> list[str]:
    """The group of each bag at ``positions`` of a bag reader (``ds.bags``): from the spec's table
    by bag id, else the bag attribute ``spec.column``."""
    spec = GroupSpec.of(spec)
    assert spec is not None
    if spec.table is not None:
        return table_groups(spec, [bags.ids[int(i)] for i in positions], where, "slide")
    out = []
    for i in positions:
        attrs = bags.attrs(int(i))
        value = attrs.get(spec.column)
        if value is None or str(value) == "":
            bag = bags.ids[int(i)]
            raise InvalidLabels(f"{where}: bag {bag!r} has no attribute {spec.column!r} for --group-by (its "
                                f"attributes: {', '.join(repr(k) for k in attrs) or 'none'}); give the probe a table "
                                f"with columns {spec.id_column!r} and {spec.column!r} (--groups CSV, or the --labels "
                                "CSV), or pick another --group-by")
        out.append(str(value))
    return out


def group_lookup(bags: Any, spec: GroupSpec | str) -> tuple[str, Callable[[int], str]]:
    """``(column, group of the bag at a position)`` for a predictions table: as :func:`bag_groups`,
    ``""`` for a bag without one (a bag the probe did not group is not evaluated)."""
    spec = GroupSpec.of(spec)
    assert spec is not None
    if spec.table is None:
        return spec.column, lambda i: str(bags.attrs(int(i)).get(spec.column, ""))
    table = read_group_table(spec.table, spec.column, spec.id_column)
    return spec.column, lambda i: table.get(bags.ids[int(i)], "")


def table_groups(spec: GroupSpec, ids: Sequence[str], where: str, noun: str) -> list[str]:
    """The group of each of ``ids`` (the ``noun``s of ``where``) from the spec's table; one missing
    is refused, naming it and how many more."""
    assert spec.table is not None
    table = read_group_table(spec.table, spec.column, spec.id_column)
    missing = [i for i in ids if i not in table]
    if missing:
        raise InvalidLabels(f"{spec.table}: {noun} {missing[0]!r} of {where} has no {spec.column!r} there (no "
                            f"row in column {spec.id_column!r}, or an empty cell; {len(missing)} of {len(ids)} "
                            f"missing); give every {noun} its {spec.column!r}")
    return [table[i] for i in ids]


def lineage_of(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The source split a derived split names in its metadata (``dataset``, ``encoder``, ``split``
    and the derivation's ``group_by``), or None. ``featurestore embed`` writes
    ``{"lineage": {"source": {"dataset", "encoder", "split", ...}, "group_by", ...}}``; a flat
    ``lineage`` (or ``source``) holding the three names is read too."""
    for key in LINEAGE_KEYS:
        doc = metadata.get(key)
        if not isinstance(doc, dict):
            continue
        source = doc.get("source") if isinstance(doc.get("source"), dict) else doc
        if all(isinstance(source.get(k), str) for k in ("dataset", "encoder", "split")):
            return {"dataset": source["dataset"], "encoder": source["encoder"], "split": source["split"],
                    "group_by": doc.get("group_by")}
    return None


def dense_groups(info: Any, spec: GroupSpec, positions: Sequence[int] | None = None, *,
                 storage_options: dict[str, Any] | None = None, token: str | None = None) -> list[str]:
    """The group of each sample at ``positions`` (default: every sample) of a dense split (``info``:
    a ``SplitInfo``), by its ids. Only those are looked up: a sample the probe leaves out (no
    label in the task's table) needs no group."""
    every = info.ds.array.ids
    if every is None:
        raise InvalidOption(f"split {info.name} has no sample ids, so its samples cannot be grouped by "
                            f"{spec.column!r}: --group-by needs a split with ids (featurestore embed)")
    ids = list(every) if positions is None else [every[int(i)] for i in positions]
    source = lineage_of(info.metadata)
    if source is not None and source.get("group_by") == spec.column:
        return list(ids)  # the embeddings are already one per group: each id is its group
    if spec.table is not None:
        return table_groups(spec, ids, info.name, "sample")
    if source is None:
        raise InvalidOption(f"split {info.name} records no source bag split (metadata 'lineage'), so the "
                            f"{spec.column!r} of its samples is unknown: give --groups CSV with columns "
                            f"{spec.id_column!r} and {spec.column!r}")
    from client import BagDataset

    http = info.source.startswith(("http://", "https://"))
    bags = BagDataset(info.source, source["dataset"], source["encoder"], source["split"],
                      storage_options=None if http else storage_options, token=token if http else None).bags
    where = f"{source['dataset']}/{source['encoder']}/{source['split']} (the source of {info.name})"
    at = []
    for sample in ids:
        try:
            at.append(bags.position(sample))
        except LookupError:
            raise InvalidLabels(f"sample {sample!r} of {info.name} is no bag of {where}: give --groups CSV with "
                                f"columns {spec.id_column!r} and {spec.column!r}") from None
    return bag_groups(bags, at, spec.column, where)


def read_group_table(path: str, column: str, id_column: str) -> dict[str, str]:
    """``{id: group}`` from a UTF-8 CSV (tab for ``.tsv``); an id listed twice with two groups is
    refused (twice with one group is one row). A row with an empty id or group cell is left out: a
    clinical table covers other cohorts too, and a sample the probe needs without a group is
    refused where it is looked up."""
    rows = table_rows(path, "groups")
    header = [name.strip() for name in (rows[0] if rows else [])]
    at_id, at_group = column_indices(path, header, ((id_column, "--id-column"), (column, "--group-by")))
    groups: dict[str, str] = {}
    lines: dict[str, int] = {}
    stems: dict[str, tuple[str, str]] = {}  # id without its extension -> (the row's id, its group)
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        cells = [cell.strip() for cell in row] + [""] * len(header)
        sample, group = cells[at_id], cells[at_group]
        if not sample or not group:
            continue
        if groups.get(sample, group) != group:
            raise InvalidLabels(f"{path}: {sample!r} is listed twice in column {id_column!r} with two groups in "
                                f"column {column!r} ({groups[sample]!r} on line {lines[sample]}, {group!r} on line "
                                f"{line}); one sample is in one group: fix the table")
        groups[sample], lines[sample] = group, lines.get(sample, line)
    for sample, group in groups.items():  # "TCGA-xx.svs" names slide "TCGA-xx", once and alike
        stem = slide_stem(sample)
        if stem is None:
            continue
        other = (stem, groups[stem]) if stem in groups else stems.get(stem)
        if other is not None and other[1] != group:
            raise InvalidLabels(f"{path}: rows {other[0]!r} and {sample!r} name one slide with two groups in column "
                                f"{column!r} ({other[1]!r} on line {lines[other[0]]}, {group!r} on line "
                                f"{lines[sample]}): one sample is in one group: fix the table")
        stems.setdefault(stem, (sample, group))
    return {**{stem: group for stem, (_, group) in stems.items()}, **groups}


def table_has_column(path: str, column: str) -> bool:
    """Whether the table at ``path`` has a column ``column`` (read errors: as the label table's);
    only its header is read."""
    rows = table_rows(path, "labels", limit=1)
    return column in [name.strip() for name in (rows[0] if rows else [])]
