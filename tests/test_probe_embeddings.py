"""The linear probe on slide embeddings ``[n, E]``: AUC, grouped stratified folds (a patient's slides
never on both sides), groups from a table or from the source bag split's attributes, the ABMIL
head's grouped folds, a planted signal found and independent labels flagged at chance."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from _probe_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread per test)

import featurestore
from featurestore.cli import main
from featurestore.errors import InvalidLabels, InvalidOption
from featurestore.probes.folds import fold_parts, grouped_folds, stratified_folds
from featurestore.probes.groups import GroupSpec
from featurestore.probes.mil_run import run_mil_probe
from featurestore.probes.run import compare_probes, run_probe

DIM = 16
BLOCK = slice(0, 4)  # the channels a label-1 slide carries shifted


def _cohort(patients: int = 30, seed: int = 0) -> list[tuple[str, str, np.ndarray, int]]:
    """(slide id, case id, patches [m, DIM], label): 2-3 slides per patient, one label per
    patient; each patient's slides share an offset, and label 1 shifts the BLOCK channels."""
    rng = np.random.default_rng(seed)
    slides = []
    for p in range(patients):
        label = p % 2
        offset = rng.normal(0, 0.5, DIM)
        for s in range(2 + p % 2 + (p % 3 == 0)):
            patches = rng.normal(0, 1, (int(rng.integers(10, 20)), DIM)) + offset
            if label:
                patches[:, BLOCK] += 1.5
            slides.append((f"TCGA-{p:02d}-S{s}", f"case-{p:02d}", patches.astype(np.float32), label))
    return slides


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``cohort/bags/all`` (bag attribute ``case_id``), ``cohort/bare/all`` (the same bags without
    it); dense embeddings of its slides (the bag means, computed here): ``mean/all`` (lineage ->
    the bag split), ``mean16/all`` (the same as float16), ``nolineage/all``, ``random/all`` (noise
    features, labels drawn per patient independently of them) and ``patients/all`` (one row per
    case, lineage grouped by case_id)."""
    root = str(tmp_path_factory.mktemp("emb") / "store")
    store = featurestore.open_store(root, mode="a")
    slides = _cohort()
    writer = store.create_bag_split("cohort", "bags", "all", dim=DIM, dtype="float32", label_dtype="int64",
                                    chunk_bytes=64 * DIM * 4)
    for slide, case, patches, label in slides:
        writer.add_bag(slide, patches, label=label, attrs={"case_id": case})
    writer.commit()
    # the same bags with no case_id (extracted from slides, say): their groups come from a table
    writer = store.create_bag_split("cohort", "bare", "all", dim=DIM, dtype="float32", label_dtype="int64",
                                    chunk_bytes=64 * DIM * 4)
    for slide, _, patches, label in slides:
        writer.add_bag(slide, patches, label=label)
    writer.commit()
    ids = [s[0] for s in slides]
    means = np.stack([s[2].mean(0) for s in slides]).astype(np.float32)
    labels = np.array([s[3] for s in slides], np.int64)
    # as featurestore embed records its source (format.lineage)
    lineage = {"lineage": {"kind": "embedding", "version": 1, "group_by": None,
                           "source": {"dataset": "cohort", "encoder": "bags", "split": "all", "kind": "bags"}}}
    rng = np.random.default_rng(3)
    noise = rng.normal(0, 1, means.shape).astype(np.float32)
    by_case = {case: int(rng.integers(0, 2)) for case in sorted({s[1] for s in slides})}
    random_labels = np.array([by_case[s[1]] for s in slides], np.int64)
    for encoder, values, dtype, meta, lab in (("mean", means, "float32", lineage, labels),
                                              ("mean16", means, "float16", lineage, labels),
                                              ("nolineage", means, "float32", None, labels),
                                              ("random", noise, "float32", lineage, random_labels)):
        w = store.create_split("cohort", encoder, "all", num_samples=len(ids), sample_shape=(DIM,), dtype=dtype,
                               label_shape=(), label_dtype="int64", ids=ids, metadata=meta)
        w.write(0, values, lab)
        w.commit()
    cases = sorted({s[1] for s in slides})
    per_case = np.stack([means[[s[1] == c for s in slides]].mean(0) for c in cases]).astype(np.float32)
    grouped = {"lineage": {**lineage["lineage"], "group_by": "case_id"}}
    w = store.create_split("cohort", "patients", "all", num_samples=len(cases), sample_shape=(DIM,), dtype="float32",
                           label_shape=(), label_dtype="int64", ids=cases, metadata=grouped)
    w.write(0, per_case, np.array([int(c[-2:]) % 2 for c in cases], np.int64))
    w.commit()
    return root


def _cases(tmp_path: Path) -> str:
    path = tmp_path / "cases.csv"
    path.write_text("slide_id,case_id\n" + "".join(f"{s},{c}\n" for s, c, _, _ in _cohort()))
    return str(path)


def _clinical(tmp_path: Path) -> str:
    """A clinical table as a lab keeps it: slide, patient, a task's label (the stored one, as a name),
    and a slide of another cohort without a patient."""
    path = tmp_path / "clinical.csv"
    path.write_text("slide_id,case_id,subtype\n" + "".join(f"{s},{c},{'AB'[y]}\n" for s, c, _, y in _cohort())
                    + "OTHER-01,,A\n")
    return str(path)


# ------------------------------------------------------------------------------- the folds


def test_grouped_folds_keep_each_patient_in_one_fold_and_stratify() -> None:
    slides = _cohort()
    labels = np.array([s[3] for s in slides])
    cases = [s[1] for s in slides]
    parts = fold_parts(labels, np.arange(len(labels)), 5, "cohort", cases, group_name="case_id")
    assert len(parts) == 5
    seen: dict[str, int] = {}
    for k, (train, held) in enumerate(parts):
        assert not {cases[i] for i in train} & {cases[i] for i in held}  # never on both sides
        assert set(np.unique(labels[held])) == {0, 1}
        for i in held:
            assert seen.setdefault(cases[i], k) == k
    assert sorted(np.concatenate([h for _, h in parts]).tolist()) == list(range(len(labels)))
    # seeded, deterministic
    again = grouped_folds(labels, cases, 5)
    assert all(np.array_equal(a, h) for a, (_, h) in zip(again, parts))


def test_ungrouped_folds_are_the_stratified_round_robin() -> None:
    labels = np.random.default_rng(3).integers(0, 3, 40)
    folds = stratified_folds(labels, 4)
    assert all(np.array_equal(a, b) for a, b in zip(folds, grouped_folds(labels, None, 4)))
    for fold in folds:
        assert abs(len(fold) - 10) <= 1


def test_folds_refused_in_one_line_for_too_few_groups() -> None:
    labels = np.array([0, 0, 1, 1, 0, 1])
    cases = ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(InvalidOption, match=r"\[2, 3\] \(the number of case_id groups\).*--folds 3 or fewer"):
        fold_parts(labels, np.arange(6), 4, "cohort", cases, group_name="case_id")
    labels = np.array([0, 0, 0, 0, 1, 1])  # class 1 lives in one patient only
    cases = ["a", "a", "b", "c", "d", "d"]
    with pytest.raises(InvalidLabels, match="class 1 has 1 case_id group.*would train without it"):
        fold_parts(labels, np.arange(6), 2, "cohort", cases, group_name="case_id")
    labels = np.array([0, 0, 1, 1, 0, 0, 1, 1, 0, 1])  # class 1 in 2 patients: 2 folds at most
    cases = ["a", "a", "b", "b", "c", "c", "d", "d", "e", "b"]
    with pytest.raises(InvalidLabels, match="class 1 has 2 case_id group.*use --folds 2 or fewer"):
        fold_parts(labels, np.arange(10), 3, "cohort", cases, group_name="case_id")
    assert len(fold_parts(labels, np.arange(10), 2, "cohort", cases, group_name="case_id")) == 2


# ------------------------------------------------------------------------------- the probe


def test_planted_signal_found_with_grouped_folds_from_the_lineage(store: str) -> None:
    result = run_probe(store, "cohort", "mean", train_split="all", folds=5, group_by=GroupSpec("case_id"),
                       seeds=2, batch_size=16, device="cpu")
    assert list(result["metrics"]) == ["auc", "balanced_accuracy", "macro_f1"]
    assert result["metrics"]["auc"]["mean"] >= 0.9
    assert result["folds"] == 5 and result["group_by"] == "case_id" and result["eval_split"] == "5 folds"
    assert result["label_notes"] == []  # stored labels: no table line (nor a blank one) in the report
    assert not result["chance"]["auc"]["at_chance"] and result["chance"]["auc"]["baseline"] == 0.5


def test_independent_labels_are_flagged_at_chance(store: str) -> None:
    result = run_probe(store, "cohort", "random", train_split="all", folds=5, group_by=GroupSpec("case_id"),
                       seeds=2, batch_size=16, device="cpu")
    assert result["chance"]["auc"]["at_chance"], result["metrics"]["auc"]


def test_groups_table_gives_the_same_folds_as_the_lineage(store: str, tmp_path: Path) -> None:
    options = dict(train_split="all", folds=3, seeds=1, epochs=2, batch_size=16, device="cpu")
    by_lineage = run_probe(store, "cohort", "mean", group_by=GroupSpec("case_id"), **options)
    by_table = run_probe(store, "cohort", "nolineage", group_by=GroupSpec("case_id", _cases(tmp_path)), **options)
    assert by_lineage["runs"] == by_table["runs"]
    with pytest.raises(InvalidOption, match="records no source bag split.*--groups CSV"):
        run_probe(store, "cohort", "nolineage", group_by=GroupSpec("case_id"), **options)


def test_patient_embeddings_are_their_own_groups(store: str) -> None:
    from featurestore.probes.groups import dense_groups
    from featurestore.probes.run import describe_split

    info = describe_split(store, "cohort", "patients", "all")
    assert dense_groups(info, GroupSpec("case_id")) == info.ds.array.ids
    result = run_probe(store, "cohort", "patients", train_split="all", folds=3, group_by="case_id",
                       seeds=1, batch_size=8, device="cpu")
    assert result["metrics"]["auc"]["mean"] >= 0.9


def test_compare_two_embedding_splits_with_grouped_folds(store: str) -> None:
    result = compare_probes(store, "cohort", "mean", "mean16", train_split="all", folds=3,
                            group_by=GroupSpec("case_id"), seeds=2, epochs=3, batch_size=16, device="cpu")
    assert set(result["comparison"]) == {"auc", "balanced_accuracy", "macro_f1"}
    assert result["a"]["folds"] == result["b"]["folds"] == 3


def test_abmil_grouped_folds_from_bag_attributes(store: str) -> None:
    result = run_mil_probe(store, "cohort", "bags", train_split="all", folds=3, group_by="case_id", seeds=1,
                           epochs=1, device="cpu")
    assert result["group_by"] == "case_id" and "auc" in result["metrics"]
    with pytest.raises(InvalidLabels, match="has no attribute 'site'"):
        run_mil_probe(store, "cohort", "bags", train_split="all", folds=3, group_by="site", seeds=1, epochs=1,
                      device="cpu")


def test_cli_linear_folds_group_by(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "nolineage", "--train", "all", "--folds", "3",
                 "--group-by", "case_id", "--groups", _cases(tmp_path), "--seeds", "1", "--epochs", "2",
                 "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "linear probe (AUC, balanced accuracy, macro-F1)" in out and "grouped by case_id" in out
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "patients", "--train", "all", "--folds", "3",
                 "--group-by", "case_id", "--seeds", "2", "--batch-size", "8", "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "1.0000 ± 0.0000" in out and "predicts a constant" not in out, out
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "mean", "--train", "all", "--folds", "40",
                 "--group-by", "case_id", "--quiet", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and "--folds 30 or fewer" in err and len(err.strip().splitlines()) == 1
    base = ["probe", store, "--dataset", "cohort", "--encoder", "mean", "--train", "all", "--quiet"]
    for extra, message in ((["--eval", "all", "--group-by", "case_id"], "--group-by groups the samples of --folds K"),
                           (["--folds", "3", "--groups", "x.csv"], "--groups CSV gives the column of --group-by"),
                           (["--folds", "3", "--eval", "all"], "not both")):
        code = main(base + extra)
        err = capsys.readouterr().err
        assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_grouping_stops_a_patient_fingerprint_from_leaking(tmp_path: Path) -> None:
    """Slides of a patient share a fingerprint and the patient's label is random: with the
    patient's other slides in training (ungrouped folds) the probe scores high by recognising the
    patient; with grouped folds it has nothing to go on."""
    rng = np.random.default_rng(5)
    patients, dim = 24, 64
    ids, cases, rows, labels = [], [], [], []
    for p in range(patients):
        print_, label = rng.normal(0, 1, dim), p % 2
        for s in range(3):
            ids.append(f"P{p:02d}-S{s}")
            cases.append(f"P{p:02d}")
            rows.append(print_ + rng.normal(0, 0.1, dim))
            labels.append(label)
    root = str(tmp_path / "store")
    w = featurestore.open_store(root, mode="a").create_split(
        "leak", "emb", "all", num_samples=len(ids), sample_shape=(dim,), dtype="float32", label_shape=(),
        label_dtype="int64", ids=ids)
    w.write(0, np.asarray(rows, np.float32), np.asarray(labels, np.int64))
    w.commit()
    table = tmp_path / "cases.csv"
    table.write_text("slide_id,case_id\n" + "".join(f"{i},{c}\n" for i, c in zip(ids, cases)))
    options = dict(train_split="all", folds=4, seeds=2, batch_size=8, device="cpu")
    leaky = run_probe(root, "leak", "emb", **options)
    grouped = run_probe(root, "leak", "emb", group_by=GroupSpec("case_id", str(table)), **options)
    assert leaky["metrics"]["auc"]["mean"] > 0.9 and not leaky["chance"]["auc"]["at_chance"]
    assert grouped["metrics"]["auc"]["mean"] < 0.75 and grouped["chance"]["auc"]["at_chance"]


def test_abmil_grouping_stops_a_patient_fingerprint_from_leaking(tmp_path: Path) -> None:
    """The same on a bag split, the groups from the bags' ``case_id`` attribute."""
    rng = np.random.default_rng(5)
    root = str(tmp_path / "store")
    writer = featurestore.open_store(root, mode="a").create_bag_split("leak", "bags", "all", dim=32, dtype="float32",
                                                                        label_dtype="int64")
    for p in range(12):
        print_ = rng.normal(0, 1, 32)
        for s in range(3):
            patches = (print_ + rng.normal(0, 0.1, (4, 32))).astype(np.float32)
            writer.add_bag(f"P{p:02d}-S{s}", patches, label=p % 2, attrs={"case_id": f"P{p:02d}"})
    writer.commit()
    options = dict(train_split="all", folds=3, seeds=1, epochs=4, device="cpu", loader="ram")
    leaky = run_mil_probe(root, "leak", "bags", **options)
    grouped = run_mil_probe(root, "leak", "bags", group_by="case_id", **options)
    assert leaky["metrics"]["auc"]["mean"] > 0.9
    assert grouped["metrics"]["auc"]["mean"] < 0.75


