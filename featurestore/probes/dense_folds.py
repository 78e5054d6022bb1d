"""``--folds K`` for the linear probe: K folds of one dense split, optionally grouped
(``--group-by COLUMN``: a patient's slides never on both sides), as pairs of label selections.

A fold is a pair of :class:`~featurestore.probes.labels.Matched` (the split's labels, the train
positions; the same labels, the eval positions), so the probe reads a fold's samples exactly as it
reads the samples a ``--labels`` table selects (:class:`featurestore.probes.dense_labels.TableBatches`).
The assignment is :func:`featurestore.probes.folds.fold_parts`, the one the ABMIL head uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featurestore.probes import chance
from featurestore.probes.folds import fold_parts
from featurestore.probes.groups import GroupSpec, dense_groups
from featurestore.probes.labels import Matched

__all__ = ["fold_pairs"]


def fold_pairs(info: Any, matched: Matched | None, folds: int, spec: GroupSpec | None, *,
               storage_options: dict[str, Any] | None = None, token: str | None = None,
               ) -> tuple[list[tuple[Matched, Matched]], dict[str, float], dict[int, str] | None]:
    """``([(train, eval) per fold], chance baselines, groups)`` of ``info``'s samples (those
    ``matched`` labels, with its labels; else every sample with its stored labels); ``groups``: each
    of those samples' ``spec`` group by position (None without ``spec``), for the predictions table."""
    from featurestore.probes.dense_labels import stored_labels

    if matched is None:
        labels = stored_labels(info)
        matched = Matched(labels, np.arange(len(labels), dtype=np.int64), "")
    positions = matched.positions
    values = matched.labels[positions]
    chance.check_two_classes(values, f"split {info.name}", "a probe needs samples of each class (--labels CSV "
                             "--label-column COL takes another task's labels)", matched.names)
    groups = None
    if spec is not None:
        groups = dense_groups(info, spec, positions, storage_options=storage_options, token=token)
    parts = fold_parts(values, positions, folds, f"split {info.name}", groups,
                       group_name=spec.column if spec is not None else "group", names=matched.names)
    summary = matched.summary
    pairs = [(Matched(matched.labels, train, summary), Matched(matched.labels, held, ""))
             for train, held in parts]
    baselines = chance.class_baselines([matched.labels[held] for _, held in parts])
    return pairs, baselines, None if groups is None else dict(zip(positions.tolist(), groups))
