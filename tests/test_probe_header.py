"""The probe report's header line names what a sample is: a bag's features are ``[patches, D]``
per bag (a ragged count), never a shape with the string ``'bag'`` in it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from featurestore.commands.probe import format_report
from featurestore.probes.compare import run_seeds, seed_line


def _run(task: str, sample_shape: list[Any], unit: str) -> dict[str, Any]:
    return {
        **run_seeds(lambda seed: {"auc": 0.5 + seed / 10}, [0, 1]),
        "task": task, "train_split": "train", "eval_split": "val", "num_classes": 2,
        "config": {"epochs": 1, "lr": 1e-3}, "batch_size": 1, "device": "cpu", "loader": "bag",
        "dataset": "cohort", "encoder": "uni", "dtype": "float16", "sample_shape": sample_shape,
        "train_samples": 200, "eval_samples": 40, "seconds": 1.0, "source": "store",
    }


def test_abmil_header_says_patches_per_bag() -> None:
    text = format_report(_run("abmil", ["bag", 1536], "bags"))
    assert "features [patches, 1536] per bag, 200 train + 40 eval bags" in text
    assert "'bag'" not in text


def test_dense_header_keeps_its_shape() -> None:
    assert "features [4, 8], 200 train + 40 eval samples" in format_report(_run("linear", [4, 8], "samples"))


def test_folds_header_counts_every_sample_and_each_folds_share() -> None:
    # Each fold trains on the others: its own train + eval is every labelled sample, not "of fold 0".
    run = {**_run("abmil", ["bag", 1536], "bags"), "eval_split": "5 folds", "train_samples": 18,
           "eval_samples": 6, "eval_per_fold": [6, 6, 4, 4, 4]}
    assert "features [patches, 1536] per bag, 24 bags in 5 folds, 4-6 evaluated per fold" in format_report(run)
    run = {**_run("linear", [4, 8], "samples"), "train_samples": 160, "eval_samples": 40, "eval_per_fold": [40] * 5}
    assert "200 samples in 5 folds, 40 evaluated per fold" in format_report(run)


def test_seed_line_is_one_wording_for_both_heads() -> None:
    split = SimpleNamespace(dataset="cohort", encoder="uni", dtype="float16")
    assert seed_line(split, 2, {"auc": 0.81234, "acc": 0.5}, 5, 3.14) == (
        "cohort/uni (float16) seed 2: auc 0.8123, acc 0.5000 (mean of 5 folds) (3.1 s)")
    assert seed_line(split, 0, {"auc": 1.0}, None, 0.0) == "cohort/uni (float16) seed 0: auc 1.0000 (0.0 s)"