def test_linear_auc_is_binary_or_macro_one_vs_rest() -> None:
    from featurestore.probes.auc import roc_auc
    from featurestore.probes.linear import evaluate_linear_probe

    scores = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 2.0, 0.0], [0.0, 0.5, 0.4],
                           [0.2, 0.0, 1.0]])
    target = torch.tensor([0, 1, 2, 0, 1, 2])
    identity = torch.nn.Identity()  # the "model" returns the scores as its logits
    metrics = evaluate_linear_probe(identity, [(scores, target)], num_classes=3, device=torch.device("cpu"))
    prob = torch.softmax(scores, 1).double().numpy()
    expected = np.mean([roc_auc(prob[:, c], target.numpy() == c) for c in range(3)])
    assert metrics["auc"] == pytest.approx(expected) and 0.5 < metrics["auc"] < 1.0
    binary = evaluate_linear_probe(identity, [(scores[:, :2], torch.tensor([0, 1, 1, 0, 1, 0]))], num_classes=2,
                                   device=torch.device("cpu"))
    two = torch.softmax(scores[:, :2], 1)[:, 1].double().numpy()
    assert binary["auc"] == pytest.approx(roc_auc(two, np.array([0, 1, 1, 0, 1, 0]) == 1))
    assert list(binary) == ["auc", "balanced_accuracy", "macro_f1"]


