"""Image sources for extraction: ``npy:``, ``pannuke:``, ``folder:`` and ``python:`` specs.

A source is a map-style torch Dataset whose item ``i`` is ``(image, label)``; images are read
lazily (``.npy`` files are memory-mapped, folders decode one file per item), so nothing holds the
whole image set in RAM. :class:`PreparedImages` wraps a source for the extraction DataLoader: it
applies the preprocessing in the workers and turns a failure on one item into a value (not a
worker traceback), so the main process can stop with one clear line.

Image conventions: numpy arrays are ``[H, W, C]`` with values in 0..255 (uint8, or float as the
PanNuke release ships); torch tensors are ``[C, H, W]`` floats in 0..1 (uint8 tensors are
divided by 255); PIL images are converted with ``numpy.asarray``.

PanNuke labels: class maps ``uint8 [H, W]`` with 0 = background and 1..5 = the nucleus types of
mask channels 0..4 (Neoplastic, Inflammatory, Connective, Dead, Epithelial). PanNuke keeps the
background in its *last* channel; a plain ``argmax`` would make background class 5 and map a pixel
with no channel set to Neoplastic, so the background is moved to 0 instead (the convention of
segmentation heads that treat 0 as background).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from featurestore.errors import FeatureStoreError, SourceError  # noqa: F401  (SourceError: re-exported)

PANNUKE_CLASSES = ("background", "neoplastic", "inflammatory", "connective", "dead", "epithelial")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp", ".webp")


def import_callable(target: str, what: str, error: type[FeatureStoreError] | None = None) -> Callable[..., Any]:
    """Import ``module:attr`` (attr may be dotted) for a ``python:`` spec; errors name the fix.

    The working directory is put on ``sys.path`` first, because the console script's own
    directory is there instead and users expect ``python:mymodule:factory`` to find ./mymodule.py.
    """
    fail = error or SourceError
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise fail(f"invalid {what} spec 'python:{target}': use python:MODULE:FACTORY")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as cause:  # any import-time failure is the user's module, not ours
        raise fail(
            f"cannot import module {module_name!r} for {what} 'python:{target}': "
            f"{type(cause).__name__}: {cause}. Check PYTHONPATH or run from the module's directory"
        ) from cause
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise fail(f"module {module_name!r} has no attribute {attr!r} ({what} 'python:{target}')")
        obj = getattr(obj, part)
    if not callable(obj):
        raise fail(f"{what} 'python:{target}' is not callable (got {type(obj).__name__})")
    return obj


@dataclass(frozen=True)
class Preprocessing:
    """Centre crop, then resize, then ``(x/255 - mean) / std`` per channel.

    Applied per image in the DataLoader workers, so an image's pixels never depend on the batch
    it lands in (which keeps resumed and multi-rank runs byte-identical to one pass).
    """

    crop: tuple[int, int] | None = None
    resize: tuple[int, int] | None = None
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()} | {
            "order": "crop,resize,normalize",
            "resize_mode": "bilinear-antialias",
        }

    def apply(self, image: Any, label: Any = None) -> tuple[torch.Tensor, Any]:
        """Preprocess one image; a spatial label map (same H, W) follows the crop but not the
        resize, so masks keep their pixels."""
        x = to_chw_float(image)
        if self.crop is not None:
            hw = (int(x.shape[-2]), int(x.shape[-1]))
            top, left = _crop_origin(hw, self.crop)
            rows, cols = slice(top, top + self.crop[0]), slice(left, left + self.crop[1])
            if label is not None and np.ndim(label) >= 2 and tuple(np.shape(label)[:2]) == hw:
                label = np.ascontiguousarray(np.asarray(label)[rows, cols])
            x = x[:, rows, cols]
        if self.resize is not None and tuple(x.shape[-2:]) != self.resize:
            x = F.interpolate(x[None], size=self.resize, mode="bilinear", antialias=True,
                              align_corners=False)[0]
        return self.normalize(x), label

    def normalize(self, x: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """``(x - mean) / std`` per channel of ``[3, H, W]`` or ``[B, 3, H, W]`` floats in 0..1, on
        ``x``'s device (the same float32 operations wherever it runs; ``inplace`` reuses ``x``)."""
        mean, std = self._normalization
        if mean.device != x.device:
            mean, std = mean.to(x.device), std.to(x.device)
        if inplace:
            return x.sub_(mean).div_(std)
        return (x - mean) / std

    @cached_property
    def _normalization(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Made once per worker, not per image: two small tensors were a third of a 32 px image's
        # preprocessing (9 of 25 us), which `bench extract --encoder zero` counts in its ceiling.
        return (torch.tensor(self.mean, dtype=torch.float32)[:, None, None],
                torch.tensor(self.std, dtype=torch.float32)[:, None, None])


def to_chw_float(image: Any) -> torch.Tensor:
    """Any supported image to float32 ``[3, H, W]`` in 0..1 (grey images are repeated)."""
    if isinstance(image, torch.Tensor):
        x = image.detach().cpu()
        if x.ndim == 2:
            x = x[None]
        if x.ndim == 3 and x.shape[0] not in (1, 3) and x.shape[-1] in (1, 3):
            x = x.movedim(-1, 0)  # HWC tensor
        x = x.float() / 255.0 if image.dtype == torch.uint8 else x.float()
    else:
        array = np.asarray(image)
        if array.ndim == 2:
            array = array[..., None]
        if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
            raise SourceError(f"image of shape {array.shape} is not [H, W, 3] RGB")
        # Copy out of the memory map: the loader must own what it hands to torch.
        x = torch.from_numpy(np.array(array[..., :3], dtype=np.float32)).movedim(-1, 0) / 255.0
    if x.ndim != 3 or x.shape[0] not in (1, 3):
        raise SourceError(f"image tensor of shape {tuple(x.shape)} is not [3, H, W]")
    return x.expand(3, -1, -1).contiguous() if x.shape[0] == 1 else x


def _crop_origin(hw: tuple[int, int], size: tuple[int, int]) -> tuple[int, int]:
    (h, w), (ch, cw) = hw, size
    if ch > h or cw > w:
        raise SourceError(f"--crop {ch} {cw} is larger than the image ({h}x{w}); use a smaller crop")
    return (h - ch) // 2, (w - cw) // 2


class ImageSource(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Base class: ``len``, ``load(i) -> (image, label | None)``, label layout, ids, fingerprint."""

    spec: str = ""
    label_shape: tuple[int, ...] | None = None  # None: the source has no labels
    label_dtype: str | None = None
    label_info: dict[str, Any] | None = None
    ids: list[str] | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def load(self, index: int) -> tuple[Any, Any]:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.load(index)

    def fingerprint(self) -> str:
        """A cheap identity of the input data, part of the split's cache key."""
        raise NotImplementedError

    def input_files(self, start: int, stop: int) -> list[str]:
        """The files samples ``[start, stop)`` are read from (extract.input_check); none for
        sources that are not files (``python:``)."""
        return []


def _load_npy(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise SourceError(f"{what} file {path!r} does not exist")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise SourceError(f"cannot read {what} {path!r} as a .npy array ({error}); "
                          "save it with numpy.save") from error


def _file_fingerprint(path: str, array: np.ndarray) -> str:
    """Shape, dtype and sampled bytes (head, tail and 16 strided 64 KiB windows): changing any
    image region of meaningful size changes it, without hashing gigabytes on every run."""
    h = hashlib.sha256(f"{array.shape}|{array.dtype.str}|{os.path.getsize(path)}".encode())
    size = os.path.getsize(path)
    window = 1 << 16
    with open(path, "rb") as f:
        for offset in sorted({0, max(0, size - window), *[size * k // 17 for k in range(1, 17)]}):
            f.seek(offset)
            h.update(f.read(window))
    return h.hexdigest()


def _check_images(array: np.ndarray, path: str) -> None:
    if array.ndim != 4 or array.shape[-1] != 3:
        raise SourceError(f"images in {path!r} have shape {array.shape}; expected [N, H, W, 3]")
    if array.dtype != np.uint8 and array.dtype.kind != "f":
        raise SourceError(f"images in {path!r} have dtype {array.dtype}; expected uint8 (or float 0..255)")
    if array.shape[0] == 0:
        raise SourceError(f"images in {path!r} hold no samples")


class NpySource(ImageSource):
    """``npy:IMAGES.npy``: uint8 ``[N, H, W, 3]``, optional labels ``[N, ...]`` from a second file."""

    def __init__(self, path: str, labels_path: str | None = None) -> None:
        self.spec = f"npy:{path}"
        self.path = path
        self.images = _load_npy(path, "images")
        _check_images(self.images, path)
        self.labels_path = labels_path
        self.labels: np.ndarray | None = None
        if labels_path:
            self.labels = _load_npy(labels_path, "labels")
            if self.labels.shape[:1] != self.images.shape[:1]:
                raise SourceError(f"labels {labels_path!r} have {self.labels.shape[0] if self.labels.ndim else 0} "
                                  f"rows but images {path!r} have {len(self.images)}; they must match")
            self.label_shape = tuple(self.labels.shape[1:])
            self.label_dtype = self.labels.dtype.name

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def load(self, index: int) -> tuple[Any, Any]:
        label = None if self.labels is None else np.array(self.labels[index])
        return self.images[index], label

    def input_files(self, start: int, stop: int) -> list[str]:
        return [self.path] + ([self.labels_path] if self.labels_path else [])

    def fingerprint(self) -> str:
        parts = [_file_fingerprint(self.path, self.images)]
        if self.labels is not None and self.labels_path:
            parts.append(_file_fingerprint(self.labels_path, self.labels))
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


class PanNukeSource(ImageSource):
    """``pannuke:DIR``: one PanNuke fold (``images.npy``, ``masks.npy``, ``types.npy``)."""

    def __init__(self, directory: str) -> None:
        self.spec = f"pannuke:{directory}"
        if not os.path.isdir(directory):
            raise SourceError(f"PanNuke directory {directory!r} does not exist")
        self.images_path = os.path.join(directory, "images.npy")
        self.masks_path = os.path.join(directory, "masks.npy")
        self.images = _load_npy(self.images_path, "PanNuke images")
        _check_images(self.images, self.images_path)
        self.masks = _load_npy(self.masks_path, "PanNuke masks")
        n, h, w = self.images.shape[:3]
        if self.masks.shape != (n, h, w, 6):
            raise SourceError(f"PanNuke masks {self.masks_path!r} have shape {self.masks.shape}; "
                              f"expected {(n, h, w, 6)} to match the images")
        self.types_path = types_path = os.path.join(directory, "types.npy")
        tissues: Sequence[Any] = [""] * n
        if os.path.isfile(types_path):
            tissues = np.load(types_path, allow_pickle=False)
            if len(tissues) != n:
                raise SourceError(f"PanNuke types {types_path!r} have {len(tissues)} rows, expected {n}")
        self.ids = [f"{i:05d}-{t}" if t else f"{i:05d}" for i, t in enumerate(map(str, tissues))]
        self.label_shape = (h, w)
        self.label_dtype = "uint8"
        self.label_info = {"kind": "class_map", "classes": list(PANNUKE_CLASSES),
                           "from": "masks.npy: nucleus channels 0-4 -> ids 1-5, background channel 5 -> 0"}

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def load(self, index: int) -> tuple[Any, Any]:
        return self.images[index], pannuke_class_map(self.masks[index])

    def input_files(self, start: int, stop: int) -> list[str]:
        return [self.images_path, self.masks_path] + ([self.types_path] if os.path.isfile(self.types_path) else [])

    def fingerprint(self) -> str:
        parts = [_file_fingerprint(self.images_path, self.images), _file_fingerprint(self.masks_path, self.masks)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()


def pannuke_class_map(mask: np.ndarray) -> np.ndarray:
    """``[H, W, 6]`` PanNuke mask -> ``uint8 [H, W]``: 0 background, 1..5 nucleus type."""
    nuclei = np.asarray(mask[..., :5]) > 0
    return np.where(nuclei.any(axis=-1), nuclei.argmax(axis=-1) + 1, 0).astype(np.uint8)


class FolderSource(ImageSource):
    """``folder:DIR``: ``DIR/<class>/<image>``; class ids follow the sorted class names."""

    def __init__(self, directory: str) -> None:
        self.spec = f"folder:{directory}"
        if not os.path.isdir(directory):
            raise SourceError(f"image folder {directory!r} does not exist")
        try:
            import PIL.Image  # noqa: F401
        except ImportError as error:
            raise SourceError("folder: sources decode images with Pillow: pip install pillow") from error
        self.root = directory
        self.classes = sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith("."))
        self.files: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            for dirpath, _, filenames in sorted(os.walk(os.path.join(directory, name))):
                for filename in sorted(filenames):
                    if filename.lower().endswith(IMAGE_SUFFIXES):
                        self.files.append((os.path.relpath(os.path.join(dirpath, filename), directory), label))
        if not self.files:
            raise SourceError(f"image folder {directory!r} has no images in class sub-folders "
                              f"(expected DIR/<class>/<image>{IMAGE_SUFFIXES[0]})")
        self.ids = [path for path, _ in self.files]
        self.label_shape = ()
        self.label_dtype = "int32"
        self.label_info = {"kind": "class_id", "classes": self.classes}

    def __len__(self) -> int:
        return len(self.files)

    def load(self, index: int) -> tuple[Any, Any]:
        import PIL.Image

        relpath, label = self.files[index]
        path = os.path.join(self.root, relpath)
        try:
            with PIL.Image.open(path) as image:
                return np.asarray(image.convert("RGB")), np.int32(label)
        except (OSError, PIL.Image.DecompressionBombError) as error:
            raise SourceError(f"cannot decode image file {path!r}: {error}") from error

    def input_files(self, start: int, stop: int) -> list[str]:
        return [os.path.join(self.root, self.files[i][0]) for i in range(start, stop)]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for relpath, label in self.files:
            stat = os.stat(os.path.join(self.root, relpath))
            h.update(f"{relpath}|{label}|{stat.st_size}\n".encode())
        return h.hexdigest()


class PythonSource(ImageSource):
    """``python:module:factory``: the factory returns a Dataset of ``(image, label)``."""

    def __init__(self, target: str) -> None:
        self.spec = f"python:{target}"
        factory = import_callable(target, "image source")
        try:
            self.dataset = factory()
        except Exception as error:
            raise SourceError(f"image source factory 'python:{target}' failed: "
                              f"{type(error).__name__}: {error}") from error
        if not hasattr(self.dataset, "__getitem__") or not hasattr(self.dataset, "__len__"):
            raise SourceError(f"'python:{target}' returned {type(self.dataset).__name__}, not a map-style Dataset")
        if len(self.dataset) == 0:
            raise SourceError(f"image source 'python:{target}' is empty")
        _, label = self.load(0)
        if label is not None:
            array = np.asarray(label.numpy() if isinstance(label, torch.Tensor) else label)
            self.label_shape, self.label_dtype = tuple(array.shape), array.dtype.name
        ids = getattr(self.dataset, "ids", None)
        self.ids = [str(i) for i in ids] if ids is not None else None

    def __len__(self) -> int:
        return len(self.dataset)

    def load(self, index: int) -> tuple[Any, Any]:
        item = self.dataset[index]
        if isinstance(item, tuple) and len(item) == 2:
            return item
        return item, None

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.spec}|{len(self)}".encode()).hexdigest()


def open_source(spec: str, *, labels: str | None = None) -> ImageSource:
    """Parse an image SOURCE spec (see docs/EXTRACT.md)."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise SourceError(f"invalid image source {spec!r}: use npy:FILE.npy, pannuke:DIR, folder:DIR "
                          "or python:MODULE:FACTORY")
    if labels and kind != "npy":
        raise SourceError(f"--labels applies to npy: sources only; {kind}: sources carry their own labels")
    if kind == "npy":
        return NpySource(rest, labels)
    if kind == "pannuke":
        return PanNukeSource(rest)
    if kind == "folder":
        return FolderSource(rest)
    if kind == "python":
        return PythonSource(rest)
    raise SourceError(f"unknown image source kind {kind!r} in {spec!r}: use npy:, pannuke:, folder: or python:")


@dataclass
class Failure:
    """An item that could not be loaded; carried to the main process as a value."""

    index: int
    message: str


class PreparedImages(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``(index, image [3,H,W] float32, label)`` per item, preprocessed in the worker."""

    def __init__(self, source: ImageSource, preprocessing: Preprocessing) -> None:
        self.source = source
        self.preprocessing = preprocessing

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, Any] | Failure:
        try:
            image, label = self.source.load(index)
            x, label = self.preprocessing.apply(image, label)
            return index, x, label
        except FeatureStoreError as error:
            return Failure(index, str(error))
        except Exception as error:  # a user dataset's bug: report it on one line, not a worker dump
            return Failure(index, f"loading image {index} from {self.source.spec} failed: "
                                  f"{type(error).__name__}: {error}")


def collate(items: list[tuple[int, torch.Tensor, Any] | Failure]) -> tuple[list[int], torch.Tensor, Any] | Failure:
    """Stack one batch; the first failure (or a size mismatch) becomes the batch's value."""
    for item in items:
        if isinstance(item, Failure):
            return item
    good: list[tuple[int, torch.Tensor, Any]] = items  # type: ignore[assignment]
    shapes = {tuple(x.shape) for _, x, _ in good}
    if len(shapes) > 1:
        return Failure(good[0][0], f"images in one batch differ in size {sorted(shapes)}; "
                                   "pass --resize H W (or --crop) so every image has one size, and --overwrite "
                                   "if this run already made the split (the size is part of its cache key)")
    indices = [i for i, _, _ in good]
    images = torch.stack([x for _, x, _ in good])
    labels = None
    if good[0][2] is not None:
        labels = np.stack([np.asarray(lab.numpy() if isinstance(lab, torch.Tensor) else lab) for _, _, lab in good])
    return indices, images, labels
