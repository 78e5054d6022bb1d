"""``featurestore export`` (a bag split as TRIDENT / CLAM / STAMP per-slide files) and ``featurestore rm``.

The round trips: per-slide files -> import -> export -> import again gives the same bag ids,
features, coordinates, attributes and labels, byte for byte."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch

from test_embed import BAGS, PATCH
from test_embed import DIM as EMBED_DIM
from test_embed import bag_coords as embed_coords
from test_embed import bag_features as embed_bag
from test_embed import cli as embed_cli
from test_embed import run_embed as embed_split

from featurestore import open_store
from featurestore.cli import main

DIM = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slide_files(root: Path, lengths: dict[str, int], *, dtype: Any, coords_dtype: Any, attrs: dict[str, Any],
                suffix: str = ".h5", seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for slide, n in lengths.items():
        features = rng.standard_normal((n, DIM)).astype(dtype)
        coords = (rng.integers(0, 5_000, (n, 2)) * 16).astype(coords_dtype)
        with h5py.File(root / f"{slide}{suffix}", "w") as f:
            f.create_dataset("features", data=features)
            f.create_dataset("coords", data=coords).attrs.update({**attrs, "name": slide})
            f["features"].attrs["encoder"] = "uni_v1"
            f.attrs["magnification"] = 40.0
        out[slide] = (features, coords)
    return out


def cli(*argv: str) -> int:
    return main([*argv])


def import_dir(source: Path, store: Path, split: str, *extra: str) -> None:
    assert cli("import", str(source), "--store", str(store), "--dataset", "ds", "--encoder-name", "enc",
               "--split", split, "--no-progress", *extra) == 0


def export(store: Path, split: str, fmt: str, out: Path, *extra: str) -> int:
    return cli("export", str(store), "--dataset", "ds", "--encoder", "enc", "--split", split, "--format", fmt,
               "--out", str(out), "--no-progress", *extra)


def assert_same_bags(store: Path, a: str, b: str) -> None:
    s = open_store(str(store))
    first, second = s.open_bags("ds", "enc", a), s.open_bags("ds", "enc", b)
    assert first.ids == second.ids and first.dtype == second.dtype
    assert first.coords_unit == second.coords_unit and first.patch_size_level0 == second.patch_size_level0
    assert np.array_equal(first.lengths, second.lengths)
    for i in range(len(first)):
        (f1, c1), (f2, c2) = first.read_numpy(i), second.read_numpy(i)
        assert f1.dtype == f2.dtype and f1.tobytes() == f2.tobytes()
        assert c1.dtype == c2.dtype and c1.tobytes() == c2.tobytes()
        assert first.attrs(i) == second.attrs(i)
    assert (first.labels is None) == (second.labels is None)
    if first.labels is not None:
        assert first.labels.dtype == second.labels.dtype and first.labels.tobytes() == second.labels.tobytes()
    assert first.metadata.get("label_names") == second.metadata.get("label_names")


def test_trident_round_trip_is_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = slide_files(tmp_path / "features_uni", {"TCGA-02": 40, "TCGA-01": 7, "empty-slide": 0, "TCGA-10": 130},
                       dtype=np.float16, coords_dtype=np.int64,
                       attrs={"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40,
                              "target_magnification": 20, "overlap": 0})  # fmt: skip
    # The clinical table's other columns (kept as bag attributes) go out in labels.csv and come back:
    # a number, an empty cell (null), a code that keeps its zero.
    (tmp_path / "labels.csv").write_text("slide_id,label,case_id,age,site\nTCGA-01.svs,LUAD,P1,61,05\n"
                                         "TCGA-02,LUSC,P1,61.5,05\nTCGA-10,LUAD,P2,,A2\nempty-slide,LUSC,P3,70,A2\n")
    store = tmp_path / "store"
    import_dir(tmp_path / "features_uni", store, "a", "--labels", str(tmp_path / "labels.csv"), "--chunk-mb", "0.001")
    assert export(store, "a", "trident", tmp_path / "out") == 0
    assert "exported ds/enc/a: 4 bags as trident, 5 files" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "out")) == ["TCGA-01.h5", "TCGA-02.h5", "TCGA-10.h5", "empty-slide.h5",
                                                    "labels.csv"]  # fmt: skip
    with h5py.File(tmp_path / "out" / "TCGA-02.h5") as f:  # TRIDENT's layout
        assert f["features"].dtype == np.float16 and f["coords"].dtype == np.int64
        np.testing.assert_array_equal(f["features"][:], data["TCGA-02"][0])
        np.testing.assert_array_equal(f["coords"][:], data["TCGA-02"][1])
        assert f["coords"].attrs["patch_size_level0"] == 512 and f["coords"].attrs["name"] == "TCGA-02"
        assert f["features"].attrs["encoder"] == "uni_v1"
    with h5py.File(tmp_path / "out" / "empty-slide.h5") as f:
        assert f["features"].shape == (0, DIM) and f["coords"].shape == (0, 2)
    assert (tmp_path / "out" / "labels.csv").read_text().splitlines()[:3] == [
        "slide_id,label,case_id,age,site", "TCGA-01,LUAD,P1,61,05", "TCGA-02,LUSC,P1,61.5,05"]
    import_dir(tmp_path / "out", store, "b", "--labels", str(tmp_path / "out" / "labels.csv"), "--chunk-mb", "0.001")
    assert_same_bags(store, "a", "b")
    bags = open_store(str(store)).open_bags("ds", "enc", "b")
    assert bags.attrs(bags.position("TCGA-10"))["case_id"] == "P2" and bags.attrs(bags.position("TCGA-10"))["age"] is None
    # a second export into the same directory is refused, nothing rewritten; --overwrite replaces
    before = (tmp_path / "out" / "TCGA-02.h5").stat().st_mtime_ns
    assert export(store, "a", "trident", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "already holds 5 of the files" in err and "--overwrite" in err
    assert (tmp_path / "out" / "TCGA-02.h5").stat().st_mtime_ns == before
    assert export(store, "a", "trident", tmp_path / "out", "--overwrite") == 0
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith(".")]  # no temporary file left


def test_clam_round_trip_is_bit_exact(tmp_path: Path) -> None:
    job = tmp_path / "clam"
    data = slide_files(job / "h5_files", {"s1": 5, "s2": 8, "s3": 1}, dtype=np.float32, coords_dtype=np.int32,
                       attrs={"patch_size": 256, "patch_level": 0, "downsample": [1.0, 1.0],
                              "level_dim": [40000, 30000]})  # fmt: skip
    (job / "labels.csv").write_text("slide_id,label,case_id\ns1,0,P1\ns2,1,P1\ns3,1,P2\n")
    store = tmp_path / "store"
    import_dir(job, store, "a", "--dtype", "float32", "--labels", str(job / "labels.csv"))
    assert export(store, "a", "clam-pt", tmp_path / "out") == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["h5_files", "labels.csv", "pt_files"]
    for slide, (features, coords) in data.items():
        pt = torch.load(tmp_path / "out" / "pt_files" / f"{slide}.pt", weights_only=True)
        assert pt.dtype == torch.float32 and torch.equal(pt, torch.from_numpy(features))
        with h5py.File(tmp_path / "out" / "h5_files" / f"{slide}.h5") as f:
            assert f["coords"].dtype == np.int32 and f["features"].dtype == np.float32
            np.testing.assert_array_equal(f["coords"][:], coords)
            assert f["coords"].attrs["patch_level"] == 0 and list(f["coords"].attrs["level_dim"]) == [40000, 30000]
    import_dir(tmp_path / "out", store, "b", "--dtype", "float32", "--labels", str(tmp_path / "out" / "labels.csv"))
    assert_same_bags(store, "a", "b")
    # CLAM's pt_files alone (features only) make the same round trip
    import_dir(tmp_path / "out" / "pt_files", store, "pt", "--dtype", "float32")
    assert export(store, "pt", "clam-pt", tmp_path / "out-pt") == 0
    assert sorted(os.listdir(tmp_path / "out-pt")) == ["pt_files"]
    import_dir(tmp_path / "out-pt" / "pt_files", store, "pt2", "--dtype", "float32")
    assert_same_bags(store, "pt", "pt2")


def test_a_split_written_by_the_api_exports_as_trident_writes(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "store"), mode="a")
    w = store.create_bag_split("ds", "enc", "api", dim=DIM, dtype="bfloat16", patch_size_level0=448)
    feats = torch.randn(6, DIM).to(torch.bfloat16)
    w.add_bag("slide-1", feats, coords=np.arange(12).reshape(6, 2) * 448, attrs={"mpp": 0.25})
    w.commit()
    assert export(tmp_path / "store", "api", "trident", tmp_path / "out") == 0
    with h5py.File(tmp_path / "out" / "slide-1.h5") as f:
        # HDF5 has no bfloat16: float32 holds its values exactly
        assert f["features"].dtype == np.float32 and torch.equal(torch.from_numpy(f["features"][:]), feats.float())
        assert dict(f["coords"].attrs) == {"name": "slide-1", "patch_size_level0": 448}
        assert f.attrs["mpp"] == 0.25
    import_dir(tmp_path / "out", tmp_path / "store", "back", "--dtype", "bfloat16")
    back = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "back")
    assert back.read_numpy(0)[0].tobytes() == store.open_bags("ds", "enc", "api").read_numpy(0)[0].tobytes()


def test_stamp_round_trip_and_pixel_coords_converted_to_micrometres(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # STAMP's own files: feats float16, coords float32 micrometres, the unit on the root
    source = tmp_path / "stamp"
    source.mkdir()
    rng = np.random.default_rng(3)
    made = {}
    for slide, n in {"p1-a": 9, "p1-b": 3, "p2": 12}.items():
        made[slide] = rng.standard_normal((n, DIM)).astype(np.float16), (rng.random((n, 2)) * 1e4).astype(np.float32)
        with h5py.File(source / f"{slide}.h5", "w") as f:
            f["feats"], f["coords"] = made[slide]
            f.attrs.update({"unit": "um", "tile_size_um": 256.0, "tile_size_px": 224, "extractor": "ctranspath"})
    store = tmp_path / "store"
    import_dir(source, store, "s")
    assert export(store, "s", "stamp", tmp_path / "out") == 0
    with h5py.File(tmp_path / "out" / "p1-a.h5") as f:  # what STAMP's BagDataset reads
        assert sorted(f) == ["coords", "feats"] and f["feats"].dtype == np.float16 and f["coords"].dtype == np.float32
        np.testing.assert_array_equal(f["feats"][:], made["p1-a"][0])
        np.testing.assert_array_equal(f["coords"][:], made["p1-a"][1])
        # STAMP's own attributes, as they came (nothing added: the round trip is exact)
        assert dict(f.attrs) == {"unit": "um", "tile_size_um": 256.0, "tile_size_px": 224, "extractor": "ctranspath"}
    import_dir(tmp_path / "out", store, "s2")
    assert_same_bags(store, "s", "s2")

    # TRIDENT's level-0 pixels: converted with --mpp, the tile in micrometres, the encoder's side kept
    data = slide_files(tmp_path / "features_uni", {"t1": 5, "t2": 4}, dtype=np.float16, coords_dtype=np.int64,
                       attrs={"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40})
    import_dir(tmp_path / "features_uni", store, "t")
    capsys.readouterr()
    assert export(store, "t", "stamp", tmp_path / "out-t") == 1  # no mpp recorded, none given: nothing written
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "records no mpp" in err and "--mpp UM" in err, err
    assert not (tmp_path / "out-t").exists() or not os.listdir(tmp_path / "out-t")
    assert export(store, "t", "stamp", tmp_path / "out-t", "--mpp", "0.25") == 0
    with h5py.File(tmp_path / "out-t" / "t1.h5") as f:
        np.testing.assert_array_equal(f["coords"][:], (data["t1"][1] * 0.25).astype(np.float32))
        assert f.attrs["unit"] == "um" and f.attrs["tile_size_um"] == 128.0 and f.attrs["tile_size_px"] == 256
        assert f.attrs["extractor"] == "enc" and f.attrs["feat_type"] == "tile" and f.attrs["magnification"] == 40.0
        assert not dict(f["coords"].attrs)  # TRIDENT's pixel figures would read as micrometres
    import_dir(tmp_path / "out-t", store, "t-um")
    back = open_store(str(store)).open_bags("ds", "enc", "t-um")
    assert back.coords_unit == "um" and back.patch_size_level0 == 128.0

    # a split that records each slide's mpp (as slide extraction does) needs no --mpp
    w = open_store(str(store), mode="a").create_bag_split("ds", "enc", "api", dim=DIM, patch_size_level0=448)
    w.add_bag("slide-1", np.ones((2, DIM), np.float32), coords=np.array([[0, 448], [896, 0]]),
              attrs={"mpp": 0.5, "patch_size": 224})
    w.commit()
    assert export(store, "api", "stamp", tmp_path / "out-api") == 0
    with h5py.File(tmp_path / "out-api" / "slide-1.h5") as f:
        assert f["coords"][:].tolist() == [[0.0, 224.0], [448.0, 0.0]]
        assert f.attrs["tile_size_um"] == 224.0 and f.attrs["tile_size_px"] == 224 and f.attrs["mpp"] == 0.5
    assert export(store, "api", "trident", tmp_path / "out-x", "--mpp", "0.5") == 1  # --mpp is stamp's alone
    assert "for --format stamp only" in capsys.readouterr().err


def test_slides_of_two_magnifications_export_each_with_its_own_patch_size(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Slide extraction records each slide's level-0 patch side as a bag attribute (a 40x slide's is
    twice a 20x slide's), none for the split: each bag's file carries its own."""
    store = tmp_path / "store"
    w = open_store(str(store), mode="a").create_bag_split("ds", "enc", "wsi", dim=DIM, coords_unit="px")
    for bag_id, size, mpp in (("s40x", 512, 0.25), ("s20x", 256, 0.5)):
        w.add_bag(bag_id, np.ones((2, DIM), np.float32), coords=np.array([[0, size], [size, 0]]),
                  attrs={"mpp": mpp, "patch_size": 256, "patch_size_level0": size})
    w.commit()
    assert open_store(str(store)).open_bags("ds", "enc", "wsi").patch_size_level0 is None
    capsys.readouterr()
    assert cli("info", str(store), "ds", "enc", "wsi") == 0
    assert "coords: px (int64), patch size at level 0 per slide: 256 (1), 512 (1)" in capsys.readouterr().out
    assert export(store, "wsi", "stamp", tmp_path / "stamp") == 0
    assert export(store, "wsi", "trident", tmp_path / "trident") == 0
    for bag_id, size in (("s40x", 512), ("s20x", 256)):
        with h5py.File(tmp_path / "stamp" / f"{bag_id}.h5") as f:
            assert f.attrs["tile_size_um"] == 128.0 and f.attrs["tile_size_px"] == 256
            assert f["coords"][:].tolist() == [[0.0, 128.0], [128.0, 0.0]]
        with h5py.File(tmp_path / "trident" / f"{bag_id}.h5") as f:
            assert f["coords"].attrs["patch_size_level0"] == size
    w = open_store(str(store), mode="a").create_bag_split("ds", "enc", "nosize", dim=DIM, coords_unit="px")
    w.add_bag("s1", np.ones((2, DIM), np.float32), coords=np.zeros((2, 2), np.int64), attrs={"mpp": 0.5})
    w.commit()
    capsys.readouterr()
    assert export(store, "nosize", "stamp", tmp_path / "none") == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "bag 's1' of ds/enc/nosize records no patch size at level 0" in err, err
    assert not (tmp_path / "none").exists() or not list((tmp_path / "none").iterdir())


