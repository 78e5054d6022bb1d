"""What a probe run writes and says names the task it trained: the predictions' class names when a
``--labels`` table gives another task than the stored labels, and the report's warnings."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from _probe_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread per test)

import featurestore
from featurestore.cli import main

DIM = 8
SLIDES = 16
NAMES = ["LUAD", "LUSC"]  # the stored task's class names (as `featurestore import --labels` records them)


def _subtype(i: int) -> int:
    return i % 2


def _grade(i: int) -> int:  # another task, digit-coded, not the subtype (nor its opposite)
    return (i // 2) % 2


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``cohort/bags/all``: 16 bags whose stored labels are the subtype, named LUAD/LUSC in the
    metadata; ``cohort/emb/all``: their means as an embedding split with the slides' ids, the same
    stored labels and names. The features carry both the subtype and the grade."""
    root = str(tmp_path_factory.mktemp("task") / "store")
    store = featurestore.open_store(root, mode="a")
    meta = {"label_names": NAMES}
    writer = store.create_bag_split("cohort", "bags", "all", dim=DIM, dtype="float32", label_dtype="int64",
                                    metadata=meta)
    rng = np.random.default_rng(0)
    means = []
    for i in range(SLIDES):
        patches = rng.normal(0, 1, (6, DIM)).astype(np.float32)
        patches[:, 0] += 2 * _subtype(i)
        patches[:, 1] += 2 * _grade(i)
        writer.add_bag(f"S{i:02d}", patches, label=_subtype(i))
        means.append(patches.mean(0))
    writer.commit()
    ids = [f"S{i:02d}" for i in range(SLIDES)]
    w = store.create_split("cohort", "emb", "all", num_samples=SLIDES, sample_shape=(DIM,), dtype="float32",
                           label_shape=(), label_dtype="int64", ids=ids, metadata=meta)
    w.write(0, np.stack(means).astype(np.float32), np.array([_subtype(i) for i in range(SLIDES)], np.int64))
    w.commit()
    return root


def _table(tmp_path: Path, named: bool) -> str:
    path = tmp_path / ("grade-named.csv" if named else "grade.csv")
    cells = [("low", "high")[_grade(i)] if named else str(_grade(i)) for i in range(SLIDES)]
    path.write_text("slide_id,subtype,grade\n" + "".join(f"S{i:02d}.svs,{NAMES[_subtype(i)]},{cell}\n"
                                                          for i, cell in enumerate(cells)))
    return str(path)


@pytest.mark.parametrize("head", ["abmil", "linear"])
@pytest.mark.parametrize("named", [False, True])
def test_predictions_name_the_classes_of_the_table_task_not_the_stored_ones(
        store: str, tmp_path: Path, head: str, named: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """A split imported with --label-column subtype (names LUAD/LUSC) probed on a table's grade:
    the predictions CSV named the grade's classes 0/1 LUAD/LUSC, so a slide of grade 1 read LUSC."""
    out = tmp_path / "p.csv"
    encoder = "bags" if head == "abmil" else "emb"
    code = main(["probe", store, "--head", head, "--dataset", "cohort", "--encoder", encoder, "--train", "all",
                 "--folds", "2", "--seeds", "1", "--epochs", "1", "--batch-size", "1" if head == "abmil" else "4",
                 "--device", "cpu", "--quiet", "--labels", _table(tmp_path, named), "--label-column", "grade",
                 "--save-predictions", str(out)])
    capsys.readouterr()
    assert code == 0
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    classes = ["high", "low"] if named else ["0", "1"]  # the table's names (sorted), else the class ids
    assert list(rows[0])[-4:] == ["label", "predicted", *(f"prob_{c}" for c in classes)]
    assert len(rows) == SLIDES
    for row in rows:
        i = int(row["slide_id"][1:])
        assert row["label"] == (("low", "high")[_grade(i)] if named else str(_grade(i))), row
        assert row["predicted"] in classes


def test_an_attention_map_records_the_table_task_it_was_trained_on(
        store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A map's lineage named the run's splits and settings but not the task: one trained on a
    table's grade could not be told from one trained on the stored subtype."""
    from featurestore import open_store
    from featurestore.core.bag_attention import open_attention

    assert main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", "bags", "--train", "all",
                 "--folds", "2", "--seeds", "1", "--epochs", "1", "--batch-size", "1", "--device", "cpu", "--quiet",
                 "--labels", _table(tmp_path, False), "--label-column", "grade", "--save-attention", "grade"]) == 0
    capsys.readouterr()
    opened = open_store(store)
    bags = opened.open_bags("cohort", "bags", "all")
    lineage = open_attention(opened.storage, bags.key, "grade", bags.metadata).lineage
    assert lineage["probe"]["labels"] == {"table": "grade.csv", "column": "grade", "id_column": "slide_id"}


