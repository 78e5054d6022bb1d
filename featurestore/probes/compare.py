"""Seeds and spread: summarise a metric over seeds, and compare two summaries.

:func:`seed_list_of` (a seed count or list, checked), :func:`summarize` (mean, sample std),
:func:`run_seeds` (one run per seed, every metric summarised), :func:`seed_line` (a seed's log
line) and :func:`compare_summaries` (difference, pooled std, whether it exceeds ``SPREAD_FACTOR``
x the run-to-run spread, per-seed paired differences). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from featurestore.errors import InvalidOption

__all__ = ["SPREAD_FACTOR", "compare_summaries", "run_seeds", "seed_line", "seed_list_of", "summarize"]

# A metric "exceeds the run-to-run spread" when |mean_A - mean_B| > SPREAD_FACTOR * pooled std.
SPREAD_FACTOR = 2.0


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Mean and sample standard deviation (ddof=1) of one metric over seeds.

    With one seed there is no spread: ``std`` is ``None``.
    """
    data = [float(v) for v in values]
    if not data:
        raise InvalidOption("summarize needs at least one value")
    mean = math.fsum(data) / len(data)
    std = (
        math.sqrt(math.fsum((v - mean) ** 2 for v in data) / (len(data) - 1))
        if len(data) > 1
        else None
    )
    return {"mean": mean, "std": std, "values": data}


def seed_line(split: Any, seed: int, metrics: Mapping[str, float], folds: int | None, seconds: float) -> str:
    """The log line of one seed's run of a probe on ``split`` (its dataset, encoder and dtype): the
    metrics, the folds they are the mean of, the time taken. One wording for every probe head."""
    shown = ", ".join(f"{name} {v:.4f}" for name, v in metrics.items())
    return (f"{split.dataset}/{split.encoder} ({getattr(split, 'stored_dtype', split.dtype)}) seed {seed}: {shown}"
            f"{f' (mean of {folds} folds)' if folds else ''} ({seconds:.1f} s)")


def run_seeds(run_one: Callable[[int], Mapping[str, float]], seeds: Sequence[int]) -> dict[str, Any]:
    """Run ``run_one(seed)`` for each seed; summarise every metric as mean ± std.

    Returns ``{"seeds": [...], "runs": [metrics, ...], "metrics": {name: summarize(...)}}``.
    """
    seeds = list(seeds)
    if not seeds:
        raise InvalidOption("run_seeds needs at least one seed")
    runs = [dict(run_one(seed)) for seed in seeds]
    names = list(runs[0])
    return {
        "seeds": seeds,
        "runs": runs,
        "metrics": {name: summarize([run[name] for run in runs]) for name in names},
    }


def compare_summaries(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per metric: ``diff = mean_A - mean_B``, the pooled std and whether |diff| exceeds the spread.

    ``pooled_std = sqrt((std_A**2 + std_B**2) / 2)`` (equal seed counts), and a metric
    ``exceeds`` the run-to-run spread when ``|diff| > 2 * pooled_std`` and ``diff != 0``. This is
    a screening rule, not a significance test: with 3 seeds it flags differences larger than the
    noise that changing the seed alone produces. ``exceeds`` is ``None`` with a single seed.
    The per-seed paired differences (same seed = same init and shuffle order in A and B) are
    reported as well, because they isolate the storage dtype from seed noise.
    """
    out: dict[str, dict[str, Any]] = {}
    for name, summary_a in a["metrics"].items():
        if name not in b["metrics"]:
            continue
        summary_b = b["metrics"][name]
        diff = summary_a["mean"] - summary_b["mean"]
        if summary_a["std"] is None or summary_b["std"] is None:
            pooled, exceeds = None, None
        else:
            pooled = math.sqrt((summary_a["std"] ** 2 + summary_b["std"] ** 2) / 2)
            exceeds = bool(diff != 0 and abs(diff) > SPREAD_FACTOR * pooled)
        paired = [x - y for x, y in zip(summary_a["values"], summary_b["values"])]
        out[name] = {
            "mean_a": summary_a["mean"],
            "std_a": summary_a["std"],
            "mean_b": summary_b["mean"],
            "std_b": summary_b["std"],
            "diff": diff,
            "pooled_std": pooled,
            "threshold": None if pooled is None else SPREAD_FACTOR * pooled,
            "exceeds_spread": exceeds,
            "paired_diffs": paired,
            "max_abs_paired_diff": max(abs(d) for d in paired) if paired else 0.0,
        }
    return out


def seed_list_of(seeds: int | Sequence[int]) -> list[int]:
    """``seeds`` as a list: a count K means seeds ``0..K-1``; explicit seeds must be distinct, >= 0."""
    if isinstance(seeds, bool):
        raise InvalidOption(f"seeds must be a positive count or a list of seeds, but got: {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise InvalidOption(f"seeds must be a positive integer (the number of runs), but got: {seeds}")
        return list(range(seeds))
    seed_list = [int(s) for s in seeds]
    if not seed_list or len(set(seed_list)) != len(seed_list) or min(seed_list) < 0:
        raise InvalidOption(f"seeds must be a non-empty list of distinct integers >= 0, but got: {seeds!r}")
    return seed_list