def test_export_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = open_store(str(tmp_path / "store"), mode="a")
    w = store.create_bag_split("ds", "enc", "evil", dim=DIM)
    w.add_bag("../escape", np.zeros((2, DIM), np.float32), coords=np.zeros((2, 2), np.int64))
    w.commit()
    w = store.create_split("ds", "enc", "dense", num_samples=2, sample_shape=(DIM,), dtype="float32")
    w.write(0, np.zeros((2, DIM), np.float32))
    w.commit()
    for split, fmt, words in (("evil", "trident", "cannot be a file name"), ("dense", "trident", "dense split"),
                              ("nope", "clam-pt", "nope")):  # fmt: skip
        assert export(tmp_path / "store", split, fmt, tmp_path / "out" / "x") == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("featurestore: error:") and words in err, err
    assert not (tmp_path / "escape.h5").exists() and not (tmp_path / "out" / "escape.h5").exists()


def test_a_bad_out_is_named_not_blamed_on_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    slide_files(tmp_path / "src", {"s1": 3}, dtype=np.float32, coords_dtype=np.int64, attrs={})
    import_dir(tmp_path / "src", tmp_path / "store", "all")
    capsys.readouterr()
    a_file = tmp_path / "taken.txt"
    a_file.write_text("not a folder")
    for out, words in ((a_file, f"--out {a_file} is a file, not a directory: give a folder"),
                       (a_file / "sub", f"{a_file} is a file, not a directory")):
        assert export(tmp_path / "store", "all", "trident", out) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err and "cannot use the store" not in err, err
    # What no check can foresee (/proc/x, a read-only mount) fails in makedirs: still --out's error.
    def refuse(path: str, exist_ok: bool = False) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr("featurestore.extract.bag_export.os.makedirs", refuse)
    assert export(tmp_path / "store", "all", "trident", tmp_path / "new") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"cannot write into --out {str(tmp_path / 'new')!r} (Permission denied)" in err
    assert "cannot use the store" not in err, err


