"""``featurestore probe --compare`` between an int8 split and its float32 twin: the seg and linear
probes on dense splits and the ABMIL head on bag splits, on tiny data. The int8 side trains on the
dequantized values (codes times their scales, as the loaders read them), so both sides learn and
land close; the in-RAM and the streaming loader train the same head."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from _probe_fixtures import DATASET, GRID, LIN_CLASSES, linear_data, seg_data, write

import featurestore
from featurestore.cli import main
from featurestore.demo.synthetic_bags import write_bag_splits
from featurestore.probes.run import compare_probes


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def dense_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("probe-int8") / "store")
    store = featurestore.open_store(path, mode="a")
    seg_layout = {"token_layout": {"prefix_tokens": 0, "grid": list(GRID)}}
    for split, n, seed in (("train", 64, 0), ("val", 32, 1)):
        features, masks = seg_data(n, seed)
        for encoder, dtype in (("seg8", "int8"), ("seg32", "float32")):
            write(store, encoder, split, features, masks, dtype, seg_layout)
        features, labels = linear_data(2 * n, seed)
        for encoder, dtype in (("lin8", "int8"), ("lin32", "float32")):
            write(store, encoder, split, features, labels, dtype)
    return path


def test_seg_probe_compares_int8_with_float32(dense_store: str) -> None:
    result = compare_probes(dense_store, DATASET, "seg8", "seg32", train_split="train", eval_split="val",
                            seeds=2, epochs=3, device="cpu")
    assert (result["a"]["dtype"], result["b"]["dtype"]) == ("int8", "float32")
    for side in ("a", "b"):
        assert result[side]["metrics"]["jaccard"]["mean"] > 0.5
    assert abs(result["comparison"]["jaccard"]["diff"]) < 0.05


@pytest.mark.parametrize("loader", ["stream", "ram"])
def test_cli_linear_probe_compares_int8_with_float32(dense_store: str, tmp_path: Path, loader: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    code = main(["probe", dense_store, "--dataset", DATASET, "--encoder", "lin8", "--compare", "lin32",
                 "--train", "train", "--eval", "val", "--seeds", "2", "--epochs", "5", "--batch-size", "32",
                 "--device", "cpu", "--loader", loader, "--quiet", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "stored as int8" in printed and "stored as float32" in printed
    saved = json.loads(out.read_text())
    assert saved["a"]["task"] == "linear" and saved["a"]["num_classes"] == LIN_CLASSES
    for side in ("a", "b"):
        assert saved[side]["metrics"]["macro_f1"]["mean"] > 0.9
    assert abs(saved["comparison"]["macro_f1"]["diff"]) < 0.05


@pytest.mark.filterwarnings("ignore:.*at chance")
def test_cli_abmil_compares_int8_bags_with_float32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "store")
    write_bag_splits(root, "cohort", {"int8": "abmil-i8", "float32": "abmil-f32"},
                     {"train": {"num": 24, "seed": 0, "min_patches": 10, "max_patches": 60},
                      "val": {"num": 12, "seed": 1, "min_patches": 10, "max_patches": 60}},
                     dim=16, chunk_bytes=64 * 16 * 4)
    out = tmp_path / "result.json"
    code = main(["probe", root, "--head", "abmil", "--dataset", "cohort", "--encoder", "abmil-i8",
                 "--compare", "abmil-f32", "--train", "train", "--eval", "val", "--seeds", "2", "--epochs", "2",
                 "--device", "cpu", "--quiet", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "abmil-i8 stored as int8" in printed and "abmil-f32 stored as float32" in printed
    saved = json.loads(out.read_text())
    assert (saved["a"]["dtype"], saved["b"]["dtype"]) == ("int8", "float32")
    assert set(saved["comparison"]) == {"auc", "balanced_accuracy"}
    for metric in ("auc", "balanced_accuracy"):
        assert abs(saved["comparison"][metric]["diff"]) <= 0.1


@pytest.mark.filterwarnings("ignore:.*at chance")
def test_over_http_an_int8_split_is_reported_as_stored(dense_store: str, tmp_path: Path) -> None:
    """A server hands an int8 split's float32 values to the datasets (ds.dtype float32); the
    probe's report names the dtype the split is stored in, as on the store (ds.stored_dtype)."""
    from client import BagDataset, FeatureDataset
    from featurestore.probes.mil_run import compare_mil_probes
    from featurestore.testing.serving import serve_subprocess

    root = str(tmp_path / "bags")
    write_bag_splits(root, "cohort", {"int8": "i8", "float32": "f32"},
                     {"train": {"num": 12, "seed": 0, "min_patches": 5, "max_patches": 20}}, dim=16)
    with serve_subprocess(dense_store) as (dense_url, _), serve_subprocess(root) as (bags_url, _):
        ds, bags = FeatureDataset(dense_url, DATASET, "lin8", "train"), BagDataset(bags_url, "cohort", "i8", "train")
        assert (ds.dtype, ds.stored_dtype, bags.dtype, bags.stored_dtype) == ("float32", "int8", "float32", "int8")
        dense = compare_probes(dense_url, DATASET, "lin8", "lin32", train_split="train", eval_split="val", seeds=1,
                               epochs=1, device="cpu")
        mil = compare_mil_probes(bags_url, "cohort", "i8", "f32", train_split="train", folds=2, seeds=1, epochs=1,
                                 device="cpu")
    for result in (dense, mil):
        assert (result["a"]["dtype"], result["b"]["dtype"]) == ("int8", "float32")