def test_predictions_keep_the_stored_names_when_the_stored_labels_are_the_task(
        store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.csv"
    assert main(["probe", store, "--head", "linear", "--dataset", "cohort", "--encoder", "emb", "--train", "all",
                 "--folds", "2", "--seeds", "1", "--epochs", "1", "--batch-size", "4", "--device", "cpu", "--quiet",
                 "--save-predictions", str(out)]) == 0
    capsys.readouterr()
    rows = list(csv.DictReader(out.open(encoding="utf-8")))
    assert list(rows[0])[-2:] == ["prob_LUAD", "prob_LUSC"]
    assert all(row["label"] == NAMES[_subtype(int(row["slide_id"][1:]))] for row in rows)


# ------------------------------------------------------------------------------- a continuous column


def test_a_continuous_label_column_is_refused_as_such(store: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """An age column (40.0, 41.5, ...: one value per slide) read as class names failed on its first
    class: "class '40.0' (0) has 1 sample(s) ... add samples of that class"."""
    path = tmp_path / "age.csv"
    path.write_text("slide_id,age\n" + "".join(f"S{i:02d},{40 + 1.5 * i}\n" for i in range(SLIDES)))
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", "bags", "--train", "all",
                 "--folds", "2", "--seeds", "1", "--epochs", "1", "--device", "cpu", "--quiet",
                 "--labels", str(path), "--label-column", "age"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert (f"column 'age' looks continuous ({SLIDES} distinct numbers over {SLIDES} labelled rows: "
            "40.0, 41.5, 43.0") in err
    assert "bin this one into classes" in err and "add samples" not in err


@pytest.mark.parametrize("cells", [
    ["0.5", "1.5"] * 8,  # two classes named by decimals: names, as before
    [f"{k}.0" for k in range(16)],  # whole numbers written as floats: names (the fold check says what is wrong)
    ["a", "1.5", "2.5", "3.5"] * 4,  # not all numbers
])
def test_columns_that_are_not_measurements_stay_class_names(tmp_path: Path, cells: list[str]) -> None:
    from featurestore.probes.labels import read_label_table

    path = tmp_path / "t.csv"
    path.write_text("slide_id,y\n" + "".join(f"S{i:02d},{c}\n" for i, c in enumerate(cells)))
    assert read_label_table(str(path), "y").classes == sorted(set(cells))


# ------------------------------------------------------------------------- trained and scored on one split


@pytest.mark.parametrize("head", ["abmil", "linear"])
def test_training_and_evaluating_on_one_split_says_it_is_the_training_fit(
        store: str, head: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--train all --eval all scored the slides the head was fitted to, reported like a held-out score."""
    common = ["probe", store, "--head", head, "--dataset", "cohort", "--encoder", "bags" if head == "abmil" else "emb",
              "--train", "all", "--seeds", "1", "--epochs", "1", "--device", "cpu", "--quiet",
              "--batch-size", "1" if head == "abmil" else "4"]
    assert main([*common, "--eval", "all"]) == 0
    out = capsys.readouterr().out
    warned = [line for line in out.splitlines() if "training fit" in line]
    assert warned == ["Warning: trained and evaluated on the same split 'all': the training fit, not a held-out "
                      "score; evaluate on another split (--eval) or on folds (--folds K)."], out
    assert main([*common, "--folds", "2"]) == 0
    assert "training fit" not in capsys.readouterr().out


# ------------------------------------------------------------------------------ the same metric every seed


def _run(values: dict[str, list[float]], baselines: dict[str, float], folds: list | None = None) -> dict:
    from featurestore.probes.chance import assess
    from featurestore.probes.compare import run_seeds

    seeds = list(range(len(next(iter(values.values())))))
    result = run_seeds(lambda seed: {name: v[seed] for name, v in values.items()}, seeds)
    return {**result, "chance": assess(result["metrics"], baselines, folds), "task": "linear",
            "train_split": "patients", "eval_split": "3 folds", "folds": 3, "num_classes": 2, "config": {"epochs": 1, "lr": 1e-2},
            "batch_size": 64, "device": "cpu", "loader": "stream", "dataset": "d", "encoder": "m", "dtype": "float32",
            "sample_shape": [8], "train_samples": 8, "eval_samples": 4, "seconds": 0.0, "source": "store"}


def test_the_same_metric_every_seed_claims_a_constant_class_only_at_a_constant_predictions_score() -> None:
    """Patient embeddings scored balanced accuracy 0.75 under both seeds; the report said the probe
    "probably predicts a constant class" (a constant scores 0.5) "before reading the comparison"
    (none was run)."""
    from featurestore.commands.probe import format_report
    from featurestore.probes.compare import compare_summaries

    baselines = {"auc": 0.5, "balanced_accuracy": 0.5}
    # as the walk's 12 patients in 3 folds: 0.75 every seed, AT CHANCE by the folds' standard error
    per_fold = [{"auc": a, "balanced_accuracy": b} for a, b in ((0.5, 0.5), (1.0, 1.0), (1.0, 0.75))]
    learned = _run({"auc": [0.83, 0.83], "balanced_accuracy": [0.75, 0.75]}, baselines, [per_fold, per_fold])
    assert learned["chance"]["balanced_accuracy"]["at_chance"]
    assert "exactly the same" not in format_report(learned)
    constant = _run({"auc": [0.5, 0.5], "balanced_accuracy": [0.5, 0.5]}, baselines)
    text = format_report(constant).replace("\n", " ")
    assert ("Warning: m gave exactly the same auc, balanced_accuracy under every seed, no better than a constant "
            "prediction: the probe probably predicts one class everywhere.") in text
    assert "comparison" not in text and "before reading this number." in text
    other = _run({"auc": [0.8, 0.9], "balanced_accuracy": [0.7, 0.8]}, baselines)
    compared = format_report({"a": constant, "b": other, "comparison": compare_summaries(constant, other)})
    assert "before reading the comparison." in compared.replace("\n", " ")