# ---------------------------------------------------------------------- rm
def _rm(store: Path, *argv: str, stdin: Any = subprocess.DEVNULL) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "featurestore.cli", "rm", str(store), *argv], stdin=stdin,
                          capture_output=True, text=True, env=env, timeout=120)


def _two_splits(path: Path) -> None:
    store = open_store(str(path), mode="a")
    for split in ("train", "val"):
        w = store.create_split("ds", "enc", split, num_samples=3, sample_shape=(4,), dtype="float16")
        w.write(0, np.ones((3, 4), np.float32))
        w.commit()


def test_rm_refuses_without_yes_off_a_terminal_and_unknown_names(tmp_path: Path) -> None:
    _two_splits(tmp_path / "store")
    done = _rm(tmp_path / "store", "ds", "enc", "train")
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1
    assert "refusing to remove split ds/enc/train" in done.stderr and "--yes" in done.stderr
    assert open_store(str(tmp_path / "store")).splits("ds", "enc") == ["train", "val"]
    for argv, words in ((("ds", "enc", "nope", "--yes"), "no split ds/enc/nope"),
                        (("ds", "other", "train", "--yes"), "other"), (("ds", "enc", "../x", "--yes"), "../x")):
        done = _rm(tmp_path / "store", *argv)
        assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1 and words in done.stderr, done.stderr
    done = _rm(tmp_path / "store", "ds", "enc", "train", "--yes")
    assert done.returncode == 0 and "removed ds/enc/train" in done.stdout
    store = open_store(str(tmp_path / "store"))
    assert store.splits("ds", "enc") == ["val"] and not (tmp_path / "store" / "ds" / "enc" / "train").exists()
    assert store.open("ds", "enc", "val").read([0, 2]).float().sum().item() == 8.0


