"""Synthetic whole-slide images: pyramidal tiled TIFFs that OpenSlide opens, for tests and benches.

A slide is a white background (~240 grey, as a scanner's glass) with a few tissue-like blobs:
smooth-edged regions in H&E pinks and purples whose colour varies slowly across the blob, so
every patch of tissue looks a little different and a patch of glass is near-white with low
saturation (what the Otsu tissue detector keys on).

File layout (what OpenSlide's ``generic-tiff`` vendor reads): one tiled TIFF, the pyramid levels
in successive IFDs (level 0 first, each later one marked as a reduced image), and the level-0
resolution in the TIFF resolution tags with ResolutionUnit centimeter, which OpenSlide reports
as ``openslide.mpp-x`` / ``openslide.mpp-y``. OpenSlide does not read SubIFD pyramids of generic
TIFFs (checked with openslide-bin 4.0.1): levels go in successive IFDs.
``vendor="aperio"`` writes an Aperio-style ImageDescription (``AppMag = ...``, ``MPP = ...``)
instead, for slides whose resolution comes from the objective power. ``mpp=None`` writes a
slide without resolution metadata.

Tiles are deflate-compressed (zlib is in the standard library; JPEG would need imagecodecs).
The image is made at 1/16 scale and each pixel repeated 16 x 16 times, so level 0 is streamed
tile by tile and large slides (``bench extract --wsi``) never sit in memory whole. The default
4096 x 3072 slide with levels 1, 4, 16 is ~0.5 MB and written in well under a second.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

_GLASS = 240.0
_STAINS = np.array([[214.0, 120.0, 170.0],   # eosin pink
                    [150.0, 80.0, 160.0],    # haematoxylin purple
                    [230.0, 160.0, 190.0]])  # pale stroma


CELL = 16  # the image is made at 1/CELL scale and each pixel repeated CELL x CELL times


def _small_image(width: int, height: int, seed: int, blobs: int) -> np.ndarray:
    """The slide at 1/CELL scale: ``uint8 [ceil(height/CELL), ceil(width/CELL), 3]``."""
    rng = np.random.default_rng(seed)
    gh, gw = -(-height // CELL), -(-width // CELL)
    ys, xs = np.mgrid[0:gh, 0:gw].astype(np.float64)
    field = np.zeros((gh, gw))
    for _ in range(blobs):
        cy, cx = rng.uniform(0.2, 0.8) * gh, rng.uniform(0.2, 0.8) * gw
        ry, rx = rng.uniform(0.08, 0.2) * gh, rng.uniform(0.08, 0.2) * gw
        field = np.maximum(field, np.exp(-(((ys - cy) / ry) ** 2 + ((xs - cx) / rx) ** 2)))
    wobble = rng.standard_normal((gh // 4 + 2, gw // 4 + 2))  # ragged edges
    field += 0.15 * np.kron(wobble, np.ones((4, 4)))[:gh, :gw]
    tissue = field > 0.5
    # Colour: a mix of the three stains that drifts across the tissue, plus cell-sized speckle.
    mix = rng.dirichlet(np.ones(3), size=(gh // 8 + 2, gw // 8 + 2))
    mix = np.kron(mix, np.ones((8, 8, 1)))[:gh, :gw]
    colour = mix @ _STAINS + rng.normal(0.0, 12.0, (gh, gw, 3))
    small = np.where(tissue[..., None], colour, _GLASS + rng.normal(0.0, 2.0, (gh, gw, 3)))
    return np.clip(np.rint(small), 0, 255).astype(np.uint8)


def _upsample(small: np.ndarray, factor: int, height: int, width: int) -> np.ndarray:
    return np.ascontiguousarray(np.repeat(np.repeat(small, factor, 0), factor, 1)[:height, :width])


def slide_image(width: int = 4096, height: int = 3072, *, seed: int = 0, blobs: int = 3) -> np.ndarray:
    """The level-0 RGB image ``uint8 [height, width, 3]`` of a synthetic slide."""
    return _upsample(_small_image(width, height, seed, blobs), CELL, height, width)


def _level(small: np.ndarray, factor: int, height: int, width: int) -> np.ndarray:
    """Level ``factor`` of the slide made from its 1/CELL image, without level 0 in memory: the
    area average of CELL x CELL constant cells is the cell (for factors dividing CELL)."""
    h, w = height // factor, width // factor
    if CELL % factor == 0:
        return _upsample(small, CELL // factor, h, w)
    if factor % CELL == 0:
        return _reduce(small[: h * (factor // CELL), : w * (factor // CELL)], factor // CELL)
    return _reduce(slide_image_from(small, width, height), factor)


def slide_image_from(small: np.ndarray, width: int, height: int) -> np.ndarray:
    return _upsample(small, CELL, height, width)


def _tiles(small: np.ndarray, width: int, height: int, tile: int) -> Iterator[np.ndarray]:
    """Level 0 tile by tile, row-major, edge tiles padded to full size (as TIFF stores them)."""
    for top in range(0, height, tile):
        for left in range(0, width, tile):
            block = small[top // CELL : -(-(top + tile) // CELL), left // CELL : -(-(left + tile) // CELL)]
            pixels = _upsample(block, CELL, min(tile, height - top), min(tile, width - left))
            out = np.zeros((tile, tile, 3), np.uint8)
            out[: pixels.shape[0], : pixels.shape[1]] = pixels
            yield out


def _reduce(image: np.ndarray, factor: int) -> np.ndarray:
    """Area average by ``factor`` (a scanner's downsampled level), edges cropped to whole blocks."""
    h, w = image.shape[0] // factor, image.shape[1] // factor
    blocks = image[: h * factor, : w * factor].reshape(h, factor, w, factor, 3).astype(np.float32)
    return np.rint(blocks.mean(axis=(1, 3))).astype(np.uint8)


def write_slide(path: str | os.PathLike[str], *, width: int = 4096, height: int = 3072, mpp: float | None = 0.5,
                levels: Sequence[int] = (1, 4, 16), tile: int = 256, seed: int = 0, blobs: int = 3,
                vendor: str = "generic", objective_power: float | None = None,
                image: np.ndarray | None = None) -> str:
    """Write one synthetic slide; returns its path.

    ``mpp``: level-0 micrometres per pixel (None: no resolution metadata). ``levels``: the pyramid's
    downsamples, 1 first. ``vendor="aperio"`` writes ``AppMag`` (``objective_power``) and ``MPP``
    in an Aperio ImageDescription instead of resolution tags. ``image``: level 0 as given instead
    of the generated one.
    """
    import tifffile

    if not levels or levels[0] != 1:
        raise ValueError(f"levels must start with 1 (level 0), but got: {list(levels)}")
    if vendor not in ("generic", "aperio"):
        raise ValueError(f"vendor must be 'generic' or 'aperio', but got: {vendor!r}")
    if image is not None:
        height, width = image.shape[:2]
    elif tile % CELL:
        raise ValueError(f"tile must be a multiple of {CELL}, but got: {tile}")
    small = _small_image(width, height, seed, blobs) if image is None else None
    path = os.fspath(path)
    with tifffile.TiffWriter(path, bigtiff=width * height * 3 > 2**31) as tif:
        for i, factor in enumerate(levels):
            pixels: Any
            if image is not None:
                pixels = image if factor == 1 else _reduce(image, int(factor))
                shape = pixels.shape
            elif factor == 1:  # streamed, so a large slide never sits in memory whole
                pixels, shape = _tiles(small, width, height, tile), (height, width, 3)  # type: ignore[arg-type]
            else:
                pixels = _level(small, int(factor), height, width)  # type: ignore[arg-type]
                shape = pixels.shape
            options: dict[str, object] = {}
            if vendor == "aperio":
                h, w = shape[:2]
                fields = [f"AppMag = {objective_power:g}"] if objective_power else []
                if mpp is not None:
                    fields.append(f"MPP = {mpp:g}")
                head = f"Aperio Image Library v12.0.0\n{width}x{height} [0,0 {width}x{height}] ({tile}x{tile}) RGB"
                options["description"] = "|".join([head, *fields]) if i == 0 else f"Aperio Image Library\n{w}x{h}"
            elif mpp is not None:
                pixels_per_cm = 1e4 / (mpp * factor)
                options.update(resolution=(pixels_per_cm, pixels_per_cm), resolutionunit="CENTIMETER")
            tif.write(pixels, shape=shape, dtype=np.uint8, tile=(tile, tile), photometric="rgb",
                      compression="zlib", subfiletype=0 if i == 0 else 1, metadata=None, **options)
    return path


def write_cohort(directory: str | os.PathLike[str], n: int, *, suffix: str = ".tiff", **options: object) -> list[str]:
    """``n`` slides ``slide-000.tiff`` ... in ``directory``, each with its own seed."""
    os.makedirs(directory, exist_ok=True)
    return [write_slide(os.path.join(directory, f"slide-{i:03d}{suffix}"), seed=i, **options)  # type: ignore[arg-type]
            for i in range(n)]


__all__ = ["slide_image", "write_cohort", "write_slide"]
