"""``featurestore probe --head abmil --save-predictions CSV``: every evaluated slide's class
probabilities, per seed and fold, as a table for the analyses a metric does not answer
(patient-level scores, calibration, subgroups, a confusion per site).

Evaluation reads whole bags one at a time in position order, empty bags left out (as
``BagLoader`` does, and as featurestore.probes.attention relies on), so the k-th evaluated
batch is the k-th evaluated bag. One row per (seed, fold, slide): ``seed``, ``fold`` (0 for
``--eval SPLIT``), ``slide_id``, the ``--group-by`` column when given, ``label`` and
``predicted`` (class names where the split or the ``--labels`` table has them, else class ids)
and one ``prob_<class>`` column per class. The file is written whole at the end (a temporary
name renamed), so a probe cut short leaves no half table.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption, ShapeMismatch

__all__ = ["PredictionRecorder", "class_names_of"]


def class_names_of(ds: Any, table: Any, num_classes: int) -> list[str] | None:
    """The class names by id: the ``--labels`` table's, else those the split records
    (``label_names`` from an import, ``label_info.classes``), when they cover every class."""
    names = getattr(table, "classes", None) if table is not None else None
    if names is None:
        meta = getattr(ds, "metadata", None) or {}
        names = meta.get("label_names") or (meta.get("label_info") or {}).get("classes")
    names = [str(n) for n in names] if isinstance(names, list) else None
    return names if names is not None and len(names) >= num_classes else None


class PredictionRecorder:
    """The class probabilities of the bags one probe run evaluates (``evaluated``: the
    ``client.BagDataset`` of the evaluated split), written to ``path`` by :meth:`save`."""

    def __init__(self, path: str, evaluated: Any, *, num_classes: int, class_names: list[str] | None = None,
                 group_by: str | None = None) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise InvalidOption(f"--save-predictions {path}: directory {folder} does not exist; create it, or "
                                "give a path in an existing one")
        if os.path.isdir(path):
            raise InvalidOption(f"--save-predictions {path} is a directory: give a file name, e.g. predictions.csv")
        self.path, self.ds, self.group_by = path, evaluated, group_by
        self.names = class_names or [str(c) for c in range(num_classes)]
        self.lengths = np.asarray(evaluated.lengths, np.int64)
        self.rows: list[list[Any]] = []

    def sink(self, seed: int, fold: int, eval_positions: Sequence[int] | np.ndarray | None
             ) -> Callable[[Any, Any], None]:
        """The ``prediction_sink(probabilities [B, C], class ids [B])`` of one fold of one seed."""
        pool = range(len(self.lengths)) if eval_positions is None else (int(i) for i in eval_positions)
        order = iter([i for i in pool if self.lengths[i] > 0])

        def take(probabilities: Any, targets: Any) -> None:
            probabilities = probabilities.detach().float().cpu().numpy()
            for row, target in zip(probabilities, targets.detach().cpu().tolist()):
                i = next(order, None)
                if i is None:
                    raise ShapeMismatch("--save-predictions: more evaluated bags than the fold holds: evaluation "
                                        "must read whole bags one at a time in order")
                self.rows.append([int(seed), int(fold), i, int(target), int(row.argmax()), *row.tolist()])

        return take

    def save(self) -> dict[str, Any]:
        """Write the table; returns ``{"path", "rows"}``."""
        groups = self.group_by is not None
        header = ["seed", "fold", "slide_id", *([self.group_by] if groups else []), "label", "predicted",
                  *(f"prob_{name}" for name in self.names)]
        temp = os.path.join(os.path.dirname(os.path.abspath(self.path)), f".{os.path.basename(self.path)}.tmp")
        try:
            with open(temp, "w", encoding="utf-8", newline="") as handle:
                writer = csv.writer(handle, lineterminator="\n")
                writer.writerow(header)
                for seed, fold, i, target, predicted, *probabilities in self.rows:
                    group = [self.ds.bags.attrs(i).get(self.group_by, "")] if groups else []
                    writer.writerow([seed, fold, self.ds.ids[i], *group, self.names[target], self.names[predicted],
                                     *(f"{p:.6g}" for p in probabilities)])
            os.replace(temp, self.path)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        return {"path": self.path, "rows": len(self.rows)}
