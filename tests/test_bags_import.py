"""``featurestore import DIR`` of per-slide files (TRIDENT, CLAM, STAMP) as a bag split."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from _import_fixtures import complete_bags, h5_slides

from featurestore import open_store
from featurestore.cli import main

DIM = 16


def trident_dir(root: Path, lengths: dict[str, int], dtype: Any = np.float16, seed: int = 0) -> dict[str, Any]:
    """One h5 per slide as TRIDENT writes it: features (h5 chunks of one row), coords int64 + attrs."""
    return h5_slides(root, lengths, DIM, dtype=dtype, seed=seed, trident=True)


def run_import(source: Path, store: Path, *extra: str, split: str = "train") -> int:
    return main(["import", str(source), "--store", str(store), "--dataset", "ds", "--encoder-name", "enc",
                 "--split", split, "--no-progress", *extra])


def test_trident_directory_with_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = trident_dir(tmp_path / "features_uni", {"TCGA-02": 40, "TCGA-01": 7, "empty-slide": 0, "TCGA-10": 130})
    (tmp_path / "labels.csv").write_text("case_id,slide_id,label\nc,TCGA-01.svs,LUAD\nc,TCGA-02,LUSC\n"
                                         "c,TCGA-10,LUAD\nc,empty-slide,LUSC\nc,unused,LUAD\n")
    assert run_import(tmp_path / "features_uni", tmp_path / "store", "--labels", str(tmp_path / "labels.csv"),
                      "--chunk-mb", "0.001") == 0
    out = capsys.readouterr().out
    assert "imported ds/enc/train: 4 bags, 177 patches x 16 float16" in out
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "train")
    assert bags.ids == sorted(data) and bags.metadata["label_names"] == ["LUAD", "LUSC"]
    assert bags.coords_unit == "px" and bags.patch_size_level0 == 512 and bags.metadata["quantization"]["exact"]
    for slide, (features, coords) in data.items():
        got, got_coords = bags.read_numpy(slide)
        np.testing.assert_array_equal(got, features)
        np.testing.assert_array_equal(got_coords, coords)
        assert bags.label(slide) == (0 if slide in ("TCGA-01", "TCGA-10") else 1)
    attrs = bags.attrs("TCGA-02")
    assert attrs["source_file"] == "TCGA-02.h5" and attrs["coords"]["level0_magnification"] == 40
    assert attrs["features"] == {"encoder": "uni_v1"}
    # a re-run is a no-op
    assert run_import(tmp_path / "features_uni", tmp_path / "store", "--labels", str(tmp_path / "labels.csv"),
                      "--chunk-mb", "0.001") == 0
    assert "already complete" in capsys.readouterr().out


def test_stamp_feats_and_micrometre_coords(tmp_path: Path) -> None:
    source = tmp_path / "stamp"
    source.mkdir()
    rng = np.random.default_rng(1)
    feats = rng.standard_normal((9, DIM)).astype(np.float16)
    coords = (rng.random((9, 2)) * 1e4).astype(np.float32)
    with h5py.File(source / "slide-a.h5", "w") as f:
        f["feats"], f["coords"] = feats, coords
        f.attrs.update({"unit": "um", "tile_size_um": 256.0, "tile_size_px": 224, "extractor": "ctranspath"})
    assert run_import(source, tmp_path / "store") == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "train")
    assert bags.coords_unit == "um" and bags.coords_dtype == "float32" and bags.patch_size_level0 == 256
    got, got_coords = bags.read_numpy("slide-a")
    np.testing.assert_array_equal(got, feats)
    np.testing.assert_array_equal(got_coords, coords)
    assert bags.attrs("slide-a")["root"]["extractor"] == "ctranspath"


def test_clam_job_and_pt_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = tmp_path / "clam"
    data = trident_dir(job / "h5_files", {"s1": 5, "s2": 8}, dtype=np.float32)
    (job / "pt_files").mkdir()
    for slide, (features, _) in data.items():
        torch.save(torch.from_numpy(features), job / "pt_files" / f"{slide}.pt")
    torch.save(torch.zeros(3, 16), job / "pt_files" / "s3.pt")  # a run cut short before s3's h5
    assert run_import(job, tmp_path / "store", "--dtype", "float32") == 0  # h5_files first: it has coords
    out = capsys.readouterr()
    assert "1 slide(s) of" in out.out + out.err and "have no h5 file in h5_files (first: 's3'): not imported" in (
        out.out + out.err), out
    (job / "pt_files" / "s3.pt").unlink()
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "train")
    np.testing.assert_array_equal(bags.read_numpy("s2")[1], data["s2"][1])
    assert run_import(job / "pt_files", tmp_path / "store", "--dtype", "float32", split="pt") == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "pt")
    assert bags.coords_unit is None and bags.ids == ["s1", "s2"]
    np.testing.assert_array_equal(bags.read_numpy("s1")[0], data["s1"][0])
    assert (bags.read_numpy("s1")[1] == -1).all()


@pytest.mark.parametrize("damage", ["no-features", "coords-length", "mixed-dims", "truncated", "missing-label"])
def test_malformed_file_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    source = tmp_path / "src"
    trident_dir(source, {"a": 4, "b": 5, "c": 6})
    bad = source / "b.h5"
    extra: list[str] = []
    if damage == "no-features":
        with h5py.File(bad, "w") as f:
            f["coords"] = np.zeros((3, 2), np.int64)
    elif damage == "coords-length":
        with h5py.File(bad, "w") as f:
            f["features"], f["coords"] = np.zeros((3, DIM), np.float16), np.zeros((2, 2), np.int64)
    elif damage == "mixed-dims":
        with h5py.File(bad, "w") as f:
            f["features"], f["coords"] = np.zeros((3, DIM + 1), np.float16), np.zeros((3, 2), np.int64)
    elif damage == "truncated":
        raw = bad.read_bytes()
        bad.write_bytes(raw[: len(raw) // 2])
    else:
        (tmp_path / "labels.csv").write_text("slide_id,label\na,1\nc,0\n")
        extra = ["--labels", str(tmp_path / "labels.csv")]
    assert run_import(source, tmp_path / "store", *extra) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "b.h5" in err or "'b'" in err


def test_a_trident_job_directory_names_its_encoders_directories(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The directory above the per-slide files (a TRIDENT job's 20x_256px/, one features_<encoder>/
    each) is refused in one line that names them, whatever level the user pointed at."""
    job = tmp_path / "job"
    trident_dir(job / "20x_256px" / "features_uni", {"a": 4, "b": 5})
    trident_dir(job / "20x_256px" / "features_conch", {"a": 4})
    (job / "20x_256px" / "patches").mkdir()  # TRIDENT's coordinates-only outputs sit beside them
    for source, prefix in ((job / "20x_256px", ""), (job, "20x_256px/")):
        assert run_import(source, tmp_path / "store") == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "holds no feature files itself" in err, err
        assert f"{prefix}features_conch/ (1 slide files), {prefix}features_uni/ (2 slide files)" in err, err
    assert not (tmp_path / "store").exists()  # nothing written
    assert run_import(job / "20x_256px" / "features_uni", tmp_path / "store") == 0