def test_rm_asks_on_a_terminal(tmp_path: Path) -> None:
    _two_splits(tmp_path / "store")
    for answer, code, left in ((b"n\n", 1, ["train", "val"]), (b"y\n", 0, ["val"])):
        parent, child = os.openpty()
        try:
            os.write(parent, answer)
            done = _rm(tmp_path / "store", "ds", "enc", "train", stdin=child)
        finally:
            os.close(parent)
            os.close(child)
        assert done.returncode == code, done.stderr
        assert open_store(str(tmp_path / "store")).splits("ds", "enc") == left


def test_an_int8_bag_split_exports_its_values_not_its_codes(tmp_path: Path) -> None:
    """int8 codes mean nothing without their bag's scale: every format gets the float32 values
    (codes x scale) that the split's readers return."""
    store = open_store(str(tmp_path / "store"), mode="a")
    w = store.create_bag_split("ds", "enc", "q", dim=DIM, dtype="int8", patch_size_level0=256)
    rng = np.random.default_rng(0)
    for k, n in enumerate((5, 9)):
        w.add_bag(f"slide-{k}", rng.standard_normal((n, DIM)).astype(np.float32) * (k + 1),
                  coords=np.arange(2 * n).reshape(n, 2) * 256, attrs={"mpp": 0.5})
    w.commit()
    bags = store.open_bags("ds", "enc", "q")
    for fmt, name, key in (("trident", "{}.h5", "features"), ("stamp", "{}.h5", "feats"),
                           ("clam-pt", "h5_files/{}.h5", "features")):
        assert export(tmp_path / "store", "q", fmt, tmp_path / fmt) == 0
        for i, slide in enumerate(bags.ids):
            want = bags.read_numpy(i, dtype="float32")[0]
            with h5py.File(tmp_path / fmt / name.format(slide)) as f:
                assert f[key].dtype == np.float32 and np.array_equal(f[key][:], want), (fmt, slide)
            if fmt == "clam-pt":
                assert torch.equal(torch.load(tmp_path / fmt / "pt_files" / f"{slide}.pt"), torch.from_numpy(want))


