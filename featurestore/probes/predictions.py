"""``featurestore probe --save-predictions CSV`` (the ABMIL head on a bag split, the linear head
on slide or patient embeddings): every evaluated sample's class probabilities, per seed and fold,
as a table for the analyses a metric does not answer (patient-level scores, calibration,
subgroups, a confusion per site).

Evaluation reads the evaluated samples in position order without shuffling: whole bags one at a
time, empty bags left out (as ``BagLoader`` does, and as featurestore.probes.attention relies on),
or the linear head's batches of rows; so the k-th evaluated row is the k-th evaluated sample. One
row per (seed, fold, sample): ``seed``, ``fold`` (0 for ``--eval SPLIT``), ``slide_id`` (the
sample's id; its position in a split without ids; named as the embedding's ``--group-by`` column,
``case_id``, for patient embeddings), the ``--group-by`` column when given (bags, slide embeddings;
not for embeddings already one per group, whose id is the group),
``label`` and ``predicted`` (class names of the task trained: a ``--labels`` table's own when it
has them, the split's stored names when its stored labels are the task; else class ids) and one
``prob_<class>`` column per class. The file is written whole at the end (a temporary name
renamed), so a probe cut short leaves no half table.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption, ShapeMismatch

__all__ = ["PredictionRecorder", "check_output_file", "class_names_of"]


def check_output_file(path: str, flag: str, example: str) -> None:
    """Refuse, before any training, an output file that could not be written at the end (its
    folder missing, a directory in its place, no write permission): a probe's whole run would be lost."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidOption(f"{flag} {path}: directory {folder} does not exist; create it, or give a path in an "
                            "existing one")
    if os.path.isdir(path):
        raise InvalidOption(f"{flag} {path} is a directory: give a file name, e.g. {example}")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise InvalidOption(f"{flag} {path}: cannot write there (permission denied); give a path you can write")


def class_names_of(ds: Any, table: Any, num_classes: int) -> list[str] | None:
    """The class names by id of the task the probe trains: with a ``--labels`` table, the table's
    (its text labels, or the values of integer codes it renumbered), else None (class ids): the
    split's stored names belong to the stored labels, another task. Without a table, those the
    split records (``label_names`` from an import, ``label_info.classes``). Names only when they
    cover every class."""
    if table is not None:
        names = getattr(table, "classes", None)
    else:
        meta = getattr(ds, "metadata", None) or {}
        names = meta.get("label_names") or (meta.get("label_info") or {}).get("classes")
    names = [str(n) for n in names] if isinstance(names, list) else None
    return names if names is not None and len(names) >= num_classes else None


