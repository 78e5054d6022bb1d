"""Area under the ROC curve, the metric both probe heads report for classes: binary, or the
macro mean of one-vs-rest AUCs. numpy only."""

from __future__ import annotations

import numpy as np

__all__ = ["roc_auc", "slide_auc"]


def roc_auc(scores: np.ndarray, target: np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for ``target`` in {0, 1} (Mann-Whitney U with tied
    scores at their mean rank, as scikit-learn's ``roc_auc_score``); NaN with a single class."""
    scores = np.asarray(scores, np.float64)
    target = np.asarray(target).astype(bool)
    positives, negatives = int(target.sum()), int((~target).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), np.float64)
    sorted_scores = scores[order]
    # Mean rank (1-based) of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(scores)]
    mean_rank = (starts + ends + 1) / 2.0
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[target].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))


def slide_auc(probabilities: np.ndarray, target: np.ndarray, num_classes: int) -> float:
    """Binary: AUC of the positive class's probability. More classes: the mean of the
    one-vs-rest AUCs over the classes present in ``target`` (with at least one negative)."""
    if num_classes == 2:
        return roc_auc(probabilities[:, 1], target == 1)
    values = [roc_auc(probabilities[:, c], target == c) for c in range(num_classes)]
    values = [v for v in values if not np.isnan(v)]
    return float(np.mean(values)) if values else float("nan")