def test_embedding_splits_in_int8_and_bfloat16_export_as_float32(tmp_path: Path) -> None:
    """HDF5 has no bfloat16 and int8 needs its scales: both come out as the float32 the readers give."""
    store = open_store(str(tmp_path / "store"), mode="a")
    values = np.random.default_rng(0).standard_normal((5, DIM)).astype(np.float32)
    ids = [f"case-{i}" for i in range(5)]
    for encoder, dtype in (("emb-int8", "int8"), ("emb-bf16", "bfloat16")):
        w = store.create_split("ds", encoder, "s", num_samples=5, sample_shape=(DIM,), dtype=dtype, ids=ids)
        w.write(0, values)
        w.commit()
        assert cli("export", str(tmp_path / "store"), "--dataset", "ds", "--encoder", encoder, "--split", "s",
                   "--format", "trident", "--out", str(tmp_path / encoder), "--no-progress") == 0
        want = store.open("ds", encoder, "s").read_numpy(np.arange(5), dtype="float32")
        for i, sample in enumerate(ids):
            with h5py.File(tmp_path / encoder / f"{sample}.h5") as f:
                assert f["features"].dtype == np.float32 and np.array_equal(f["features"][:], want[i])
                assert dict(f.attrs) == {"encoder": encoder}


def test_class_names_go_with_the_labels(tmp_path: Path) -> None:
    """An imported split's class names (``label_names``) reach its embeddings with the labels: the
    export's labels.csv names the classes, as the bags' own export does; --no-labels drops both."""
    store = open_store(str(tmp_path), mode="a")
    w = store.create_bag_split("ds", "uni", "train", dim=EMBED_DIM, label_dtype="int64", patch_size_level0=PATCH,
                               metadata={"label_names": ["LUAD", "LUSC"]})
    for bag_id, (n, label, case) in BAGS.items():
        w.add_bag(bag_id, embed_bag(bag_id, n, "float16"), coords=embed_coords(bag_id, n), label=label,
                  attrs={"case_id": case})
    w.commit()
    embed_split(tmp_path, group_by="case_id", encoder_name="patient", out_split="patients")
    embed_split(tmp_path, encoder_name="bare", no_labels=True)
    assert store.split_metadata("ds", "patient", "patients")["label_names"] == ["LUAD", "LUSC"]
    assert "label_names" not in store.split_metadata("ds", "bare", "train")
    done = embed_cli("export", str(tmp_path), "--dataset", "ds", "--encoder", "patient", "--split", "patients",
                     "--format", "trident", "--out", str(tmp_path / "out"), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "labels.csv").read_text().splitlines() == ["case_id,label", "p1,LUAD", "p2,LUSC",
                                                                          "p3,LUSC"]


