"""Tissue detection on a slide's thumbnail, and each grid patch's tissue fraction (``--tissue``).

``otsu`` (the default, CLAM's recipe): a thumbnail at ``MASK_PX_PER_PATCH`` pixels per patch side
(cut from the coarsest pyramid level fine enough, so a slide costs one small read) -> HSV
saturation (glass is grey-white, stained tissue is saturated) -> median filter -> Otsu's
threshold (never below ``MIN_SATURATION``, so a blank slide keeps no noise) -> a closing that
fills holes and an opening that drops specks, both smaller than about a quarter of a patch side.
``all`` keeps every grid patch. A patch is kept when the mean of the mask over its footprint is
at least ``--min-tissue``.

numpy and Pillow only (Pillow comes with openslide-python, and its median filter is in C); the
binary erosion and dilation are separable running windows in numpy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption

TISSUE_MODES = ("otsu", "all")
MASK_PX_PER_PATCH = 8  # mask pixels along a patch side: fractions in steps of 1/64 (CLAM: ~1/64 scale)
MIN_SATURATION = 15  # of 255: the glass of a blank slide never counts as tissue
MEDIAN_SIZE = 5  # the median filter's window, in mask pixels
MAX_THUMBNAIL_PIXELS = 64 << 20  # the pyramid level a thumbnail is cut from, at most


def check_tissue_options(mode: str, min_tissue: float) -> None:
    if mode not in TISSUE_MODES:
        raise InvalidOption(f"--tissue {mode!r} is not one of {', '.join(TISSUE_MODES)}")
    if not (math.isfinite(min_tissue) and 0.0 <= min_tissue <= 1.0):
        raise InvalidOption(f"--min-tissue must be a fraction in [0, 1], but got: {min_tissue}")


def saturation(rgb: np.ndarray) -> np.ndarray:
    """HSV saturation of ``uint8 [h, w, 3]`` as ``uint8`` 0..255 (``(max - min) / max``)."""
    hi = rgb.max(axis=-1).astype(np.uint16)
    lo = rgb.min(axis=-1).astype(np.uint16)
    return np.where(hi > 0, ((hi - lo) * 255 + hi // 2) // np.maximum(hi, 1), 0).astype(np.uint8)


def otsu_threshold(values: np.ndarray) -> int:
    """Otsu's threshold of ``uint8`` values: the ``t`` maximising between-class variance of
    ``< t`` and ``>= t`` (0 for a constant image)."""
    hist = np.bincount(values.reshape(-1), minlength=256).astype(np.float64)
    total = hist.sum()
    if total == 0:
        return 0
    weight = np.cumsum(hist)  # pixels below t+1
    mass = np.cumsum(hist * np.arange(256))
    below, above = weight[:-1], total - weight[:-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        mean_below = mass[:-1] / below
        mean_above = (mass[-1] - mass[:-1]) / above
        between = below * above * (mean_below - mean_above) ** 2
    between = np.nan_to_num(between, nan=-1.0)
    return int(np.argmax(between)) + 1 if between.max() > 0 else 0


def morphology_size(px_per_patch: float) -> int:
    """The closing / opening window: an odd number of mask pixels near a quarter of a patch side."""
    return min(15, max(3, 2 * round(px_per_patch / 8) + 1))


def tissue_mask(rgb: np.ndarray, px_per_patch: float = MASK_PX_PER_PATCH) -> tuple[np.ndarray, int]:
    """``(bool [h, w] mask, saturation threshold)`` of a thumbnail (see the module docstring)."""
    from PIL import Image, ImageFilter

    size = morphology_size(px_per_patch)
    sat = Image.fromarray(saturation(rgb)).filter(ImageFilter.MedianFilter(MEDIAN_SIZE))
    values = np.asarray(sat)
    threshold = max(otsu_threshold(values), MIN_SATURATION)
    mask = values >= threshold
    closed = _erode(_dilate(mask, size), size)
    return _dilate(_erode(closed, size), size), threshold


def _window(mask: np.ndarray, size: int, reduce: Any, fill: bool) -> np.ndarray:
    """A square ``size`` window's ``reduce`` (np.any: dilation, np.all: erosion), separably: rows
    then columns, O(size) per pixel. Pixels past the edge count as ``fill``."""
    half = size // 2
    out = mask
    for axis in (0, 1):
        pad = [(0, 0), (0, 0)]
        pad[axis] = (half, half)
        padded = np.pad(out, pad, constant_values=fill)
        out = reduce(np.lib.stride_tricks.sliding_window_view(padded, size, axis=axis), axis=-1)
    return out


def _dilate(mask: np.ndarray, size: int) -> np.ndarray:
    return _window(mask, size, np.any, False)


def _erode(mask: np.ndarray, size: int) -> np.ndarray:
    # Past the edge counts as tissue here, so tissue touching the border is not eaten away.
    return _window(mask, size, np.all, True)


def patch_fractions(mask: np.ndarray, coords: np.ndarray, patch_size_level0: int, scale: tuple[float, float]) -> np.ndarray:
    """``float64 [n]``: the mean of ``mask`` over each patch's footprint; ``scale`` = mask pixels
    per level-0 pixel along (x, y). An integral image makes it O(1) per patch."""
    if len(coords) == 0:
        return np.zeros(0)
    h, w = mask.shape
    integral = np.zeros((h + 1, w + 1), dtype=np.int64)
    integral[1:, 1:] = np.cumsum(np.cumsum(mask, axis=0, dtype=np.int64), axis=1)
    sx, sy = scale
    x0 = np.clip(np.floor(coords[:, 0] * sx).astype(np.int64), 0, w - 1)
    y0 = np.clip(np.floor(coords[:, 1] * sy).astype(np.int64), 0, h - 1)
    x1 = np.clip(np.maximum(x0 + 1, np.floor((coords[:, 0] + patch_size_level0) * sx).astype(np.int64)), 1, w)
    y1 = np.clip(np.maximum(y0 + 1, np.floor((coords[:, 1] + patch_size_level0) * sy).astype(np.int64)), 1, h)
    inside = integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]
    return inside / ((x1 - x0) * (y1 - y0))


def read_thumbnail(slide: Any, patch_size_level0: int, name: str) -> tuple[np.ndarray, tuple[float, float]]:
    """The slide at ``MASK_PX_PER_PATCH`` pixels per patch side: ``(uint8 [h, w, 3], scale)``,
    cut from the coarsest level fine enough and resized (area filter)."""
    from PIL import Image

    from featurestore.extract.wsi import SlideError, read_rgb

    width, height = slide.dimensions
    downsample = max(1.0, patch_size_level0 / MASK_PX_PER_PATCH)
    size = (max(1, round(width / downsample)), max(1, round(height / downsample)))
    level = slide.get_best_level_for_downsample(downsample)
    lw, lh = slide.level_dimensions[level]
    if lw * lh > MAX_THUMBNAIL_PIXELS:
        raise SlideError(f"slide {name!r} has no pyramid level small enough for a thumbnail (level {level} is "
                         f"{lw}x{lh}); use --tissue all, or convert it to a pyramidal TIFF")
    rgb = read_rgb(slide, (0, 0), level, (lw, lh))
    if (lw, lh) != size:
        rgb = np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.BOX))
    return rgb, (size[0] / width, size[1] / height)


__all__ = ["MASK_PX_PER_PATCH", "TISSUE_MODES", "check_tissue_options", "otsu_threshold", "patch_fractions",
           "read_thumbnail", "saturation", "tissue_mask"]
