"""Attention maps: ``run_mil_probe(save_attention=...)`` keeps the trained head's attention per
patch of every evaluated bag in the store, with lineage; a map whose split changed is stale."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import featurestore
from featurestore.core.bag_attention import attention_names, open_attention
from featurestore.demo.synthetic_bags import synthetic_slides, write_bag_splits
from featurestore.cli import main
from featurestore.errors import (AttentionNotFound, InvalidName, InvalidOption, ShapeMismatch, SplitChanged,
                                 StaleAttention)
from featurestore.probes.mil_run import run_mil_probe, stratified_folds

sys.path.insert(0, os.path.dirname(__file__))
from _attention_fixtures import save_map  # noqa: E402
from _probe_fixtures import one_torch_thread  # noqa: E402, F401  (autouse: one torch thread per test)

DIM = 16
VAL = {"num": 16, "seed": 1, "min_patches": 20, "max_patches": 80, "empty": 1}
TRAIN = {"num": 32, "seed": 0, "min_patches": 20, "max_patches": 80}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("attention") / "store")
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"train": TRAIN, "val": VAL}, dim=DIM,
                     chunk_bytes=64 * DIM * 4)
    return root


def _map(store: str, split: str, name: str) -> tuple[object, object]:
    s = featurestore.open_store(store)
    bags = s.open_bags("cohort", "f32", split)
    return bags, open_attention(s.storage, bags.key, name, bags.metadata)


@pytest.mark.filterwarnings("ignore:1 empty bag")
def test_attention_of_the_eval_split_per_patch_with_lineage(store: str) -> None:
    result = run_mil_probe(store, "cohort", "f32", train_split="train", eval_split="val", seeds=2, epochs=8,
                           device="cpu", save_attention="abmil-val")
    assert result["attention"] == {"name": "abmil-val", "key": "cohort/f32/val/attention/abmil-val", "bags": 15,
                                   "patches": int(result["attention"]["patches"]), "seed": 0}
    bags, amap = _map(store, "val", "abmil-val")
    assert amap.stale is None and attention_names(featurestore.open_store(store).storage, bags.key) == ["abmil-val"]
    assert amap.fold.tolist() == [0] * 15 + [-1]  # the empty slide is never evaluated
    assert result["attention"]["patches"] == int(bags.lengths.sum())
    # lineage: the split as it was, and the run
    lineage = amap.lineage
    assert lineage["split"] == {"key": "cohort/f32/val", "generation": bags.metadata["generation"],
                                "completed": bags.metadata["completed"], "num_bags": 16,
                                "num_rows": int(bags.lengths.sum())}
    probe = lineage["probe"]
    assert (probe["head"], probe["seed"], probe["seeds"], probe["train_split"], probe["eval_split"]) == \
        ("abmil", 0, [0, 1], "train", "val")
    assert probe["config"]["epochs"] == 8 and probe["metrics"] == result["runs"][0] and lineage["created"]
    assert probe["labels"] is None  # the split's stored labels were the task
    # one softmax per bag, aligned with the bag's patches: the tumour patches of positive slides
    # (shifted along the cohort's direction) draw the attention, where the model looked
    direction = np.random.default_rng(DIM).standard_normal(DIM).astype(np.float32)
    slides = {bag_id: (f, label) for bag_id, f, _, label in synthetic_slides(dim=DIM, **VAL)}
    ratios = []
    for i, bag_id in enumerate(bags.ids[:-1]):
        weights = amap.bag(i, bags.offsets)
        assert weights.dtype == np.float32 and len(weights) == bags.lengths[i]
        assert (weights > 0).all() and abs(float(weights.sum()) - 1) < 1e-5
        features, label = slides[bag_id]
        np.testing.assert_array_equal(bags.read_numpy(i)[0], features)
        if label == 1:
            score = features @ direction
            tumour = score >= np.sort(score)[-max(1, round(0.15 * len(score)))]
            ratios.append(weights[tumour].mean() / weights[~tumour].mean())
    assert np.median(ratios) > 2, ratios
    assert amap.bag(15, bags.offsets) is None


def test_folds_evaluate_every_bag_once(store: str) -> None:
    result = run_mil_probe(store, "cohort", "f32", train_split="train", folds=3, seeds=[5, 6], epochs=1,
                           device="cpu", loader="ram", save_attention="cv")
    bags, amap = _map(store, "train", "cv")
    assert result["attention"]["seed"] == 5 and amap.lineage["probe"]["fold_seed"] is not None
    expected = np.full(len(bags), -1)
    for k, members in enumerate(stratified_folds(bags.labels, 3)):
        expected[members] = k
    assert amap.fold.tolist() == expected.tolist()
    for i in range(len(bags)):
        assert abs(float(amap.bag(i, bags.offsets).sum()) - 1) < 1e-5
    # saving again under the same name replaces the map
    run_mil_probe(store, "cohort", "f32", train_split="train", folds=3, seeds=1, epochs=1, device="cpu",
                  loader="ram", save_attention="cv")
    assert _map(store, "train", "cv")[1].lineage["probe"]["seed"] == 0


def test_a_map_of_another_generation_is_stale(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"val": dict(VAL, num=4, empty=0)}, dim=DIM)
    save_map(root, "cohort", "f32", "val", "att", lambda i, coords: np.full(len(coords), 1.0 / len(coords)))
    s = featurestore.open_store(root)
    key = "cohort/f32/val"
    bags = s.open_bags("cohort", "f32", "val")
    assert open_attention(s.storage, key, "att", bags.metadata).stale is None
    kept = tmp_path / "kept"
    shutil.copytree(Path(root) / key / "attention", kept)
    # overwritten (a new generation), then the old map copied back (a restored backup, a sync)
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"val": dict(VAL, num=4, empty=0)}, dim=DIM)
    assert not (Path(root) / key / "attention").exists()  # an overwrite takes its maps with it
    shutil.copytree(kept, Path(root) / key / "attention")
    bags = s.open_bags("cohort", "f32", "val")
    amap = open_attention(s.storage, key, "att", bags.metadata)
    assert amap.stale is not None and f"now generation {bags.metadata['generation']}" in amap.stale
    with pytest.raises(StaleAttention, match="stale: saved for generation .*--save-attention att"):
        amap.bag(0, bags.offsets)
    with pytest.raises(StaleAttention):
        _ = amap.fold
    with pytest.raises(AttentionNotFound, match="has no attention map 'nope' \\(it has: att\\)"):
        open_attention(s.storage, key, "nope", bags.metadata)
    # the store's own check does not count the maps as damage
    assert main(["verify", root]) == 0


def test_a_split_overwritten_during_the_probe_gets_no_map(tmp_path: Path) -> None:
    from client import BagDataset
    from featurestore.probes.attention import AttentionRecorder

    root = str(tmp_path / "store")
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"val": dict(VAL, num=2, empty=0)}, dim=DIM)
    recorder = AttentionRecorder("att", BagDataset(root, "cohort", "f32", "val"), source=root)
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"val": dict(VAL, num=2, empty=0)}, dim=DIM)
    with pytest.raises(SplitChanged, match="changed while the probe ran .* not saved"):
        recorder.save({})
    assert not (Path(root) / "cohort/f32/val/attention").exists()


def test_recorder_refusals(store: str) -> None:
    from client import BagDataset
    from featurestore.probes.attention import AttentionRecorder

    ds = BagDataset(store, "cohort", "f32", "val")
    with pytest.raises(InvalidName):
        AttentionRecorder("../x", ds, source=store)
    with pytest.raises(InvalidOption, match="writes into the store"):
        AttentionRecorder("att", ds, source="http://127.0.0.1:9/")
    recorder = AttentionRecorder("att", ds, source=store)
    sink = recorder.sink(0, 0, None)
    n = int(ds.lengths[0])
    with pytest.raises(ShapeMismatch, match=f"batch of {n - 1} patches does not match the next evaluated bag"):
        sink(torch.ones(1, n - 1), torch.ones(1, n - 1, dtype=torch.bool))
    assert recorder.sink(1, 0, None) is None  # only the first seed's attention is kept


def test_export_a_map_as_clam_blockmaps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``export --attention NAME``: one CLAM-style ``<slide>_blockmap.h5`` per evaluated slide, its
    scores and coordinates in the bag's patch order; refused when stale, and with --format too."""
    import h5py

    root, out = str(tmp_path / "store"), tmp_path / "out"
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"val": dict(VAL, num=5, empty=1)}, dim=DIM)

    def weights(i: int, coords: np.ndarray) -> np.ndarray:  # a different, known value per patch
        w = np.arange(1, len(coords) + 1, dtype=np.float64) * (i + 1)
        return w / w.sum()

    save_map(root, "cohort", "f32", "val", "grade", weights)
    args = ["export", root, "--dataset", "cohort", "--encoder", "f32", "--split", "val", "--out", str(out),
            "--no-progress"]
    assert main([*args, "--attention", "grade"]) == 0
    assert "exported attention map 'grade' of cohort/f32/val: 4 slides, 4 files" in capsys.readouterr().out
    bags = featurestore.open_store(root).open_bags("cohort", "f32", "val")
    empty = [bag_id for bag_id, n in zip(bags.ids, bags.lengths) if n == 0]
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{b}_blockmap.h5" for b in bags.ids if b not in empty)
    for i, bag_id in enumerate(bags.ids):
        if bag_id in empty:
            continue
        with h5py.File(out / f"{bag_id}_blockmap.h5", "r") as f:
            scores, coords = f["attention_scores"][:], f["coords"][:]
            assert f.attrs["attention_map"] == "grade" and f.attrs["slide_id"] == bag_id and f.attrs["fold"] == 0
        expected_coords = bags.read_numpy(i)[1]
        assert scores.shape == (len(expected_coords), 1) and scores.dtype == np.float32
        np.testing.assert_allclose(scores[:, 0], weights(i, expected_coords), rtol=1e-6)
        np.testing.assert_array_equal(coords, expected_coords)
    assert main([*args, "--attention", "grade"]) == 1  # the files are there: --overwrite replaces them
    assert "already holds 4 of the files" in capsys.readouterr().err
    for extra, message in ((["--attention", "grade", "--format", "trident"], "one of the two"), ([], "one of the two"),
                           (["--attention", "nope", "--overwrite"], "has no attention map 'nope' (it has: grade)")):
        assert main([*args, *extra]) == 1
        assert message in capsys.readouterr().err
    split_dir = Path(root) / "cohort" / "f32" / "val"
    shutil.copytree(split_dir / "attention", tmp_path / "kept")
    write_bag_splits(root, "cohort", {"float32": "f32"}, {"val": dict(VAL, num=5, empty=1)}, dim=DIM)
    shutil.copytree(tmp_path / "kept", split_dir / "attention")  # the old map back over a new generation
    assert main([*args, "--attention", "grade", "--overwrite"]) == 1
    assert "attention map cohort/f32/val/attention/grade is stale" in capsys.readouterr().err