class PredictionRecorder:
    """The class probabilities of the samples one probe run evaluates, written to ``path`` by
    :meth:`save`. ``ids``: the evaluated split's sample ids (None: positions); ``lengths``: a bag
    split's bag lengths (empty bags are not evaluated); ``group``: ``(column, groups of positions)``,
    a column holding each sample's group, looked up for the evaluated samples alone when saving."""

    def __init__(self, path: str, *, num_classes: int, count: int, ids: Sequence[str] | None = None,
                 lengths: Any = None, class_names: list[str] | None = None,
                 group: tuple[str, Callable[[list[int]], Sequence[Any]]] | None = None,
                 id_name: str = "slide_id") -> None:
        check_output_file(path, "--save-predictions", "predictions.csv")
        self.path, self.ids, self.group, self.id_name = path, ids, group, id_name
        self.names = class_names or [str(c) for c in range(num_classes)]
        self.lengths = np.ones(count, np.int64) if lengths is None else np.asarray(lengths, np.int64)
        self.rows: list[list[Any]] = []

    @classmethod
    def of_bags(cls, path: str, ds: Any, *, num_classes: int, class_names: list[str] | None = None,
                group_by: Any = None) -> PredictionRecorder:
        """For the ABMIL head over ``ds`` (a ``client.BagDataset``); ``group_by``: a column or a
        ``GroupSpec`` (featurestore.probes.groups)."""
        from featurestore.probes.groups import group_lookup

        group = None
        if group_by is not None:
            column, of = group_lookup(ds.bags, group_by)
            group = column, lambda positions: [of(i) for i in positions]
        return cls(path, num_classes=num_classes, count=len(ds.ids), ids=ds.ids, lengths=ds.lengths,
                   class_names=class_names, group=group)

    @classmethod
    def of_split(cls, path: str, info: Any, *, num_classes: int, table: Any = None, group_by: Any = None,
                 groups: dict[int, str] | None = None) -> PredictionRecorder:
        """For the linear head over ``info`` (featurestore.probes.run's ``SplitInfo`` of a dense split);
        patient embeddings (``featurestore embed --group-by case_id``) name their id column so.
        ``group_by``: the folds' ``GroupSpec``, its column added unless it is the id column, with
        ``groups``, each sample's group by position (as the folds looked them up: ``fold_pairs``)."""
        from featurestore.probes.groups import lineage_of

        grouped = (lineage_of(info.metadata) or {}).get("group_by")
        id_name = grouped if isinstance(grouped, str) else "slide_id"
        group = None
        if group_by is not None and groups is not None and group_by.column != id_name:
            group = group_by.column, lambda positions: [groups[i] for i in positions]
        return cls(path, num_classes=num_classes, count=info.num_samples, ids=info.ds.array.ids,
                   class_names=class_names_of(info, table, num_classes), group=group, id_name=id_name)

    def sink(self, seed: int, fold: int, eval_positions: Sequence[int] | np.ndarray | None
             ) -> Callable[[Any, Any], None]:
        """The ``prediction_sink(probabilities [B, C], class ids [B])`` of one fold of one seed
        (``eval_positions``: the evaluated samples, in evaluation order; None: all)."""
        pool = range(len(self.lengths)) if eval_positions is None else (int(i) for i in eval_positions)
        order = iter([i for i in pool if self.lengths[i] > 0])

        def take(probabilities: Any, targets: Any) -> None:
            probabilities = probabilities.detach().float().cpu().numpy()
            for row, target in zip(probabilities, targets.detach().cpu().tolist()):
                i = next(order, None)
                if i is None:
                    raise ShapeMismatch("--save-predictions: more evaluated rows than the fold holds: evaluation "
                                        "must read the samples (whole bags) in order")
                self.rows.append([int(seed), int(fold), i, int(target), int(row.argmax()), *row.tolist()])

        return take

    def save(self) -> dict[str, Any]:
        """Write the table; returns ``{"path", "rows", "id_column"}`` (``id_column``: what a row is
        of, ``slide_id``, or the grouping column of patient embeddings, ``case_id``)."""
        header = ["seed", "fold", self.id_name, *([self.group[0]] if self.group else []), "label", "predicted",
                  *(f"prob_{name}" for name in self.names)]
        groups: dict[int, Any] = {}
        if self.group:  # looked up now, for the evaluated samples only (others may have no group)
            positions = sorted({row[2] for row in self.rows})
            groups = dict(zip(positions, self.group[1](positions)))
        temp = os.path.join(os.path.dirname(os.path.abspath(self.path)), f".{os.path.basename(self.path)}.tmp")
        try:
            with open(temp, "w", encoding="utf-8", newline="") as handle:
                writer = csv.writer(handle, lineterminator="\n")
                writer.writerow(header)
                for seed, fold, i, target, predicted, *probabilities in self.rows:
                    group = [groups[i]] if self.group else []
                    sample = self.ids[i] if self.ids is not None else i
                    writer.writerow([seed, fold, sample, *group, self.names[target], self.names[predicted],
                                     *(f"{p:.6g}" for p in probabilities)])
            os.replace(temp, self.path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        return {"path": self.path, "rows": len(self.rows), "id_column": self.id_name}