def test_a_labels_table_with_grouped_folds(store: str, tmp_path: Path) -> None:
    from featurestore.probes.labels import read_label_table

    slides = _cohort()
    path = tmp_path / "task.csv"  # the planted label as names, one slide of each patient left out
    path.write_text("slide_id,task\n" + "".join(f"{s},{('neg', 'pos')[y]}\n" for s, _, _, y in slides
                                                if not s.endswith("-S0")))
    result = run_probe(store, "cohort", "mean", train_split="all", folds=3, group_by=GroupSpec("case_id"), seeds=1,
                       batch_size=16, device="cpu", labels=read_label_table(str(path), "task"))
    left = sum(1 for s in slides if s[0].endswith("-S0"))
    assert result["train_samples"] + result["eval_samples"] == len(slides) - left
    assert result["metrics"]["auc"]["mean"] >= 0.9 and "without a label left out" in result["label_notes"][0]


def test_save_predictions_of_patient_embeddings_give_each_folds_auc(store: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import csv
    import json

    from featurestore.probes.auc import slide_auc

    table, result = tmp_path / "preds.csv", tmp_path / "result.json"
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "patients", "--train", "all", "--folds", "3",
                 "--group-by", "case_id", "--seeds", "2", "--batch-size", "8", "--device", "cpu", "--quiet",
                 "--save-predictions", str(table), "--json", str(result)])
    assert code == 0 and "predictions: 60 rows (seed, fold, case_id) in" in capsys.readouterr().out
    rows = list(csv.DictReader(table.open(encoding="utf-8")))
    # Patient embeddings' ids are the patients': the column is named as the embedding's --group-by.
    assert list(rows[0]) == ["seed", "fold", "case_id", "label", "predicted", "prob_0", "prob_1"]
    cases = featurestore.open_store(store).open("cohort", "patients", "all").ids
    runs = json.loads(result.read_text())["runs"]
    for seed in ("0", "1"):
        mine = [r for r in rows if r["seed"] == seed]
        assert sorted(r["case_id"] for r in mine) == sorted(cases)  # each patient once, held out
        per_fold = []
        for fold in ("0", "1", "2"):
            held = [r for r in mine if r["fold"] == fold]
            prob = np.array([[float(r["prob_0"]), float(r["prob_1"])] for r in held])
            per_fold.append(slide_auc(prob, np.array([int(r["label"]) for r in held]), 2))
        assert np.mean(per_fold) == pytest.approx(runs[int(seed)]["auc"], abs=1e-4)  # a seed's AUC: the folds' mean
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "mean", "--compare", "mean16", "--train", "all",
                 "--folds", "3", "--quiet", "--device", "cpu", "--save-predictions", str(table)])
    err = capsys.readouterr().err
    assert code == 1 and "--save-predictions keeps one run's outputs" in err and len(err.strip().splitlines()) == 1


