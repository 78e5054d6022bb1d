"""What a probe that learned nothing scores, and whether a result is above it.

Every probe report shows, per metric, the score of the best *constant* prediction on the same
evaluation labels (the chance baseline) and flags a metric that is not above it: its mean over
seeds lies within ``SPREAD_FACTOR`` x the seed spread of the baseline (with one seed: not above it
at all). With K folds the spread is the larger of the seed spread and the folds' standard error
(std over the folds / sqrt(K), averaged over seeds): on a small cohort the held-out slides, not the
seed, are what moves the metric, and a probe of independent labels scatters around chance by that
much. A comparison of two storage dtypes whose probes are both at chance compares noise, so it
is marked uninformative. The baselines:

- slide AUC (``auc``): 0.5, what any constant score (or a random one) gets;
- balanced accuracy: ``1 / K``, K the classes present in the evaluation labels (a constant
  prediction recalls one class fully and the others not at all);
- macro-F1: the most frequent class predicted everywhere, ``2 n_max / (n + n_max) / K``
  (``featurestore.probes.linear.macro_f1`` over the classes present);
- per-image macro Jaccard: the best single class painted on every pixel
  (``featurestore.probes.seg.per_image_jaccard`` of that prediction).

:func:`check_two_classes` refuses labels of one class before any training: AUC is undefined
there and every other metric is trivially perfect. :func:`run_fold_seeds` runs a probe's seeds
(each the mean over its folds) and judges the result against the baselines. numpy only, no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from featurestore.errors import InvalidLabels
from featurestore.probes.compare import SPREAD_FACTOR, run_seeds, seed_line

__all__ = ["assess", "check_two_classes", "class_baselines", "mark_comparison", "report_notes", "seg_baseline"]

CONSTANT = "best constant prediction"


def class_ids(values: Any, where: str) -> np.ndarray:
    """``values`` as int64 class ids, refusing what is not one (one line naming the first and
    where it is): NaN, Inf and floats that are not whole numbers (regression targets, or labels
    damaged on the way) were cast to garbage or truncated (0.5 -> 0) and a probe trained on them."""
    values = np.asarray(values)
    if values.dtype.kind == "f" and values.size:
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            at = int(np.flatnonzero(bad.reshape(-1))[0])
            raise InvalidLabels(f"{where}: label {values.reshape(-1)[at].item()!r} (value {at} of its labels) is not a "
                                f"class id: a class probe takes whole numbers >= 0; fix the labels, or give a table "
                                "of class labels (--labels)")
    return values.astype(np.int64)


def class_baselines(label_sets: Sequence[np.ndarray]) -> dict[str, float]:
    """Chance baselines of the class metrics for one or more evaluation sets (folds): the mean
    over the sets, as the probe's metric is the mean over its folds."""
    f1, balanced = [], []
    for labels in label_sets:
        labels = class_ids(labels, "the evaluated labels").reshape(-1)
        if labels.size and int(labels.min()) < 0:
            raise InvalidLabels(f"label {int(labels.min())} is negative: class ids must be >= 0")
        counts = np.bincount(labels)
        present = int((counts > 0).sum())
        n, top = int(counts.sum()), int(counts.max()) if counts.size else 0
        balanced.append(1.0 / present if present else float("nan"))
        f1.append(2.0 * top / (n + top) / present if present else float("nan"))
    return {"auc": 0.5, "balanced_accuracy": float(np.mean(balanced)), "macro_f1": float(np.mean(f1))}


def seg_baseline(masks: Iterable[np.ndarray], num_classes: int) -> float:
    """Mean per-image macro Jaccard of the best single class painted everywhere, over batches of
    ``[B, H, W]`` class maps (read a block at a time: the maps may be large)."""
    totals = np.zeros(num_classes, np.float64)
    images = 0
    for block in masks:
        block = np.asarray(block, np.int64).reshape(len(block), -1)
        if not len(block):
            continue
        low, high = int(block.min()), int(block.max())
        if low < 0 or high >= num_classes:
            raise InvalidLabels(f"label {low if low < 0 else high} is outside [0, {num_classes}); pass the right "
                                "num_classes (--num-classes) or fix the labels")
        offset = np.arange(len(block))[:, None] * num_classes
        counts = np.bincount((block + offset).reshape(-1), minlength=len(block) * num_classes)
        counts = counts.reshape(len(block), num_classes)
        present = (counts > 0).sum(1)[:, None] + (counts == 0)  # the painted class counts as present
        totals += (counts / block.shape[1] / present).sum(0)
        images += len(block)
    return float(totals.max() / images) if images else float("nan")