def test_truncated_file_met_while_reading_keeps_earlier_bags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file whose header reads but whose rows do not: the bags before it stay, --resume goes on."""
    source = tmp_path / "src"
    data = trident_dir(source, {"a": 300, "b": 300, "c": 300})
    bad = source / "b.h5"
    with h5py.File(bad, "w") as f:  # gzip chunks: garbage in one fails its inflate on read
        f.create_dataset("features", data=data["b"][0], chunks=(1, DIM), compression="gzip")
        f["coords"] = data["b"][1]
    good = bad.read_bytes()
    with h5py.File(bad, "r") as f:
        info = f["features"].id.get_chunk_info(150)
    raw = bytearray(good)
    raw[info.byte_offset : info.byte_offset + info.size] = b"\xff" * info.size
    bad.write_bytes(bytes(raw))
    code = run_import(source, tmp_path / "store", "--chunk-mb", "0.001")
    err = capsys.readouterr().err
    assert code == 1 and "b.h5" in err and "re-create it, then rerun the import with --resume" in err
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM, resume=True, chunk_bytes=int(0.001 * (1 << 20)),
                                    patch_size_level0=512)
    assert writer.done_ids == {"a"}
    writer.close()
    bad.write_bytes(good)
    assert run_import(source, tmp_path / "store", "--chunk-mb", "0.001", "--resume") == 0
    bags = store.open_bags("ds", "enc", "train")
    assert bags.ids == ["a", "b", "c"]
    np.testing.assert_array_equal(bags.read_numpy("b")[0], data["b"][0])


_CHILD = """
import sys
from featurestore.cli import main
sys.exit(main(["import", sys.argv[1], "--store", sys.argv[2], "--dataset", "ds", "--encoder-name", "enc",
               "--split", "train", "--no-progress", "--chunk-mb", "0.002"]))
