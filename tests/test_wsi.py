"""Whole-slide images: the grid, level choice, tissue detection and patch reads against OpenSlide.

Slides are synthetic pyramidal TIFFs (featurestore.demo.slides) that OpenSlide opens as
``generic-tiff`` (mpp from the TIFF resolution tags) or ``aperio`` (objective power only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("openslide")
tifffile = pytest.importorskip("tifffile")

from featurestore.demo.slides import slide_image, write_slide  # noqa: E402
from featurestore.errors import InvalidOption  # noqa: E402
from featurestore.extract import tissue  # noqa: E402
from featurestore.extract.wsi import SlideError, SlideRef, Target, geometry, grid, list_slides, open_slide  # noqa: E402
from featurestore.extract.wsi_bags import BagAssembler  # noqa: E402
from featurestore.extract.wsi_patches import (  # noqa: E402
    PatchBatches,
    PatchKey,
    PatchReader,
    Patching,
    Skipped,
    SlidePlan,
    SlidePlanner,
    plan_slide,
)

DOWNSAMPLES = (1.0, 4.0, 16.0)


@pytest.fixture(scope="module")
def slide(tmp_path_factory: pytest.TempPathFactory) -> str:
    """2048 x 1536 at 0.25 um/px (a 40x scan), levels 1, 4, 16."""
    return write_slide(tmp_path_factory.mktemp("slides") / "s40.tiff", width=2048, height=1536, mpp=0.25, seed=3)


def test_grid_is_row_major_whole_patches_top_left_xy() -> None:
    coords = grid(300, 250, 100)
    assert coords.dtype == np.int64
    assert coords.tolist() == [[0, 0], [100, 0], [200, 0], [0, 100], [100, 100], [200, 100]]
    assert grid(99, 500, 100).shape == (0, 2)


@pytest.mark.parametrize(("props", "target", "level", "size0", "read"), [
    ({"openslide.mpp-x": "0.25"}, Target(256, magnification=20), 0, 512, 512),  # 40x -> 20x: resize 2:1
    ({"openslide.mpp-x": "0.25"}, Target(256, magnification=10), 1, 1024, 256),  # level 1 matches
    ({"openslide.mpp-x": "0.25"}, Target(256, magnification=5), 1, 2048, 512),  # between levels: coarser never
    ({"openslide.mpp-x": "0.5"}, Target(224, mpp=0.5), 0, 224, 224),
    ({"openslide.mpp-x": "0.5"}, Target(256, mpp=8.0), 2, 4096, 256),
    ({"openslide.objective-power": "40"}, Target(256, magnification=20), 0, 512, 512),  # mpp 10/40
    ({"openslide.objective-power": "20", "openslide.mpp-x": "0.2525"}, Target(256, magnification=20), 0, 256, 256),
    ({}, Target(256, magnification=10, slide_mpp=0.25), 1, 1024, 256),  # --slide-mpp fallback
])
def test_level_choice(props: dict[str, str], target: Target, level: int, size0: int, read: int) -> None:
    geo = geometry(props, (100_000, 80_000), DOWNSAMPLES, target, "s.svs")
    assert (geo.level, geo.patch_size_level0, geo.read_size) == (level, size0, read)


def test_level_within_rounding_of_a_scanners_downsample_matches() -> None:
    geo = geometry({"openslide.mpp-x": "0.25"}, (1000, 1000), (1.0, 4.000244, 16.0009), Target(256, magnification=10), "s")
    assert (geo.level, geo.read_size) == (1, 256)


def test_scale_errors_are_one_line_naming_the_slide() -> None:
    with pytest.raises(SlideError, match=r"'a\.svs' has no resolution metadata.*--slide-mpp"):
        geometry({}, (10, 10), (1.0,), Target(256), "a.svs")
    with pytest.raises(SlideError, match=r"'b\.svs': --magnification 40 is finer than the scan's 20x.*--magnification 20 or less"):
        geometry({"openslide.mpp-x": "0.5"}, (10, 10), (1.0,), Target(256, magnification=40), "b.svs")
    with pytest.raises(SlideError, match=r"--mpp 0.25 is finer than the scan's 0.5 um/px"):
        geometry({"openslide.mpp-x": "0.5"}, (10, 10), (1.0,), Target(256, mpp=0.25), "c.svs")
    with pytest.raises(InvalidOption, match="exclude each other"):
        Target(256, magnification=20, mpp=0.5)
    # a traceback (a 30 GB white probe patch) or an apparent hang before
    with pytest.raises(InvalidOption, match="--patch-size 100000 is larger than any patch encoders take: give at most"):
        Target(100_000)
    assert Target(4096).patch_size == 4096  # a region encoder's


def test_missing_and_non_slide_files(tmp_path: Path) -> None:
    with pytest.raises(SlideError, match="does not exist"):
        list_slides(str(tmp_path / "nope"))
    junk = tmp_path / "junk.svs"
    junk.write_text("not a slide")
    with pytest.raises(SlideError, match=r"'.*junk\.svs' is not a slide OpenSlide can read"):
        open_slide(str(junk))
    with pytest.raises(SlideError, match="holds no slide files"):
        list_slides(str(tmp_path / "empty") if (tmp_path / "empty").mkdir() is None else "")


def test_a_dangling_link_and_a_fifo_are_listed_and_refused_by_name(tmp_path: Path) -> None:
    """A folder of links into an archive: a link whose target was gone was not listed at all, so
    its slide vanished (the split complete and short, exit 0); a FIFO hung OpenSlide."""
    import os

    folder = tmp_path / "slides"
    folder.mkdir()
    write_slide(str(tmp_path / "real.tiff"), width=256, height=256, mpp=0.5)
    os.symlink(tmp_path / "real.tiff", folder / "a.tiff")
    os.symlink(tmp_path / "archive" / "gone.svs", folder / "b.svs")
    os.mkfifo(folder / "c.svs")
    assert [r.id for r in list_slides(str(folder))] == ["a", "b", "c"]
    open_slide(str(folder / "a.tiff")).close()
    with pytest.raises(SlideError, match=r"b\.svs' does not exist \(a link to '.*gone\.svs', which is gone\)"):
        open_slide(str(folder / "b.svs"))
    with pytest.raises(SlideError, match=r"c\.svs' is not a regular file"):
        open_slide(str(folder / "c.svs"))


def test_one_file_listed_under_two_ids_is_refused(tmp_path: Path) -> None:
    """It was encoded twice, and its two bags could land in different folds of a probe."""
    write_slide(str(tmp_path / "s.tiff"), width=256, height=256, mpp=0.5)
    (tmp_path / "list.csv").write_text("path,slide_id\ns.tiff,a\n./s.tiff,b\n")
    with pytest.raises(SlideError, match="slide ids 'a' and 'b' name the same file"):
        list_slides(str(tmp_path / "list.csv"))


def test_slide_list_csv_ids_and_labels(tmp_path: Path) -> None:
    (tmp_path / "b.tiff").write_bytes(b"")
    (tmp_path / "list.csv").write_text("path,slide_id,label\nb.tiff,case-2,1\n/abs/a.svs,,0\n")
    refs = list_slides(str(tmp_path / "list.csv"))
    assert [(r.id, r.path, r.label) for r in refs] == [("a", "/abs/a.svs", "0"),
                                                      ("case-2", str(tmp_path / "b.tiff"), "1")]
    (tmp_path / "nolabelid.csv").write_text("path,label\nb.tiff,1\n")
    with pytest.raises(SlideError, match="label column but no slide_id column"):
        list_slides(str(tmp_path / "nolabelid.csv"))
    (tmp_path / "dup.csv").write_text("path\nx/s.svs\ny/s.svs\n")
    with pytest.raises(SlideError, match="share the bag id 's'"):
        list_slides(str(tmp_path / "dup.csv"))


def test_slide_list_from_a_spreadsheet_and_broken_lists(tmp_path: Path) -> None:
    # "CSV UTF-8" from a spreadsheet starts with a byte-order mark: before, the first column read
    # as '\ufeffpath' and the list was refused for lacking a 'path' column.
    (tmp_path / "excel.csv").write_bytes("path,slide_id\r\na.svs,case-1\r\n,\r\n".encode("utf-8-sig"))
    assert [(r.id, r.path) for r in list_slides(str(tmp_path / "excel.csv"))] == [("case-1", str(tmp_path / "a.svs"))]
    (tmp_path / "nopath.csv").write_text("path,slide_id\na.svs,x\n,y\n")
    with pytest.raises(SlideError, match="line 3 has no path"):
        list_slides(str(tmp_path / "nopath.csv"))
    (tmp_path / "latin.csv").write_bytes("path\nMünchen.svs\n".encode("latin-1"))
    with pytest.raises(SlideError, match=r"is not UTF-8 \(byte 0xfc on line 2\): save it as UTF-8 CSV"):
        list_slides(str(tmp_path / "latin.csv"))
    # Past the decoder's first read-ahead: the line holding the byte, not the last one csv had parsed.
    rows = "".join(f"slide-{k}.svs\n" for k in range(3000))
    (tmp_path / "long.csv").write_bytes(f"path\n{rows}".encode() + "Zürich.svs\n".encode("latin-1"))
    with pytest.raises(SlideError, match=r"\(byte 0xfc on line 3002\)"):
        list_slides(str(tmp_path / "long.csv"))
    (tmp_path / "huge.csv").write_text('path,note\na.svs,"' + "x" * 200_000 + '"\n')
    with pytest.raises(SlideError, match="line 2 is not CSV .*field larger than field limit"):
        list_slides(str(tmp_path / "huge.csv"))


def test_otsu_and_mask_cleanup() -> None:
    values = np.array([10] * 50 + [200] * 50, dtype=np.uint8)
    assert 10 < tissue.otsu_threshold(values) <= 200
    assert tissue.otsu_threshold(np.full(9, 7, np.uint8)) == 0
    white = np.full((64, 64, 3), 240, np.uint8)
    mask, _ = tissue.tissue_mask(white)
    assert not mask.any()  # a blank slide keeps nothing (MIN_SATURATION)
    image = white.copy()
    image[8:56, 8:56] = (200, 90, 160)  # tissue
    image[30:32, 30:32] = 240  # a small hole in it
    image[2:4, 60:62] = (200, 90, 160)  # a speck on the glass
    mask, threshold = tissue.tissue_mask(image)
    assert threshold >= tissue.MIN_SATURATION
    assert mask[30, 30] and not mask[2, 60] and mask[10:54, 10:54].all() and not mask[:, :6].any()


def test_patch_fractions() -> None:
    mask = np.zeros((4, 16), bool)  # 4 x 4 mask pixels per patch of 64 level-0 px (scale 1/16)
    mask[:, :4] = True  # all of patch 0
    mask[:, 4:6] = True  # half of patch 1
    mask[0:2, 8:10] = True  # a quarter of patch 2
    coords = np.array([[0, 0], [64, 0], [128, 0], [192, 0]])
    assert tissue.patch_fractions(mask, coords, 64, (1 / 16, 1 / 16)).tolist() == [1.0, 0.5, 0.25, 0.0]


def test_plan_keeps_tissue_patches_in_row_major_order(slide: str) -> None:
    plan = plan_slide(0, list_slides(slide)[0], Patching(Target(128, magnification=20)))
    geo = plan.geometry
    assert (geo.mpp_source, geo.level, geo.patch_size_level0, geo.read_size) == ("openslide.mpp-x", 0, 256, 256)
    every = grid(2048, 1536, 256)
    assert 0 < len(plan) < len(every)
    order = [tuple(c) for c in every.tolist()]
    positions = [order.index(tuple(c)) for c in plan.coords.tolist()]
    assert positions == sorted(positions)  # a subsequence of the row-major grid
    # Kept patches are tissue: saturated, unlike the glass (white ~240) of the dropped ones.
    pixels = slide_image(2048, 1536, seed=3)
    sat = tissue.saturation(pixels)
    kept = {tuple(c) for c in plan.coords.tolist()}
    for x, y in order:
        patch = sat[y : y + 256, x : x + 256]
        if (x, y) in kept:
            assert (patch >= 30).mean() > 0.3
        elif (patch >= 30).mean() > 0.9:
            pytest.fail(f"patch {(x, y)} is all tissue but was dropped")
    everything = plan_slide(0, list_slides(slide)[0], Patching(Target(128, magnification=20), tissue="all"))
    assert everything.coords.tolist() == every.tolist()


def test_patches_match_a_direct_read_of_the_pyramid(slide: str) -> None:
    """Coordinates are level-0 px of the top-left corner: the patch read at level 1 is the TIFF's
    own level-1 pixels at (x / 4, y / 4), and at level 0 OpenSlide's read_region of (x, y)."""
    import openslide

    reader = PatchReader(64)
    ref = list_slides(slide)[0]
    direct = openslide.OpenSlide(slide)
    level1 = tifffile.imread(slide, key=1)
    plan = plan_slide(0, ref, Patching(Target(64, magnification=5), tissue="all"))  # downsample 8 -> level 1, resize 2:1
    assert (plan.geometry.level, plan.geometry.read_size) == (1, 128)
    plan = plan_slide(0, ref, Patching(Target(64, magnification=10), tissue="all"))  # downsample 4 -> level 1 exactly
    assert (plan.geometry.level, plan.geometry.read_size, plan.geometry.patch_size_level0) == (1, 64, 256)
    batches = list(PatchBatches([plan], 7, lambda _: None))
    keys = [k for b in batches for k in b]
    assert [len(b) for b in batches[:-1]] == [7] * (len(batches) - 1) and len(keys) == len(plan)
    for key in keys[:: max(1, len(keys) // 9)]:
        out = reader[key]
        assert not isinstance(out, Skipped)
        image = out[1].permute(1, 2, 0).numpy()
        assert np.array_equal(image, level1[key.y // 4 : key.y // 4 + 64, key.x // 4 : key.x // 4 + 64])
    plan0 = plan_slide(0, ref, Patching(Target(64, magnification=40)))
    key = PatchKey(0, 0, slide, 0, *map(int, plan0.coords[len(plan0) // 2]), 64)
    out = reader[key]
    assert not isinstance(out, Skipped)
    expected = np.asarray(direct.read_region((key.x, key.y), 0, (64, 64)).convert("RGB"))
    assert np.array_equal(out[1].permute(1, 2, 0).numpy(), expected)


def test_objective_power_only_and_no_resolution(tmp_path: Path) -> None:
    aperio = write_slide(tmp_path / "a.svs", width=1024, height=768, vendor="aperio", objective_power=20, mpp=None)
    plan = plan_slide(0, list_slides(aperio)[0], Patching(Target(64, magnification=10)))
    assert (plan.geometry.mpp, plan.geometry.mpp_source, plan.geometry.patch_size_level0) == (0.5, "objective-power", 128)
    bare = write_slide(tmp_path / "bare.tiff", width=1024, height=768, mpp=None)
    planner = SlidePlanner(list_slides(str(tmp_path)), Patching(Target(64)))
    skipped = planner[1]
    assert isinstance(skipped, Skipped) and skipped.ref.path == bare and "no resolution metadata" in skipped.reason
    assert isinstance(SlidePlanner(list_slides(bare), Patching(Target(64, slide_mpp=0.5)))[0], SlidePlan)


def test_bag_assembler_finishes_slides_in_order() -> None:
    import torch

    def plan(position: int, n: int) -> SlidePlan:
        geo = geometry({"openslide.mpp-x": "0.5"}, (64, 64), (1.0,), Target(16), "s")
        return SlidePlan(position, SlideRef(f"s{position}", f"/s{position}"), geo,
                         np.zeros((n, 2), np.int64))

    def keys(position: int, rows: range) -> list[PatchKey]:
        return [PatchKey(position, r, f"/s{position}", 0, 0, 0, 16) for r in rows]

    bags = BagAssembler(2, torch.device("cpu"))
    for p in (plan(0, 3), plan(1, 0), plan(2, 2), Skipped(3, SlideRef("s3", "/s3"), "bad"),
              plan(4, 2)):
        bags.plan(p)
    rows = torch.arange(18.0).reshape(9, 2)
    bags.add(keys(0, range(2)), rows[:2])
    assert list(bags.finished()) == []  # slide 0 still has a row to come
    bags.add(keys(0, range(2, 3)) + keys(2, range(2)) + keys(4, range(1)), rows[2:6])
    bags.skip(4, "a tile failed")
    bags.add(keys(4, range(1, 2)), rows[6:7])  # after its failure: dropped
    out = list(bags.finished())
    assert [(f.position, None if f.features is None else f.features.tolist(), f.reason) for f in out] == [
        (0, rows[:3].tolist(), None), (1, [], None), (2, rows[3:5].tolist(), None), (3, None, "bad"),
        (4, None, "a tile failed")]
    assert out[1].features is not None and out[1].features.shape == (0, 2)