def test_a_nan_in_an_array_attribute_exports_as_nan(tmp_path: Path) -> None:
    """An import keeps NaN as JSON null: inside an array, [null, null] made h5py raise a TypeError
    traceback halfway through the export (earlier slides' files already written)."""
    store = open_store(str(tmp_path / "store"), mode="a")
    w = store.create_bag_split("ds", "enc", "s", dim=DIM)
    for name, mpp in (("a1", [0.25, 0.25]), ("a2", [None, None]), ("a3", [0.5, None])):
        w.add_bag(name, np.ones((2, DIM), np.float32), coords=np.zeros((2, 2), np.int64),
                  attrs={"coords": {"mpp_xy": mpp}})
    w.commit()
    assert export(tmp_path / "store", "s", "trident", tmp_path / "out") == 0
    with h5py.File(tmp_path / "out" / "a2.h5") as f:
        assert np.isnan(f["coords"].attrs["mpp_xy"]).all()
    with h5py.File(tmp_path / "out" / "a3.h5") as f:
        assert f["coords"].attrs["mpp_xy"][0] == 0.5 and np.isnan(f["coords"].attrs["mpp_xy"][1])


def test_clam_coordinates_are_refused_before_any_file_is_written(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The int32 check ran inside the write loop: a refused bag left the files of the bags before
    it (a CLAM directory that looked cut short)."""
    store = open_store(str(tmp_path / "store"), mode="a")
    w = store.create_bag_split("ds", "enc", "s", dim=DIM)
    w.add_bag("a", np.ones((2, DIM), np.float32), coords=np.zeros((2, 2), np.int64))
    w.add_bag("b", np.ones((2, DIM), np.float32), coords=np.full((2, 2), 2**40, np.int64))
    w.commit()
    assert export(tmp_path / "store", "s", "clam-pt", tmp_path / "out") == 1
    assert "bag 'b' of ds/enc/s has coordinates beyond int32" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.*"))


def test_another_tools_files_export_with_the_keys_the_target_tool_reads(tmp_path: Path) -> None:
    """TRIDENT -> clam-pt kept TRIDENT's coords attributes only (no patch_level: CLAM's readers
    raise KeyError, and its patch_size is at the target magnification); CLAM -> trident had no
    patch_size_level0 for TRIDENT's slide encoders."""
    job = tmp_path / "tr"
    slide_files(job, {"s1": 3}, dtype=np.float16, coords_dtype=np.int64,
                attrs={"patch_size": 256, "patch_size_level0": 512, "level0_magnification": 40})
    clam = tmp_path / "clam" / "h5_files"
    slide_files(clam, {"c1": 3}, dtype=np.float32, coords_dtype=np.int32, attrs={"patch_size": 224, "patch_level": 0})
    store = tmp_path / "store"
    import_dir(job, store, "tr")
    import_dir(clam.parent, store, "cl", "--dtype", "float32")
    assert export(store, "tr", "clam-pt", tmp_path / "o1") == 0
    with h5py.File(tmp_path / "o1" / "h5_files" / "s1.h5") as f:
        assert f["coords"].attrs["patch_level"] == 0 and f["coords"].attrs["patch_size"] == 512
    assert export(store, "cl", "trident", tmp_path / "o2") == 0
    with h5py.File(tmp_path / "o2" / "c1.h5") as f:
        assert f["coords"].attrs["patch_size_level0"] == 224 and f["coords"].attrs["patch_size"] == 224
