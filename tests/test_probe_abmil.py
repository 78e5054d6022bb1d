"""The ABMIL reference probe: parity store vs RAM, determinism, folds, --compare, errors, AUC."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _probe_fixtures import one_torch_thread  # noqa: F401  (autouse: one torch thread per test)

from featurestore.cli import main
from featurestore.demo.synthetic_bags import write_bag_splits
from featurestore.errors import InvalidOption, MissingLabels
from featurestore.probes.abmil import GatedABMIL, roc_auc
from featurestore.probes.mil_run import compare_mil_probes, run_mil_probe, stratified_folds

DIM = 16
ENCODERS = {"float32": "abmil-f32", "float16": "abmil-f16"}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("abmil") / "store")
    write_bag_splits(root, "cohort", ENCODERS, {"train": {"num": 32, "seed": 0, "min_patches": 10, "max_patches": 80},
                                                "val": {"num": 16, "seed": 1, "min_patches": 10, "max_patches": 80,
                                                        "empty": 1}},
                     dim=DIM, chunk_bytes=64 * DIM * 4)
    import featurestore

    store = featurestore.open_store(root, mode="a")
    writer = store.create_bag_split("cohort", "nolabels", "train", dim=DIM)
    writer.add_bag("a", np.zeros((3, DIM), np.float32))
    writer.commit()
    classes = {"label_info": {"classes": ["negative", "positive"]}}
    # Every slide labelled 1 (the metadata still names 2 classes), and an eval split of label 0 only.
    for encoder, split, labels in (("onelabel", "train", [1] * 8), (ENCODERS["float32"], "val0", [0] * 6),
                                   (ENCODERS["float16"], "val0", [0] * 6)):
        writer = store.create_bag_split("cohort", encoder, split, dim=DIM, label_dtype="int64", metadata=classes)
        for i, label in enumerate(labels):
            writer.add_bag(f"slide-{i:04d}", np.random.default_rng(i).standard_normal((5, DIM)).astype(np.float32),
                           label=label)
        writer.commit()
    # Features without any signal (every patch the same): the head can only predict a constant.
    for encoder, dtype in (("flat-f32", "float32"), ("flat-f16", "float16")):
        writer = store.create_bag_split("cohort", encoder, "train", dim=DIM, dtype=dtype, label_dtype="int64",
                                        metadata=classes)
        for i in range(12):
            writer.add_bag(f"slide-{i:04d}", np.ones((4, DIM), np.float32), label=i % 2)
        writer.commit()
    return root


@pytest.mark.filterwarnings("ignore:1 empty bag")  # the val split's empty slide, left out
@pytest.mark.parametrize(("batch_size", "max_patches"), [(1, None), (4, 24)])
def test_float32_store_equals_the_same_bags_in_ram(store: str, batch_size: int, max_patches: int | None) -> None:
    # Same seeds, same bag order, same patch subsets and padding: streaming from a float32 store
    # and training from the bags held in RAM give bit-identical metrics on the CPU.
    options = dict(train_split="train", eval_split="val", seeds=2, epochs=3, batch_size=batch_size,
                   max_patches=max_patches, device="cpu")
    stream = run_mil_probe(store, "cohort", ENCODERS["float32"], loader="stream", **options)
    ram = run_mil_probe(store, "cohort", ENCODERS["float32"], loader="ram", **options)
    assert stream["runs"] == ram["runs"]
    again = run_mil_probe(store, "cohort", ENCODERS["float32"], loader="stream", **options)
    assert again["runs"] == stream["runs"]  # deterministic on the CPU given the seed
    assert stream["eval_samples"] == 15 and stream["train_samples"] == 32  # val's empty slide left out


def test_the_probe_learns_and_folds_are_stratified(store: str) -> None:
    result = run_mil_probe(store, "cohort", ENCODERS["float16"], train_split="train", folds=4, seeds=[0, 1],
                           epochs=8, device="cpu")
    assert result["metrics"]["auc"]["mean"] > 0.8, result["metrics"]
    assert result["eval_split"] == "4 folds" and result["train_samples"] + result["eval_samples"] == 32
    labels = np.arange(32) % 2
    folds = stratified_folds(labels, 4)
    assert sorted(np.concatenate(folds).tolist()) == list(range(32))
    assert all(sorted(np.bincount(labels[f]).tolist()) == [4, 4] for f in folds)
    assert all(np.array_equal(a, b) for a, b in zip(folds, stratified_folds(labels, 4)))


@pytest.mark.filterwarnings("ignore:1 empty bag")
def test_compare_float16_with_float32(store: str) -> None:
    result = compare_mil_probes(store, "cohort", ENCODERS["float16"], ENCODERS["float32"], train_split="train",
                                eval_split="val", seeds=2, epochs=3, device="cpu")
    assert {result["a"]["dtype"], result["b"]["dtype"]} == {"float16", "float32"}
    for metric in ("auc", "balanced_accuracy"):
        c = result["comparison"][metric]
        assert c["exceeds_spread"] in (True, False) and len(c["paired_diffs"]) == 2


def test_cli_head_abmil_compare(store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", ENCODERS["float16"],
                 "--compare", ENCODERS["float32"], "--train", "train", "--folds", "3", "--seeds", "2",
                 "--epochs", "2", "--device", "cpu", "--quiet", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "abmil probe (slide AUC, balanced accuracy)" in printed and "exceeds spread?" in printed
    assert "bags" in printed
    saved = json.loads(out.read_text())
    assert saved["a"]["folds"] == 3 and set(saved["comparison"]) == {"auc", "balanced_accuracy"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--encoder", "nolabels", "--folds", "2"], "has no labels"),
    (["--encoder", ENCODERS["float32"]], "either an eval split"),
    (["--encoder", ENCODERS["float32"], "--eval", "val", "--folds", "2"], "either an eval split"),
    (["--encoder", ENCODERS["float32"], "--folds", "99"], "folds must be"),
    (["--encoder", ENCODERS["float32"], "--eval", "nope"], "nope"),
    (["--encoder", ENCODERS["float32"], "--eval", "val", "--compare", ENCODERS["float16"], "--save-attention", "a"],
     "--save-attention and --save-predictions keep one run's outputs"),
    (["--encoder", ENCODERS["float32"], "--eval", "val", "--save-attention", "../a"], "'../a'"),
])
def test_cli_errors_are_one_line(store: str, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--train", "train", "--quiet",
                 "--epochs", "1", "--seeds", "1", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_split_of_the_other_kind_names_the_head_it_takes(store: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import featurestore

    common = ["--folds", "2", "--quiet", "--epochs", "1", "--seeds", "1", "--device", "cpu"]
    code = main(["probe", store, "--dataset", "cohort", "--encoder", ENCODERS["float32"], "--train", "train", *common])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.endswith("is a bag split, not a dense split: probe a bag split with --head abmil, or its slide "
                        "embeddings (featurestore embed) with --head linear"), err
    writer = featurestore.open_store(str(tmp_path), mode="a").create_split(
        "ds", "enc", "train", num_samples=4, sample_shape=(DIM,), dtype="float32", label_dtype="int64")
    writer.write(0, np.zeros((4, DIM), np.float32), np.array([0, 1, 0, 1]))
    writer.commit()
    code = main(["probe", str(tmp_path), "--head", "abmil", "--dataset", "ds", "--encoder", "enc", "--train", "train",
                 *common])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.endswith("is a dense split, not a bag split: --head abmil trains on bag splits; a dense split takes "
                        "--head linear (or seg)"), err


@pytest.mark.filterwarnings("ignore:1 empty bag")
def test_cli_save_attention(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    import featurestore
    from featurestore.core.bag_attention import open_attention

    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", ENCODERS["float16"],
                 "--train", "train", "--eval", "val", "--batch-size", "4", "--seeds", "1", "--epochs", "1",
                 "--device", "cpu", "--quiet", "--save-attention", "cli-map"])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"attention map 'cli-map' (seed 0, 15 bags) saved in cohort/{ENCODERS['float16']}/val/attention/cli-map" in printed
    s = featurestore.open_store(store)
    bags = s.open_bags("cohort", ENCODERS["float16"], "val")
    amap = open_attention(s.storage, bags.key, "cli-map", bags.metadata)
    assert amap.stale is None and amap.lineage["probe"]["batch_size"] == 4
    assert (amap.fold >= 0).sum() == 15 and abs(float(amap.bag(0, bags.offsets).sum()) - 1) < 1e-5
    code = main(["probe", store, "--head", "linear", "--dataset", "cohort", "--encoder", ENCODERS["float16"],
                 "--train", "train", "--eval", "val", "--save-attention", "x"])
    assert code == 1 and "apply to --head abmil only" in capsys.readouterr().err


def test_dense_flags_refused_with_dense_heads(store: str) -> None:
    with pytest.raises(InvalidOption):
        run_mil_probe(store, "cohort", ENCODERS["float32"], train_split="train", seeds=1, device="cpu")
    with pytest.raises(MissingLabels):
        run_mil_probe(store, "cohort", "nolabels", train_split="train", folds=2, seeds=1, device="cpu")


def test_roc_auc_matches_the_definition() -> None:
    assert roc_auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == 0.75
    assert roc_auc(np.array([0.5, 0.5, 0.5, 0.5]), np.array([0, 1, 0, 1])) == 0.5  # ties count half
    assert roc_auc(np.array([1.0, 2.0]), np.array([1, 1])) != roc_auc(np.array([1.0, 2.0]), np.array([1, 1]))  # NaN


def test_padding_does_not_change_a_bag_result() -> None:
    torch.manual_seed(0)
    model = GatedABMIL(DIM, 2)
    bag = torch.randn(1, 7, DIM)
    padded = torch.cat([bag, torch.randn(1, 5, DIM)], dim=1)
    mask = torch.tensor([[True] * 7 + [False] * 5])
    with torch.no_grad():
        alone, attention = model(bag)
    with torch.no_grad():
        with_pad, padded_attention = model(padded, mask)
    assert torch.allclose(alone, with_pad, atol=1e-6)
    assert float(padded_attention[0, 7:].sum()) == 0.0 and torch.allclose(padded_attention[0, :7], attention[0])


@pytest.mark.filterwarnings("ignore:1 empty bag")
def test_over_http_the_probe_trains_the_same_head(store: str) -> None:
    from featurestore.testing.serving import serve_subprocess

    options = dict(train_split="train", eval_split="val", seeds=[0], epochs=2, batch_size=2, max_patches=30,
                   device="cpu")
    local = run_mil_probe(store, "cohort", ENCODERS["float16"], **options)
    with serve_subprocess(store) as (url, _):
        remote = run_mil_probe(url, "cohort", ENCODERS["float16"], **options)
    assert remote["runs"] == local["runs"] and remote["source"] == url


# ------------------------------------------------------------------------- one class, chance


@pytest.mark.parametrize(("argv", "message"), [
    # the classes by the names the splits record (label_info)
    (["--encoder", "onelabel", "--folds", "2"], "cohort/onelabel/train holds only label 'positive' (1) (8 of them)"),
    (["--encoder", ENCODERS["float32"], "--eval", "val0"], "holds only label 'negative' (0) (6 of them)"),
    (["--encoder", ENCODERS["float32"], "--eval", "val0", "--compare", ENCODERS["float16"]], "only label 'negative'"),
])
def test_one_class_is_refused_not_reported_as_nan(store: str, argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["probe", store, "--head", "abmil", "--dataset", "cohort", "--train", "train", "--quiet",
                 "--epochs", "1", "--seeds", "1", "--device", "cpu", *argv])
    captured = capsys.readouterr()
    assert code == 1 and "nan" not in captured.out
    assert message in captured.err and "AUC is undefined for one" in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_a_fold_without_a_class_is_refused() -> None:
    from featurestore.errors import InvalidLabels
    from featurestore.probes.mil_run import fold_parts

    with pytest.raises(InvalidLabels, match="fold"):
        fold_parts(np.array([0, 0, 0, 0, 1]), np.arange(5), 3, "cohort/e/train")


def test_a_probe_at_chance_is_flagged_and_a_learned_one_is_not(store: str) -> None:
    flat = run_mil_probe(store, "cohort", "flat-f32", train_split="train", folds=2, seeds=2, epochs=1, device="cpu")
    assert flat["metrics"]["auc"]["mean"] == 0.5  # one score for every slide: ties
    assert flat["chance"]["auc"] == {"baseline": 0.5, "what": "best constant prediction", "at_chance": True}
    assert flat["chance"]["balanced_accuracy"]["baseline"] == 0.5 and flat["chance"]["balanced_accuracy"]["at_chance"]
    learned = run_mil_probe(store, "cohort", ENCODERS["float16"], train_split="train", folds=4, seeds=[0, 1],
                            epochs=8, device="cpu")
    assert not learned["chance"]["auc"]["at_chance"]


def test_cli_says_when_abmil_is_at_chance_and_compare_is_uninformative(store: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["probe", store, "--head", "abmil", "--dataset", "cohort", "--train", "train", "--folds", "2",
            "--seeds", "2", "--epochs", "1", "--device", "cpu", "--quiet"]
    assert main([*base, "--encoder", "flat-f32"]) == 0
    single = capsys.readouterr().out
    assert "WARNING: AT CHANCE" in single and "chance 0.5000" in single
    assert main([*base, "--encoder", "flat-f16", "--compare", "flat-f32"]) == 0
    compared = capsys.readouterr().out
    assert "uninformative" in compared and "WARNING: AT CHANCE" in compared
    assert "The comparison is uninformative" in compared.replace("\n", " ")


def test_an_empty_bag_is_left_out_before_the_folds_and_said_so(store: str) -> None:
    """A slide without patches is no bag the probe can score: left out up front, named in the
    report's notes and not counted among the evaluated bags (before, each epoch's loader warned
    about it, naming a Python-only skip_empty, and the report counted it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*empty bag")
        result = run_mil_probe(store, "cohort", ENCODERS["float32"], train_split="train", eval_split="val", seeds=1,
                               epochs=1, device="cpu")
    assert result["eval_samples"] == 15, result["eval_samples"]  # 16 slides, one of them empty
    assert any("1 empty bag(s) of cohort/abmil-f32/val (no patches, e.g. " in note for note in result["label_notes"])


