"""``extract --images wsi:... --coords-from D/E/S``: a second encoder's bags hold the first split's
patches, row for row; what cannot align is refused in one line before any slide is read.

The cohort and the first split (``reference``, tissue by Otsu) are test_wsi_extract's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openslide")
pytest.importorskip("tifffile")

import test_wsi_extract
from test_extract import run_cli
from test_wsi_extract import NAME, _common, _opts

import featurestore
from featurestore.demo.slides import write_slide
from featurestore.errors import CacheKeyMismatch, InvalidOption
from featurestore.extract.dist import Coordinator
from featurestore.extract.wsi_run import extract_slides

cohort = test_wsi_extract.cohort  # its fixtures: the slides and the first encoder's split
reference = test_wsi_extract.reference
SOURCE = "/".join(NAME)
VECTOR = "python:test_wsi_extract:vector_encoder"


def test_second_encoder_gets_the_first_splits_coords_row_for_row(cohort: Path, reference: Path,
                                                                   tmp_path: Path) -> None:
    # --tissue all: without --coords-from this run would keep every grid patch, not the source's.
    result = extract_slides(_opts(cohort, reference, encoder=VECTOR, encoder_name="vec", tissue="all",
                                  coords_from=SOURCE), Coordinator())
    store = featurestore.open_store(str(reference))
    first, second = store.open_bags(*NAME), store.open_bags(NAME[0], "vec", NAME[2])
    assert list(second.ids) == list(first.ids) == ["blank", "slide-000", "slide-001", "slide-002"]
    for bag in first.ids:
        _, want = first.read_numpy(bag)
        features, coords = second.read_numpy(bag)
        assert coords.dtype == np.int64 and np.array_equal(coords, want), bag
        assert len(features) == len(want)
        assert second.attrs(bag)["coords_from"] == SOURCE
    assert sum(len(first.read_numpy(b)[1]) for b in first.ids) < sum(
        second.attrs(b)["grid_patches"] for b in first.ids)  # the grid had more: the coords are the source's
    assert [s["id"] for s in second.metadata["skipped"]] == ["junk"]  # skipped in the source, skipped here
    assert isinstance(first.metadata["generation"], str)
    assert result.metadata["coords_from"] == second.metadata["coords_from"] == {
        "dataset": NAME[0], "encoder": NAME[1], "split": NAME[2], "generation": first.metadata["generation"]}
    # The source is part of the cache key: a re-run that would cut its own grid is refused.
    with pytest.raises(CacheKeyMismatch, match="cache key"):
        extract_slides(_opts(cohort, reference, encoder=VECTOR, encoder_name="vec", tissue="all"), Coordinator())
    # The patches are read where the coords say: the features equal this encoder's own run on the
    # source's grid settings (Otsu), which cuts the same patches.
    own = tmp_path / "own"
    extract_slides(_opts(cohort, own, encoder=VECTOR, encoder_name="vec"), Coordinator())
    mine = featurestore.open_store(str(own)).open_bags(NAME[0], "vec", NAME[2])
    for bag in first.ids:
        assert np.array_equal(mine.read_numpy(bag)[0], second.read_numpy(bag)[0]), bag


def test_a_slide_missing_from_the_source_is_refused_in_one_line(cohort: Path, reference: Path,
                                                                tmp_path: Path) -> None:
    more = tmp_path / "more"
    more.mkdir()
    for name in ("slide-000.tiff", "slide-001.tiff"):
        os.symlink(cohort / name, more / name)
    write_slide(more / "extra.tiff", width=1024, height=768, mpp=0.5)
    common = _common(more)
    result = run_cli("extract", *common, "--encoder-name", "vec2", "--store", str(reference),
                     "--coords-from", SOURCE, timeout=240)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "slide extra" in result.stderr and f"no bag in --coords-from {SOURCE}" in result.stderr
    assert "vec2" not in featurestore.open_store(str(reference)).encoders(NAME[0])  # refused before writing


def test_another_patch_size_is_refused_in_one_line_naming_both(cohort: Path, reference: Path) -> None:
    common = _common(cohort)
    common[common.index("--patch-size") + 1] = "128"
    result = run_cli("extract", *common, "--encoder-name", "vec3", "--store", str(reference),
                     "--coords-from", SOURCE, timeout=240)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "patch_size 64" in result.stderr and "--patch-size 128" in result.stderr


def test_coords_in_another_unit_and_bad_specs_are_refused(cohort: Path, tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path / "um"), mode="a")
    writer = store.create_bag_split("cohort", "other", "train", dim=4, coords_unit="um", coords_dtype="float32")
    writer.add_bag("slide-000", np.zeros((1, 4), np.float16), coords=np.zeros((1, 2), np.float32))
    writer.commit()
    with pytest.raises(InvalidOption, match="coords in 'um', not level-0 px"):
        extract_slides(_opts(cohort, tmp_path / "um", coords_from="cohort/other/train"), Coordinator())
    with pytest.raises(InvalidOption, match="DATASET/ENCODER/SPLIT"):
        extract_slides(_opts(cohort, tmp_path / "um", coords_from="cohort/other"), Coordinator())
    with pytest.raises(InvalidOption, match="--coords-store names the store of --coords-from"):
        extract_slides(_opts(cohort, tmp_path / "um", coords_store=str(tmp_path)), Coordinator())