"""


def test_sigkill_during_import_then_resume(tmp_path: Path) -> None:
    """Killed once some bags are on storage: the resume keeps them, adds the rest, no duplicates."""
    lengths = {f"slide-{i:03d}": 20 + (i * 37) % 90 for i in range(150)}
    data = trident_dir(tmp_path / "src", lengths)
    store_path = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "src"), str(store_path)],
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and child.poll() is None:
        if complete_bags(store_path, ("ds", "enc", "train")) >= 1:  # a bag the resume must keep
            break
        time.sleep(0.002)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL, "the import finished before it could be killed"
    store = open_store(str(store_path), mode="a")
    assert store.split_status("ds", "enc", "train") == "writing"
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM, resume=True, chunk_bytes=int(0.002 * (1 << 20)),
                                    patch_size_level0=512)
    kept = writer.done_ids
    writer.close()
    assert 0 < len(kept) < len(lengths)
    assert run_import(tmp_path / "src", store_path, "--chunk-mb", "0.002", "--resume") == 0
    bags = store.open_bags("ds", "enc", "train")
    assert bags.ids == sorted(lengths) and len(set(bags.ids)) == len(bags.ids)
    for slide in list(lengths)[::15]:
        np.testing.assert_array_equal(bags.read_numpy(slide)[0], data[slide][0])
        np.testing.assert_array_equal(bags.read_numpy(slide)[1], data[slide][1])
    assert main(["verify", str(store_path)]) == 0


def test_a_complete_split_missing_slides_of_the_same_input_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Two runs of one import at once: the first to commit left out the slides the other was still
    adding (that run is now told so). A re-run then said "already complete: nothing to do", with
    slides missing and the same cache key; now it names them and the fix."""
    from featurestore.extract.bag_import import BagImport

    trident_dir(tmp_path / "h5", {"a": 5, "b": 3, "c": 4})
    units = BagImport.units
    with monkeypatch.context() as patch:  # the first run commits before slide c was added
        patch.setattr(BagImport, "units", lambda self, writer: [u for u in units(self, writer) if u[1].bag_id != "c"])
        assert run_import(tmp_path / "h5", tmp_path / "store") == 0
    assert len(open_store(str(tmp_path / "store")).open_bags("ds", "enc", "train")) == 2
    capsys.readouterr()
    assert run_import(tmp_path / "h5", tmp_path / "store", "--resume") == 1
    err = capsys.readouterr().err
    assert "is complete but lacks 1 of this run's inputs (first: 'c')" in err and "--overwrite" in err, err
    assert run_import(tmp_path / "h5", tmp_path / "store", "--overwrite") == 0
    assert len(open_store(str(tmp_path / "store")).open_bags("ds", "enc", "train")) == 3


def test_each_slide_keeps_its_own_patch_size(tmp_path: Path) -> None:
    """A TRIDENT job mixing 40x and 20x scans: only the first file's patch_size_level0 counted, for
    every bag (a slide encoder and a STAMP export got the wrong tile size); a first file without it
    left every bag without one."""
    trident_dir(tmp_path / "h5", {"A-40x": 4, "B-20x": 3, "C-none": 2})
    with h5py.File(tmp_path / "h5" / "B-20x.h5", "r+") as f:
        f["coords"].attrs["patch_size_level0"] = 256
    with h5py.File(tmp_path / "h5" / "C-none.h5", "r+") as f:
        del f["coords"].attrs["patch_size_level0"]
    assert run_import(tmp_path / "h5", tmp_path / "store") == 0
    bags = open_store(str(tmp_path / "store")).open_bags("ds", "enc", "train")
    first = h5py.File(tmp_path / "h5" / "A-40x.h5", "r")["coords"].attrs["patch_size_level0"]
    assert bags.patch_sizes() == [int(first), 256, int(first)]  # C: the split's (the first file's)


def test_pt_dicts_say_which_keys_are_not_imported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A .pt holding {"features", "coords", ...}: its coords were dropped without a word."""
    (tmp_path / "pt_files").mkdir()
    for name in ("a", "b"):
        torch.save({"features": torch.randn(4, DIM), "coords": torch.arange(8).reshape(4, 2) * 256},
                   tmp_path / "pt_files" / f"{name}.pt")
    assert run_import(tmp_path / "pt_files", tmp_path / "store", "--dtype", "float32") == 0
    out = capsys.readouterr().out
    assert "only their 'features' are imported; not their 'coords' (first: 'coords' in 'a.pt')" in out, out