def test_save_predictions_of_slide_embeddings_name_each_slides_group(store: str, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Grouped folds on slide embeddings: the table names each slide's group beside its id, from the
    source bag split's attributes (the lineage) or from a --groups table, so a patient-level score
    can be taken from it; every held-out slide once per seed."""
    import csv

    case_of = {s: c for s, c, _, _ in _cohort()}
    for encoder, extra in (("mean", []), ("nolineage", ["--groups", _cases(tmp_path)])):
        table = tmp_path / f"{encoder}.csv"
        code = main(["probe", store, "--dataset", "cohort", "--encoder", encoder, "--train", "all", "--folds", "3",
                     "--group-by", "case_id", *extra, "--seeds", "1", "--epochs", "2", "--batch-size", "8",
                     "--device", "cpu", "--quiet", "--save-predictions", str(table)])
        assert code == 0, capsys.readouterr().err
        rows = list(csv.DictReader(table.open(encoding="utf-8")))
        assert list(rows[0])[:5] == ["seed", "fold", "slide_id", "case_id", "label"]
        assert sorted(r["slide_id"] for r in rows) == sorted(case_of)
        assert all(r["case_id"] == case_of[r["slide_id"]] for r in rows)
        assert len({(r["case_id"], r["fold"]) for r in rows}) == len(set(case_of.values()))  # a case in one fold


def test_abmil_groups_from_a_table_where_the_bags_have_none(store: str, tmp_path: Path) -> None:
    """Bags without a case_id attribute (extracted from slides) are grouped by a table given to the
    probe, --groups or the --labels table holding the column: the same folds, so the same runs, as
    the attributes give."""
    options = dict(train_split="all", folds=3, seeds=1, epochs=1, device="cpu")
    by_attrs = run_mil_probe(store, "cohort", "bags", group_by="case_id", **options)
    by_table = run_mil_probe(store, "cohort", "bare", group_by=GroupSpec("case_id", _cases(tmp_path)), **options)
    assert by_table["group_by"] == "case_id" and by_table["runs"] == by_attrs["runs"]
    with pytest.raises(InvalidLabels, match="has no attribute 'case_id'.*--groups CSV, or the --labels CSV"):
        run_mil_probe(store, "cohort", "bare", group_by="case_id", **options)
    # rows of other cohorts without a case are left out; a slide of this split without one is refused
    short = tmp_path / "short.csv"
    short.write_text("slide_id,case_id\nTCGA-00-S0,case-00\nOTHER-01,\nTCGA-00-S1,\n")
    with pytest.raises(InvalidLabels, match="short.csv: slide 'TCGA-00-S1' of cohort/bare/all has no 'case_id' there"):
        run_mil_probe(store, "cohort", "bare", group_by=GroupSpec("case_id", str(short)), **options)


def test_cli_group_by_a_column_of_the_labels_table(store: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The clinical table of the task gives the groups too: abmil on bags without the attribute
    (its predictions name each slide's case), and linear on embeddings without a lineage."""
    clinical, predictions = _clinical(tmp_path), tmp_path / "predictions.csv"
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", "bare", "--train", "all",
                 "--folds", "3", "--group-by", "case_id", "--labels", clinical, "--label-column", "subtype",
                 "--seeds", "1", "--epochs", "1", "--device", "cpu", "--quiet", "--save-predictions", str(predictions)])
    out = capsys.readouterr().out
    assert code == 0 and "grouped by case_id" in out, out
    rows = predictions.read_text().splitlines()
    assert rows[0].startswith("seed,fold,slide_id,case_id,label") and len(rows) == 1 + len(_cohort())
    case_of = {s: c for s, c, _, _ in _cohort()}
    assert all(row.split(",")[3] == case_of[row.split(",")[2]] for row in rows[1:])
    assert len({(row.split(",")[3], row.split(",")[1]) for row in rows[1:]}) == len(set(case_of.values()))
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "nolineage", "--train", "all", "--folds", "3",
                 "--group-by", "case_id", "--labels", clinical, "--label-column", "subtype", "--seeds", "1",
                 "--epochs", "2", "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "grouped by case_id" in out, out


