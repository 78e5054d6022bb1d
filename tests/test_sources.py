"""Image sources: npy, synthetic PanNuke in the real file format, folder, python; preprocessing."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from featurestore.demo.synthetic import NUCLEUS_TYPES, make_synthetic_pannuke
from featurestore.extract.sources import (
    PANNUKE_CLASSES,
    Failure,
    FolderSource,
    NpySource,
    PanNukeSource,
    PreparedImages,
    Preprocessing,
    SourceError,
    collate,
    open_source,
    pannuke_class_map,
)


@pytest.fixture(scope="module")
def fold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_synthetic_pannuke(tmp_path_factory.mktemp("fold"), 12, size=64, seed=3))


def test_synthetic_fold_has_the_real_pannuke_format(fold: Path) -> None:
    images = np.load(fold / "images.npy")
    masks = np.load(fold / "masks.npy")
    types = np.load(fold / "types.npy")
    assert images.dtype == np.float64 and images.shape == (12, 64, 64, 3)
    assert masks.dtype == np.float64 and masks.shape == (12, 64, 64, 6)
    assert types.shape == (12,) and types.dtype.kind == "U"
    assert images.min() >= 0 and images.max() <= 255 and np.array_equal(images, np.rint(images))
    nuclei = masks[..., :5]
    # Background channel is 1 exactly where no nucleus channel holds an instance id.
    assert np.array_equal(masks[..., 5] == 1, (nuclei > 0).sum(-1) == 0)
    assert set(np.unique(masks[..., 5])) <= {0.0, 1.0}
    assert ((nuclei > 0).sum(-1) <= 1).all()  # no overlaps
    ids = nuclei.max(-1)
    assert ids.max() >= 5  # instance ids, not a binary mask


def test_synthetic_fold_is_deterministic_and_uint8_matches(tmp_path: Path) -> None:
    a = make_synthetic_pannuke(tmp_path / "a", 3, size=64, seed=1)
    b = make_synthetic_pannuke(tmp_path / "b", 3, size=64, seed=1, image_dtype="uint8")
    ia, ib = np.load(Path(a) / "images.npy"), np.load(Path(b) / "images.npy")
    assert ib.dtype == np.uint8 and np.array_equal(ia, ib)
    assert np.array_equal(np.load(Path(a) / "masks.npy"), np.load(Path(b) / "masks.npy"))
    c = make_synthetic_pannuke(tmp_path / "c", 3, size=64, seed=2)
    assert not np.array_equal(ia, np.load(Path(c) / "images.npy"))


def test_synthetic_fold_is_fast_and_types_are_visible(tmp_path: Path) -> None:
    start = time.perf_counter()
    make_synthetic_pannuke(tmp_path, 64, seed=0)
    assert time.perf_counter() - start < 2.0 * 2  # 2 s target, x2 slack for a loaded CI machine
    images = np.load(tmp_path / "images.npy", mmap_mode="r")[:16]
    labels = np.stack([pannuke_class_map(m) for m in np.load(tmp_path / "masks.npy", mmap_mode="r")[:16]])
    means = {c: images[labels == c].mean(0) for c in range(6) if (labels == c).any()}
    assert len(means) == 6
    # Every nucleus type has its own colour, well apart from the others and from the background.
    for a in means:
        for b in means:
            if a < b:
                assert np.abs(means[a] - means[b]).max() > 15, (PANNUKE_CLASSES[a], PANNUKE_CLASSES[b])
    # ... and its own size: mean instance area per type (large neoplastic, small inflammatory).
    masks = np.load(tmp_path / "masks.npy", mmap_mode="r")[:16]
    area = {}
    for t in range(len(NUCLEUS_TYPES)):
        channel = masks[..., t]
        instances = sum(len(np.unique(m[m > 0])) for m in channel)
        area[NUCLEUS_TYPES[t]] = (channel > 0).sum() / max(1, instances)
    assert area["Neoplastic"] > 2 * area["Inflammatory"]
    assert area["Epithelial"] > area["Dead"]


def test_pannuke_class_map_moves_background_to_zero() -> None:
    mask = np.zeros((2, 3, 6))
    mask[..., 5] = 1
    mask[0, 0] = [7, 0, 0, 0, 0, 0]  # neoplastic instance 7 -> class 1
    mask[0, 1] = [0, 0, 0, 0, 3, 0]  # epithelial -> class 5
    mask[1, 2] = [0, 0, 0, 0, 0, 0]  # no channel set at all -> background, not neoplastic
    out = pannuke_class_map(mask)
    assert out.dtype == np.uint8
    assert out.tolist() == [[1, 5, 0], [0, 0, 0]]


def test_pannuke_source_labels_ids_and_preprocessing(fold: Path) -> None:
    source = open_source(f"pannuke:{fold}")
    assert isinstance(source, PanNukeSource) and len(source) == 12
    assert source.label_shape == (64, 64) and source.label_dtype == "uint8"
    assert source.label_info is not None and source.label_info["classes"][0] == "background"
    types = np.load(fold / "types.npy")
    assert source.ids is not None and source.ids[3] == f"00003-{types[3]}"
    prepared = PreparedImages(source, Preprocessing(crop=(48, 48), resize=(32, 32), mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)))
    index, x, label = prepared[3]  # type: ignore[misc]
    assert index == 3 and x.shape == (3, 32, 32) and x.dtype == torch.float32
    masks = np.load(fold / "masks.npy")
    # The label map follows the crop (8 pixels each side), not the resize.
    assert np.array_equal(label, pannuke_class_map(masks[3])[8:56, 8:56])
    image = torch.from_numpy(np.load(fold / "images.npy")[3, 8:56, 8:56].astype(np.float32)).permute(2, 0, 1) / 255
    expected = torch.nn.functional.interpolate(image[None], size=(32, 32), mode="bilinear", antialias=True, align_corners=False)[0]
    assert torch.equal(x, (expected - 0.5) / 0.25)
    assert source.fingerprint() == open_source(f"pannuke:{fold}").fingerprint()


def test_pannuke_source_refuses_mismatched_masks(tmp_path: Path, fold: Path) -> None:
    np.save(tmp_path / "images.npy", np.load(fold / "images.npy"))
    np.save(tmp_path / "masks.npy", np.zeros((12, 64, 64, 5)))
    with pytest.raises(SourceError, match="masks"):
        open_source(f"pannuke:{tmp_path}")


def test_npy_source_with_labels(tmp_path: Path) -> None:
    images = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    np.save(tmp_path / "y.npy", np.arange(5, dtype=np.int64))
    source = open_source(f"npy:{tmp_path / 'x.npy'}", labels=str(tmp_path / "y.npy"))
    assert isinstance(source, NpySource) and isinstance(source.images, np.memmap)
    assert source.label_shape == () and source.label_dtype == "int64"
    image, label = source.load(4)
    assert np.array_equal(image, images[4]) and int(label) == 4
    fp = source.fingerprint()
    np.save(tmp_path / "x.npy", images[::-1].copy())
    assert NpySource(str(tmp_path / "x.npy"), str(tmp_path / "y.npy")).fingerprint() != fp


@pytest.mark.parametrize(
    "setup, match",
    [
        ("missing", "does not exist"),
        ("garbage", "as a .npy array"),
        ("rank3", r"expected \[N, H, W, 3\]"),
        ("labels", "must match"),
        ("kind", "unknown image source kind"),
    ],
)
def test_npy_source_bad_input(tmp_path: Path, setup: str, match: str) -> None:
    path = tmp_path / "x.npy"
    labels = None
    spec = f"npy:{path}"
    if setup == "garbage":
        path.write_bytes(b"this is not a numpy file")
    elif setup == "rank3":
        np.save(path, np.zeros((4, 8, 8), np.uint8))
    elif setup == "labels":
        np.save(path, np.zeros((4, 8, 8, 3), np.uint8))
        np.save(tmp_path / "y.npy", np.zeros(3))
        labels = str(tmp_path / "y.npy")
    elif setup == "kind":
        spec = f"tiff:{path}"
    with pytest.raises(SourceError, match=match):
        open_source(spec, labels=labels)


def test_folder_source_and_a_broken_file(tmp_path: Path) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("benign", "tumour"):
        (tmp_path / cls).mkdir()
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(tmp_path / cls / f"{i}.png")
    source = open_source(f"folder:{tmp_path}")
    assert isinstance(source, FolderSource) and len(source) == 6
    assert source.label_info == {"kind": "class_id", "classes": ["benign", "tumour"]}
    assert source.ids is not None and source.ids[3] == "tumour/0.png"
    image, label = source.load(4)
    assert image.shape == (20, 24, 3) and int(label) == 1
    (tmp_path / "tumour" / "2.png").write_bytes(b"\x89PNG broken")
    prepared = PreparedImages(open_source(f"folder:{tmp_path}"), Preprocessing())
    failure = prepared[5]
    assert isinstance(failure, Failure) and "cannot decode image file" in failure.message
    assert "tumour/2.png" in failure.message and "\n" not in failure.message


class _Squares(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 16, 16), i / 4.0), i


def squares() -> _Squares:
    return _Squares()


def test_python_source_and_collate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    source = open_source("python:test_sources:squares")
    assert len(source) == 4 and source.label_shape == () and source.label_dtype == "int64"
    prepared = PreparedImages(source, Preprocessing(mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0)))
    indices, images, labels = collate([prepared[1], prepared[2]])  # type: ignore[misc]
    assert indices == [1, 2] and images.shape == (2, 3, 16, 16) and labels.tolist() == [1, 2]
    assert torch.all(images[1] == 0.5)
    with pytest.raises(SourceError, match="cannot import module"):
        open_source("python:no_such_module_xyz:factory")


def test_collate_refuses_mixed_sizes() -> None:
    a = (0, torch.zeros(3, 8, 8), None)
    b = (1, torch.zeros(3, 8, 9), None)
    out = collate([a, b])
    assert isinstance(out, Failure) and "--resize" in out.message
    assert "--overwrite if this run already made the split" in out.message  # a resume would refuse the new size
