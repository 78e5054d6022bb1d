"""``featurestore extract --images wsi:...``: one bag per slide, byte-identical across runs, workers,
a SIGKILL + ``--resume`` and torchrun world sizes; bad slides skipped by name.

The cohort: three synthetic 2048 x 1536 slides at 0.5 um/px (~70 tissue patches of 64 px each at
20x), a blank slide (an empty bag) and a file that is not a slide (skipped).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("openslide")
pytest.importorskip("tifffile")

import torch  # noqa: E402
from _dist_helpers import torchrun_cli  # noqa: E402
from _import_fixtures import complete_bags  # noqa: E402
from test_extract import cli_env, run_cli  # noqa: E402

import featurestore  # noqa: E402
from featurestore.demo.slides import write_cohort, write_slide  # noqa: E402
from featurestore.errors import InvalidOption  # noqa: E402
from featurestore.extract.dist import Coordinator  # noqa: E402
from featurestore.extract.encoders import TinyViT  # noqa: E402
from featurestore.extract.wsi import Target, list_slides  # noqa: E402
from featurestore.extract.wsi_patches import Patching, plan_slide  # noqa: E402
from featurestore.extract.wsi_run import SlideOptions, extract_slides  # noqa: E402

NAME = ("cohort", "slow_tiny_vit", "train")
ROW_BYTES = 128 * 2  # tiny-vit's dim in float16
CHUNK_MB = str(16 * ROW_BYTES / 2**20)  # 16 rows per chunk: bags span chunks, records land often


class _Slow(TinyViT):
    """tiny-vit, sleeping ``FSX_SLEEP`` seconds per batch (so a test can kill a run midway)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(float(os.environ.get("FSX_SLEEP", "0")))
        return super().forward(x)


def slow_tiny_vit() -> torch.nn.Module:
    return _Slow()


def vector_encoder() -> Any:
    """An encoder that returns ``[B, D]`` (one embedding per image)."""
    return lambda x: x.mean(dim=(2, 3)) * torch.tensor([1.0, 2.0, 3.0])


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cohort")
    write_cohort(root, 3, width=2048, height=1536, mpp=0.5)
    write_slide(root / "blank.tiff", width=1024, height=768, blobs=0)
    (root / "junk.svs").write_text("not a slide")
    return root


def _opts(cohort: Path, store: Path, **kw: Any) -> SlideOptions:
    base: dict[str, Any] = dict(images=f"wsi:{cohort}", encoder="python:test_wsi_extract:slow_tiny_vit",
                                store=str(store), dataset=NAME[0], split=NAME[2], patch_size=64, batch_size=16,
                                num_workers=0, progress=False, threads=1, chunk_mb=float(CHUNK_MB))
    return SlideOptions(**{**base, **kw})


