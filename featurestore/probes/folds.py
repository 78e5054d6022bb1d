"""Cross-validation folds of a probe: stratified by label, optionally grouped (one patient's slides
in one fold), used by the linear head and the ABMIL head alike.

:func:`grouped_folds` is the one assignment: groups (a patient's slides; without groups each sample
is its own group) are put in strata by their most frequent label, shuffled per stratum from a
fixed seed and dealt one at a time to the fold that holds the fewest samples of that stratum so far
(then the fewest samples, then the next fold in turn). Without groups this is exactly a seeded
round robin of each class over the folds (:func:`stratified_folds`). :func:`fold_parts` turns the
folds into ``(train, eval)`` position pairs and refuses, in one line, more folds than groups or a
fold that would evaluate one class only. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from featurestore.errors import InvalidLabels, InvalidOption

__all__ = ["FOLD_SEED", "fold_parts", "grouped_folds", "stratified_folds"]

# Folds are drawn once from this seed, whatever the training seeds: seed k of A and of B, and
# every seed, see the same train/eval partition.
FOLD_SEED = 20180212


def grouped_folds(labels: np.ndarray, groups: Sequence[Any] | None, k: int, seed: int = FOLD_SEED,
                  group_name: str = "group") -> list[np.ndarray]:
    """``k`` disjoint sorted arrays of positions covering ``labels``, every group in one fold,
    each label spread evenly (module doc). ``groups[i]``: sample i's group (None: its own)."""
    labels = np.asarray(labels).reshape(-1)
    if groups is None:
        keys = np.arange(len(labels))
    else:
        if len(groups) != len(labels):
            raise InvalidOption(f"{len(groups)} groups for {len(labels)} samples: give each sample its {group_name}")
        _, keys = np.unique(np.asarray([str(g) for g in groups], dtype=object), return_inverse=True)
    n_groups = int(keys.max()) + 1 if len(keys) else 0
    unit = "samples" if groups is None else f"{group_name} groups"
    if not isinstance(k, int) or isinstance(k, bool) or k < 2 or k > n_groups:
        raise InvalidOption(f"folds must be an integer in [2, {n_groups}] (the number of {unit}), but got: {k!r}"
                            + ("" if groups is None or not isinstance(k, int) or k <= n_groups
                               else f"; use --folds {n_groups} or fewer"))
    members = [np.flatnonzero(keys == g) for g in range(n_groups)]
    strata = np.array([_majority(labels[m]) for m in members])
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), k])))
    folds: list[list[int]] = [[] for _ in range(k)]
    sizes = np.zeros(k, np.int64)
    turn = 0
    for value in np.unique(strata):
        of_class = np.zeros(k, np.int64)
        for group in rng.permutation(np.flatnonzero(strata == value)):
            order = [(turn + j) % k for j in range(k)]
            best = min(order, key=lambda f: (of_class[f], sizes[f], order.index(f)))
            folds[best].extend(int(i) for i in members[group])
            of_class[best] += len(members[group])
            sizes[best] += len(members[group])
            turn = (best + 1) % k
    return [np.sort(np.asarray(f, np.int64)) for f in folds]


def stratified_folds(labels: np.ndarray, k: int, seed: int = FOLD_SEED) -> list[np.ndarray]:
    """:func:`grouped_folds` with each sample its own group: each class dealt round robin over
    the folds after a seeded shuffle (so each fold holds ~1/k of every class)."""
    return grouped_folds(labels, None, k, seed)


def fold_parts(labels: np.ndarray, pool: np.ndarray, k: int, name: str, groups: Sequence[Any] | None = None,
               group_name: str = "group", names: Sequence[str] | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(train positions, eval positions)`` of each of ``k`` folds of the samples at ``pool``
    (``labels``, ``groups``: theirs); refused when a fold would evaluate one class only
    (``names``: the class names, for the message)."""
    from featurestore.probes.chance import class_text

    labels = np.asarray(labels).reshape(-1)
    folds = grouped_folds(labels, groups, k, group_name=group_name)
    values = np.unique(labels)
    if groups is None:
        counts = [int((labels == v).sum()) for v in values]
        unit = "sample(s)"
    else:
        keyed = np.asarray([str(g) for g in groups], dtype=object)
        counts = [len(set(keyed[labels == v])) for v in values]
        unit = f"{group_name} group(s)"
    fewest, rare = int(min(counts)), values[int(np.argmin(counts))]
    if fewest < 2:  # its one group is held out once, and that fold trains without the class
        raise InvalidLabels(f"{name}: class {class_text(rare, names)} has {fewest} {unit}: a fold would train without it; add samples "
                            "of that class (in other groups) or leave it out (--labels)")
    for i, fold in enumerate(folds):
        if len(np.unique(labels[fold])) < 2:
            raise InvalidLabels(f"{name}: fold {i + 1} of {k} would evaluate only label "
                                f"{class_text(labels[fold][0], names)} (AUC is undefined for one class): class "
                                f"{class_text(rare, names)} has {fewest} {unit}, fewer than the "
                                f"folds; use --folds {fewest} or fewer")
    fold_sets = [pool[f] for f in folds]
    return [(np.sort(np.concatenate([f for j, f in enumerate(fold_sets) if j != i])), fold_sets[i])
            for i in range(k)]


def _majority(values: np.ndarray) -> Any:
    found, counts = np.unique(values, return_counts=True)
    return found[int(np.argmax(counts))]  # ties: the smallest label