def at_chance(summary: Mapping[str, Any], baseline: float) -> bool:
    """Whether a metric's ``{"mean", "std"}`` is not above ``baseline``: within ``SPREAD_FACTOR``
    x its seed spread of it (one seed: not above it)."""
    if baseline != baseline:  # NaN: nothing to compare with
        return False
    return bool(summary["mean"] - baseline <= SPREAD_FACTOR * (summary["std"] or 0.0))


def assess(metrics: Mapping[str, Mapping[str, Any]], baselines: Mapping[str, float],
           folds: Sequence[Sequence[Mapping[str, float]]] | None = None) -> dict[str, dict[str, Any]]:
    """``{metric: {"baseline", "what", "at_chance"}}`` for the metrics a run reports; ``folds``:
    each seed's per-fold metrics (the spread is then at least their standard error)."""
    out = {}
    for name, summary in metrics.items():
        if name not in baselines:
            continue
        spread = summary["std"] or 0.0
        if folds and len(folds[0]) > 1:
            errors = [np.std([f[name] for f in per_seed], ddof=1) / np.sqrt(len(per_seed)) for per_seed in folds]
            spread = max(spread, float(np.mean(errors)))
        out[name] = {"baseline": float(baselines[name]), "what": CONSTANT,
                     "at_chance": at_chance({"mean": summary["mean"], "std": spread}, float(baselines[name]))}
    return out


def mark_comparison(comparison: dict[str, dict[str, Any]], a: Mapping[str, Any], b: Mapping[str, Any]) -> None:
    """Add ``uninformative`` to each compared metric: true when both sides are at chance."""
    for name, row in comparison.items():
        sides = [run.get("chance", {}).get(name, {}).get("at_chance", False) for run in (a, b)]
        row["uninformative"] = all(sides)


def class_text(value: Any, names: Sequence[str] | None) -> str:
    """A class in a message: its name as the table or split gives it (``'lung' (0)``), else its id."""
    index = int(value)
    return f"{names[index]!r} ({index})" if names is not None and 0 <= index < len(names) else str(value)


def check_two_classes(labels: np.ndarray, what: str, fix: str, names: Sequence[str] | None = None) -> None:
    """:class:`InvalidLabels` when ``labels`` hold fewer than two classes: no probe metric means
    anything there (AUC is undefined, a constant prediction is perfect). ``names``: the class
    names, for the message."""
    values, counts = np.unique(np.asarray(labels).reshape(-1), return_counts=True)
    if len(values) >= 2:
        return
    held = "no labels" if not len(values) else f"only label {class_text(values[0], names)} ({int(counts[0])} of them)"
    raise InvalidLabels(f"{what} holds {held}: a probe needs at least 2 classes (AUC is undefined for one); {fix}")


def report_notes(run: Mapping[str, Any], side: str = "") -> list[str]:
    """The warnings a report prints for a run with a metric at chance (empty otherwise)."""
    low = [(name, c) for name, c in (run.get("chance") or {}).items() if c["at_chance"]]
    if not low:
        return []
    shown = "; ".join(f"{name} {run['metrics'][name]['mean']:.4f} vs chance {c['baseline']:.4f}" for name, c in low)
    who = f"{side}{run['encoder']} ({run['dtype']})"
    return [f"WARNING: AT CHANCE: {who}: {shown}. The probe did no better than always predicting one "
            f"class (within {SPREAD_FACTOR:g} x the seed spread, or the folds' standard error): these features, "
            "labels or settings taught it nothing. Check the labels, train longer (--epochs) or with another --lr "
            "before reading this number."]


def run_fold_seeds(train_fold: Callable[[int, int], Mapping[str, float]], folds: int, seeds: Sequence[int],
                   baselines: Mapping[str, float], log: Callable[[str], None] | None, split: Any,
                   shown_folds: int | None) -> dict[str, Any]:
    """:func:`~featurestore.probes.compare.run_seeds` of a probe trained ``folds`` times per seed
    (``train_fold(seed, fold)``; one "fold" with an evaluation split): a seed's metrics are the mean
    over its folds, its :func:`~featurestore.probes.compare.seed_line` (on ``split``, "mean of
    ``shown_folds`` folds") goes to ``log``, and ``"chance"`` holds :func:`assess` of the result
    with the per-fold metrics."""
    fold_runs: list[list[dict[str, float]]] = []

    def one(seed: int) -> dict[str, float]:
        started = time.perf_counter()
        per_fold: list[dict[str, float]] = []
        fold_runs.append(per_fold)
        for fold in range(folds):
            per_fold.append(dict(train_fold(seed, fold)))
        metrics = {name: math.fsum(m[name] for m in per_fold) / len(per_fold) for name in per_fold[0]}
        if log is not None:
            log(seed_line(split, seed, metrics, shown_folds, time.perf_counter() - started))
        return metrics

    result = run_seeds(one, seeds)
    result["chance"] = assess(result["metrics"], baselines, fold_runs)
    return result