def _common(cohort: Path) -> list[str]:
    return ["--images", f"wsi:{cohort}", "--encoder", "python:test_wsi_extract:slow_tiny_vit",
            "--dataset", NAME[0], "--split", NAME[2], "--patch-size", "64", "--batch-size", "16",
            "--chunk-mb", CHUNK_MB, "--threads", "1", "--no-progress"]


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the committed split but its zarr.json documents (timestamps, generation);
    in the per-bag statistics rows and the chunk seals, the generation slot (each run of a split
    draws its own) is zeroed and the crc32c trailer that covers it dropped."""
    split = root.joinpath(*NAME)
    generation = float(int(featurestore.open_store(str(root)).split_info(*NAME).generation, 16))
    out = {}
    for p in sorted(split.rglob("*")):
        if p.is_file() and p.name != "zarr.json":
            data = p.read_bytes()
            if p.relative_to(split).parts[0] == "bag_stats":
                rows = np.frombuffer(data[:-4], "<f8").copy()
                assert (rows == generation).sum() == len(featurestore.open_store(str(root)).open_bags(*NAME).ids)
                data = np.where(rows == generation, 0.0, rows).tobytes()
            elif p.relative_to(split).parts[0] == "chunk_seals":  # (array, chunk, crc32c, generation) rows
                table = np.frombuffer(data[:-4], "<u8").reshape(-1, 4).copy()
                assert (table[:, 3] == int(generation)).all()
                table[:, 3] = 0
                data = table.tobytes()
            out[str(p.relative_to(split))] = data
    return out


def _same_split(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    for name in fa:
        assert fa[name] == fb[name], name
    ma = featurestore.open_store(str(a)).open_bags(*NAME).metadata
    mb = featurestore.open_store(str(b)).open_bags(*NAME).metadata
    for field in ("quantization", "cache_key", "token_layout", "num_samples", "bags"):
        assert ma[field] == mb[field], field


@pytest.fixture(scope="module")
def reference(cohort: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("reference")
    os.environ.pop("FSX_SLEEP", None)
    sys.path.insert(0, str(Path(__file__).parent))
    result = extract_slides(_opts(cohort, store), Coordinator())
    assert result.status == "complete"
    return store


def test_one_bag_per_slide_with_plan_coords_and_attrs(cohort: Path, reference: Path) -> None:
    bags = featurestore.open_store(str(reference)).open_bags(*NAME)
    assert list(bags.ids) == ["blank", "slide-000", "slide-001", "slide-002"]  # junk.svs skipped
    patching = Patching(Target(64, magnification=20))
    for i, ref in enumerate(list_slides(str(cohort))):
        if ref.id == "junk":
            continue
        plan = plan_slide(0, ref, patching)
        features, coords = bags.read(ref.id)
        assert features.dtype == torch.float16 and features.shape == (len(plan), 128)
        assert np.array_equal(coords.numpy(), plan.coords)
        assert (len(plan) == 0) == (ref.id == "blank")
    meta = bags.metadata
    assert [s["id"] for s in meta["skipped"]] == ["junk"] and "not a slide" in meta["skipped"][0]["reason"]
    assert meta["token_layout"]["tokens"] == "cls" and meta["token_layout"]["encoder_prefix_tokens"] == 3
    assert meta["preprocessing"]["patching"]["tissue"] == "otsu"
    assert meta["bags"]["coords"] == {"unit": "px", "dtype": "int64"}


def test_cli_skips_bad_slides_by_name_and_exits_3(cohort: Path, reference: Path, tmp_path: Path) -> None:
    """Also: 2 DataLoader workers give the bytes of the in-process run with none."""
    result = run_cli("extract", *_common(cohort), "--store", str(tmp_path / "s"), "--num-workers", "2",
                     env=cli_env(FSX_SLEEP="0"), timeout=240)
    assert result.returncode == 3, result.stderr[-2000:]
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped slide")]
    assert len(skipped) == 1 and "junk" in skipped[0] and "not a slide OpenSlide can read" in skipped[0]
    assert "4 bags of 5 slides" in result.stdout and "1 skipped" in result.stdout
    _same_split(reference, tmp_path / "s")
    again = run_cli("extract", *_common(cohort), "--store", str(tmp_path / "s"), env=cli_env(), timeout=240)
    assert again.returncode == 0 and "already complete" in again.stdout


def test_cli_error_is_one_line(cohort: Path, tmp_path: Path) -> None:
    common = _common(cohort)
    common[1] = "wsi:/nonexistent/slides"
    result = run_cli("extract", *common, "--store", str(tmp_path / "s"), timeout=240)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "slide path '/nonexistent/slides' does not exist" in result.stderr


def test_slides_too_coarse_for_the_target_are_each_skipped_by_name(cohort: Path, tmp_path: Path) -> None:
    result = extract_slides(_opts(cohort, tmp_path / "s", magnification=80))
    reasons = {s["id"]: s["reason"] for s in result.skipped}
    assert sorted(reasons) == ["blank", "junk", "slide-000", "slide-001", "slide-002"]
    assert "slide-001.tiff': --magnification 80 is finer than the scan's 20x (0.5 um/px); use --magnification 20 " \
           "or less" in reasons["slide-001"]
    with pytest.raises(InvalidOption, match="--tokens 'patch' does not apply to slides"):
        extract_slides(_opts(cohort, tmp_path / "t", tokens="patch"))


def test_tokens_mean_and_vector_encoders(cohort: Path, reference: Path, tmp_path: Path) -> None:
    one = tmp_path / "one"
    one.mkdir()
    os.symlink(cohort / "slide-001.tiff", one / "slide-001.tiff")
    mean = extract_slides(_opts(one, tmp_path / "mean", tokens="mean"))
    assert mean.metadata["token_layout"]["tokens"] == "mean" and mean.metadata["source_dtype"] == "float32"
    cls = featurestore.open_store(str(reference)).open_bags(*NAME).read("slide-001")[0]
    mean_features = featurestore.open_store(str(tmp_path / "mean")).open_bags(*NAME).read("slide-001")[0]
    assert mean_features.shape == cls.shape and not torch.equal(mean_features, cls)
    vec = extract_slides(_opts(one, tmp_path / "vec", encoder="python:test_wsi_extract:vector_encoder",
                               encoder_name=NAME[1]))
    assert vec.metadata["token_layout"]["tokens"] == "vector" and vec.metadata["sample_shape"] == [3]


def test_labels_from_a_slide_list_csv(cohort: Path, tmp_path: Path) -> None:
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,slide_id,label\n{cohort / 'slide-002.tiff'},case-b,tumor\n"
                       f"{cohort / 'slide-000.tiff'},case-a,normal\n")
    result = extract_slides(_opts(cohort, tmp_path / "s", images=f"wsi:{listing}"))
    bags = featurestore.open_store(str(tmp_path / "s")).open_bags(*NAME)
    assert list(bags.ids) == ["case-a", "case-b"] and result.metadata["label_names"] == ["normal", "tumor"]
    assert bags.labels is not None and list(np.asarray(bags.labels)) == [0, 1]


def test_a_tile_that_fails_to_decode_skips_its_slide_only(cohort: Path, reference: Path, tmp_path: Path) -> None:
    """The slide's plan is made (from a low level), then a level-0 tile under a kept patch is
    garbage: its bag is dropped mid-slide, the slides around it are written as in a clean run."""
    import tifffile

    damaged = tmp_path / "cohort"
    damaged.mkdir()
    for name in ("slide-000.tiff", "slide-002.tiff"):
        os.symlink(cohort / name, damaged / name)
    bad = damaged / "slide-001.tiff"
    bad.write_bytes((cohort / "slide-001.tiff").read_bytes())
    plan = plan_slide(0, list_slides(str(bad))[0], Patching(Target(64, magnification=20)))
    x, y = (int(v) for v in plan.coords[len(plan) // 2])
    with tifffile.TiffFile(bad) as tif:
        page = tif.pages[0]
        tile = (y // 256) * -(-page.imagewidth // 256) + x // 256
        offset, size = page.dataoffsets[tile], page.databytecounts[tile]
    with open(bad, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff" * size)
    result = extract_slides(_opts(damaged, tmp_path / "s"))
    assert [s["id"] for s in result.skipped] == ["slide-001"]
    assert "cannot read slide" in result.skipped[0]["reason"] and "slide-001.tiff" in result.skipped[0]["reason"]
    ours = featurestore.open_store(str(tmp_path / "s")).open_bags(*NAME)
    theirs = featurestore.open_store(str(reference)).open_bags(*NAME)
    assert list(ours.ids) == ["slide-000", "slide-002"]
    for bag in ours.ids:
        assert all(torch.equal(a, b) for a, b in zip(ours.read(bag), theirs.read(bag)))


def test_sigkill_then_resume_is_byte_identical(cohort: Path, reference: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    process = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "extract", *_common(cohort),
                                "--store", str(store), "--num-workers", "1"],
                               env=cli_env(FSX_SLEEP="0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None and complete_bags(store, NAME) < 1:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed: slow the encoder down"
        seen = complete_bags(store, NAME)
        assert seen >= 1, "no complete bag within 120 s"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert featurestore.open_store(str(store)).split_status(*NAME) == "writing"
    resumed = run_cli("extract", *_common(cohort), "--store", str(store), "--resume", env=cli_env(), timeout=240)
    assert resumed.returncode == 3, resumed.stderr[-2000:]
    bags = int(re.search(r"(\d+) bags? of 5 slides", resumed.stdout).group(1))  # type: ignore[union-attr]
    assert bags <= 4 - seen  # the bags complete before the kill (at least those seen) were not redone
    _same_split(reference, store)


def test_torchrun_two_ranks_equal_one_process(cohort: Path, reference: Path, tmp_path: Path) -> None:
    """Slide i goes to rank i % 2; each rank adds its bags in its own writer session."""
    process = torchrun_cli("extract", *_common(cohort), "--store", str(tmp_path / "multi"), "--num-workers", "0",
                           env=cli_env())
    stdout, stderr = process.stdout, process.stderr
    # torchrun reports a rank's non-zero exit as a failure: exit 3 (slides skipped) shows up as 1.
    assert stdout.count("extracted cohort/") == 1 and "4 bags of 5 slides" in stdout, stderr[-3000:]
    _same_split(reference, tmp_path / "multi")


def test_bench_extract_wsi_runs(tmp_path: Path) -> None:
    """``featurestore bench extract --wsi`` end to end on one small slide (figures not asserted)."""
    result = run_cli("bench", "extract", "--wsi", "--slides", "1", "--slide-size", "2048", "1536", "--repeats", "1",
                     "--patch-size", "64", "--num-workers", "0", "--workdir", str(tmp_path), "--json",
                     str(tmp_path / "out.json"), timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OpenSlide alone" in result.stdout and (tmp_path / "out.json").is_file()


def test_an_incomplete_split_without_resume_is_the_one_line_advice(cohort: Path, tmp_path: Path) -> None:
    """Into a split that exists but is incomplete, an extraction without --resume says so in one
    line (it used to read the writer's metadata before the ranks agreed, while the writer was None,
    and died with an AttributeError)."""
    store = tmp_path / "s"
    featurestore.open_store(str(store), mode="a").create_bag_split(*NAME, dim=128).close()
    result = run_cli("extract", *_common(cohort), "--store", str(store), env=cli_env(), timeout=240)
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "split cohort/slow_tiny_vit/train exists but is incomplete (status 'writing'): pass --resume" in result.stderr
    assert featurestore.open_store(str(store)).split_status(*NAME) == "writing"


def test_a_flipped_byte_is_repaired_by_extract_resume_verify_chunks(cohort: Path, reference: Path,
                                                                     tmp_path: Path) -> None:
    """The advised repair of a slide split: the slides whose bags have rows in the damaged chunk
    are encoded again, only their chunks are written, and the split has the reference's bytes
    (the slide skipped before stays skipped, and listed)."""
    import shutil

    store = tmp_path / "store"
    shutil.copytree(reference, store)
    split = store.joinpath(*NAME)
    rows = featurestore.open_store(str(store)).open_bags(*NAME).rows_of("slide-001")
    damaged = int(rows[len(rows) // 2]) // 16  # a chunk inside slide-001's rows only
    raw = bytearray((split / "features" / "c" / str(damaged) / "0").read_bytes())
    raw[5] ^= 0x10
    (split / "features" / "c" / str(damaged) / "0").write_bytes(bytes(raw))
    before = {p: p.stat().st_mtime_ns for p in split.rglob("*") if p.is_file()}
    result = run_cli("extract", *_common(cohort), "--store", str(store), "--resume", "--verify-chunks",
                     env=cli_env(), timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1 bag of 5 slides" in result.stdout, result.stdout
    check = run_cli("verify", str(store), timeout=120)
    assert check.returncode == 0 and "cohort/slow_tiny_vit/train: ok (" in check.stdout, check.stdout + check.stderr
    _same_split(reference, store)
    written = {p.relative_to(split).as_posix() for p in split.rglob("*")
               if p.is_file() and p.stat().st_mtime_ns != before.get(p)}
    first, last = int(rows[0]) // 16, int(rows[-1]) // 16
    assert written == {"zarr.json"} | {f"{a}/c/{i}/0" for a in ("features", "coords", "block_seals") for i in range(first, last + 1)}
    meta = featurestore.open_store(str(store)).open_bags(*NAME).metadata
    assert [s["id"] for s in meta["skipped"]] == ["junk"]


def test_a_slide_split_records_the_magnification_a_slide_encoder_asks_for(reference: Path) -> None:
    """A slide encoder that requires magnification 20 accepts the bags of a 20x extraction (the
    requirement read another key than extraction writes, so every such encoder was refused)."""
    from featurestore.embed.slide_encoders import recorded_magnification

    bags = featurestore.open_store(str(reference)).open_bags(*NAME)
    assert recorded_magnification(bags.metadata) == 20.0


def test_a_slide_changed_on_disk_since_its_bag_was_made_is_refused(cohort: Path, tmp_path: Path) -> None:
    """A slide re-scanned under its name: --resume and a re-run kept its old bag without a word (a
    split of two scans); now InputChanged names the file, as for the other sources."""
    import shutil

    from featurestore.errors import InputChanged

    slides = tmp_path / "slides"
    shutil.copytree(cohort, slides)  # mtimes kept: older than the split
    store = tmp_path / "store"
    assert extract_slides(_opts(slides, store), Coordinator()).status == "complete"
    assert extract_slides(_opts(slides, store, resume=True), Coordinator()).status == "already-complete"
    changed = sorted(slides.glob("slide-*.tiff"))[1]
    later = time.time() + 5
    os.utime(changed, (later, later))
    with pytest.raises(InputChanged, match=f"input file {changed} was modified at .* after split"):
        extract_slides(_opts(slides, store, resume=True), Coordinator())