@pytest.mark.filterwarnings("ignore:1 empty bag")
def test_cli_save_predictions_is_the_table_behind_the_metric(store: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import csv

    import featurestore
    from featurestore.probes.auc import slide_auc

    common = ["probe", store, "--head", "abmil", "--dataset", "cohort", "--encoder", ENCODERS["float16"], "--train",
              "train", "--seeds", "2", "--epochs", "2", "--device", "cpu", "--quiet"]
    table, result = tmp_path / "preds.csv", tmp_path / "result.json"
    assert main([*common, "--eval", "val", "--save-predictions", str(table), "--json", str(result)]) == 0
    assert f"predictions: 30 rows (seed, fold, slide) in {table}" in capsys.readouterr().out
    rows = list(csv.DictReader(table.open(encoding="utf-8")))
    assert list(rows[0]) == ["seed", "fold", "slide_id", "label", "predicted", "prob_negative", "prob_positive"]
    val = featurestore.open_store(store).open_bags("cohort", ENCODERS["float16"], "val")
    names = ["negative", "positive"]
    kept = [i for i in range(len(val)) if val.lengths[i] > 0]  # the empty slide is not evaluated
    runs = json.loads(result.read_text())["runs"]
    for seed in (0, 1):
        mine = [r for r in rows if r["seed"] == str(seed)]
        assert [r["slide_id"] for r in mine] == [val.ids[i] for i in kept] and {r["fold"] for r in mine} == {"0"}
        assert [r["label"] for r in mine] == [names[int(val.labels[i])] for i in kept]
        prob = np.array([[float(r["prob_negative"]), float(r["prob_positive"])] for r in mine])
        assert np.allclose(prob.sum(1), 1, atol=1e-5)
        assert [r["predicted"] for r in mine] == [names[k] for k in prob.argmax(1)]
        target = np.array([names.index(r["label"]) for r in mine])
        assert slide_auc(prob, target, 2) == pytest.approx(runs[seed]["auc"], abs=1e-4)  # the metric it reports
    # --folds: each labelled slide once per seed, in the fold that held it out
    assert main([*common, "--folds", "3", "--save-predictions", str(table)]) == 0
    rows = list(csv.DictReader(table.open(encoding="utf-8")))
    train = featurestore.open_store(store).open_bags("cohort", ENCODERS["float16"], "train")
    for seed in ("0", "1"):
        assert sorted(r["slide_id"] for r in rows if r["seed"] == seed) == sorted(train.ids)
    assert {r["fold"] for r in rows} == {"0", "1", "2"}


@pytest.mark.parametrize(("argv", "message"), [
    (["--compare", ENCODERS["float32"], "--save-predictions", "p.csv"], "--save-predictions keep one run's outputs"),
    (["--save-predictions", "no/such/dir/p.csv"], "does not exist"),
])
def test_save_predictions_refusals_are_one_line(store: str, tmp_path: Path, argv: list[str], message: str,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    head = [] if "--head" in argv else ["--head", "abmil"]
    code = main(["probe", store, *head, "--dataset", "cohort", "--encoder", ENCODERS["float16"], "--train", "train",
                 "--eval", "val", "--seeds", "1", "--epochs", "1", "--device", "cpu", "--quiet", *argv])
    err = capsys.readouterr().err
    assert code == 1 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.csv").exists()


def test_save_predictions_with_group_by_names_each_slides_group_and_keeps_it_in_one_fold(tmp_path: Path) -> None:
    import csv

    import featurestore

    writer = featurestore.open_store(str(tmp_path / "store"), mode="a").create_bag_split(
        "cohort", "enc", "train", dim=DIM, label_dtype="int64")
    rng = np.random.default_rng(0)
    for i in range(16):  # 8 patients of 2 slides, one of each class, so every fold holds both classes
        writer.add_bag(f"slide-{i:02d}", rng.standard_normal((6, DIM)).astype(np.float32) + i % 2, label=i % 2,
                       attrs={"case_id": f"patient-{i // 2}"})
    writer.commit()
    table = tmp_path / "preds.csv"
    out = run_mil_probe(str(tmp_path / "store"), "cohort", "enc", train_split="train", folds=2, group_by="case_id",
                        seeds=1, epochs=1, device="cpu", save_predictions=str(table))
    assert out["predictions"] == {"path": str(table), "rows": 16, "id_column": "slide_id"}
    rows = list(csv.DictReader(table.open(encoding="utf-8")))
    assert list(rows[0]) == ["seed", "fold", "slide_id", "case_id", "label", "predicted", "prob_0", "prob_1"]
    assert all(r["case_id"] == f"patient-{int(r['slide_id'][-2:]) // 2}" for r in rows)
    folds = {}
    for r in rows:
        folds.setdefault(r["case_id"], set()).add(r["fold"])
    assert all(len(f) == 1 for f in folds.values())  # a patient's slides are held out together