def test_a_slide_without_label_needs_no_group(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A slide the task's table leaves unlabelled (and without a case) is left out before the folds
    are grouped: grouping it was refused before, though the probe never uses it."""
    slides = _cohort()
    path = tmp_path / "clinical.csv"
    path.write_text("slide_id,case_id,subtype\n" + f"{slides[0][0]},,\n" + "".join(
        f"{s},{c},{'AB'[y]}\n" for s, c, _, y in slides[1:]))
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "nolineage", "--train", "all", "--folds", "3",
                 "--group-by", "case_id", "--labels", str(path), "--label-column", "subtype", "--seeds", "1",
                 "--epochs", "2", "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "grouped by case_id" in out and f"{len(slides) - 1} of {len(slides)} samples" in out, out


def test_patient_embeddings_labelled_by_the_slide_table(store: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The lab's slide-level clinical table (a patient's row once per slide) labels the patient
    embeddings through --id-column case_id: the repeated rows agree, so each patient is one row."""
    code = main(["probe", store, "--dataset", "cohort", "--encoder", "patients", "--train", "all", "--folds", "3",
                 "--labels", _clinical(tmp_path), "--label-column", "subtype", "--id-column", "case_id",
                 "--seeds", "1", "--epochs", "2", "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    cases = len({c for _, c, _, _ in _cohort()})
    assert code == 0 and f"{cases} of {cases} samples of cohort/patients/all labelled (A=15, B=15)" in out, out


def test_the_report_names_an_eval_split_stored_in_another_dtype(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """A training split kept as float32 and an eval split imported as int8 under one encoder name:
    the report's setup line names both dtypes, not the training split's alone."""
    store = featurestore.open_store(str(tmp_path / "store"), mode="a")
    rng = np.random.default_rng(0)
    for split, dtype, n in (("train", "float32", 40), ("val", "int8", 20)):
        labels = np.arange(n) % 2
        values = rng.normal(0, 1, (n, DIM)).astype(np.float32) + labels[:, None]
        w = store.create_split("cohort", "enc", split, num_samples=n, sample_shape=(DIM,), dtype=dtype,
                               label_shape=(), label_dtype="int64")
        w.write(0, values, labels.astype(np.int64))
        w.commit()
    code = main(["probe", str(tmp_path / "store"), "--dataset", "cohort", "--encoder", "enc", "--train", "train",
                 "--eval", "val", "--seeds", "1", "--epochs", "2", "--device", "cpu", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0 and "cohort/enc stored as float32 (the eval split as int8), features [16]" in out, out
