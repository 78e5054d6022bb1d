"""A synthetic PanNuke fold in the real PanNuke file format, for tests and the demo.

The real fold (https://warwick.ac.uk/fac/cross_fac/tia/data/pannuke) is three numpy files:

* ``images.npy``: float64 ``[N, 256, 256, 3]``, RGB values in 0..255 (H&E tissue).
* ``masks.npy``: float64 ``[N, 256, 256, 6]``; channels 0-4 hold *instance ids* of the five
  nucleus types (Neoplastic, Inflammatory, Connective, Dead, Epithelial), channel 5 is the
  background (1 where no nucleus, 0 elsewhere).
* ``types.npy``: ``[N]`` tissue-type strings (``"Breast"``, ``"Colon"``, ...).

Here the background is pink eosin-like tissue and the nuclei are purple blobs whose colour and
size depend on the nucleus type, so a linear probe on frozen features can learn the type. The
generator is numpy only (no torch) and vectorised per blob, so 64 images take well under 2 s.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

NUCLEUS_TYPES = ("Neoplastic", "Inflammatory", "Connective", "Dead", "Epithelial")
TISSUE_TYPES = ("Breast", "Colon", "Lung", "Kidney", "Prostate", "Skin", "Stomach", "Liver")


@dataclass(frozen=True)
class _NucleusLook:
    rgb: tuple[float, float, float]
    radius: tuple[float, float]  # min, max radius in pixels
    elongation: tuple[float, float]  # min, max ratio of the long to the short axis


# One look per nucleus type: distinct colour and size, so the type is visible to an encoder.
_LOOKS = (
    _NucleusLook((75.0, 35.0, 120.0), (9.0, 12.0), (1.0, 1.3)),  # Neoplastic: large, dark
    _NucleusLook((35.0, 25.0, 85.0), (3.5, 5.0), (1.0, 1.1)),  # Inflammatory: small, darkest
    _NucleusLook((150.0, 75.0, 165.0), (4.0, 6.0), (2.2, 3.0)),  # Connective: spindle, pale
    _NucleusLook((185.0, 120.0, 185.0), (2.5, 4.0), (1.0, 1.2)),  # Dead: tiny, faded
    _NucleusLook((115.0, 45.0, 150.0), (6.5, 8.5), (1.2, 1.6)),  # Epithelial: medium, magenta
)
_BACKGROUND_RGB = np.array([232.0, 168.0, 200.0])


def make_synthetic_pannuke(
    directory: str | os.PathLike[str],
    n: int,
    size: int = 256,
    seed: int = 0,
    *,
    image_dtype: str = "float64",
    nuclei_per_image: tuple[int, int] = (8, 20),
) -> str:
    """Write ``images.npy``, ``masks.npy`` and ``types.npy`` for ``n`` images into ``directory``.

    ``image_dtype`` is ``"float64"`` (as the real release ships) or ``"uint8"``. Returns the
    directory path. Deterministic for a given ``(n, size, seed)``.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, but got: {n!r}")
    if not isinstance(size, int) or size < 32:
        raise ValueError(f"size must be an integer >= 32, but got: {size!r}")
    if image_dtype not in ("float64", "uint8"):
        raise ValueError(f"image_dtype must be 'float64' or 'uint8', but got: {image_dtype!r}")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)

    tissues = rng.choice(len(TISSUE_TYPES), size=n)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    # Streamed image by image into the .npy files (header, then rows), so a large n never sits in
    # RAM; sequential writes are also several times faster than filling a fresh memmap.
    with _NpyStream(os.path.join(directory, "images.npy"), image_dtype, (n, size, size, 3)) as images, \
            _NpyStream(os.path.join(directory, "masks.npy"), "float64", (n, size, size, 6)) as masks:
        for i in range(n):
            image, mask = _one_image(rng, size, yy, xx, nuclei_per_image, dominant=int(tissues[i]) % 5)
            # The real release stores whole numbers as float64; rounding keeps uint8 and float64
            # folds decoding to the same pixels.
            images.append(np.clip(np.rint(image), 0, 255).astype(image_dtype))
            masks.append(mask)
    np.save(os.path.join(directory, "types.npy"), np.array([TISSUE_TYPES[t] for t in tissues]))
    return directory


class _NpyStream:
    """Write a ``.npy`` file of known shape row by row."""

    def __init__(self, path: str, dtype: str, shape: tuple[int, ...]) -> None:
        self._file = open(path, "wb")
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                  "shape": shape}
        np.lib.format.write_array_header_1_0(self._file, header)

    def append(self, row: np.ndarray) -> None:
        self._file.write(np.ascontiguousarray(row).tobytes())

    def __enter__(self) -> _NpyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def _one_image(
    rng: np.random.Generator,
    size: int,
    yy: np.ndarray,
    xx: np.ndarray,
    count_range: tuple[int, int],
    dominant: int,
) -> tuple[np.ndarray, np.ndarray]:
    # Low-frequency shading plus pixel noise: tissue is not a flat colour.
    shade = 1.0 + 0.06 * np.sin(xx / rng.uniform(12, 30) + rng.uniform(0, 6)) * np.cos(
        yy / rng.uniform(12, 30)
    )
    image = _BACKGROUND_RGB[None, None, :] * shade[..., None]
    image = image + 6.0 * rng.standard_normal(size=(size, size, 3), dtype=np.float32)
    mask = np.zeros((size, size, 6), np.float64)
    occupied = np.zeros((size, size), bool)

    count = int(rng.integers(count_range[0], count_range[1] + 1))
    # Each tissue favours one nucleus type, as real tissue does (tumour vs. stroma vs. immune).
    weights = np.full(5, 1.0)
    weights[dominant] = 3.0
    kinds = rng.choice(5, size=count, p=weights / weights.sum())
    instance = 0
    for kind in kinds:
        look = _LOOKS[int(kind)]
        radius = rng.uniform(*look.radius)
        ratio = rng.uniform(*look.elongation)
        angle = rng.uniform(0, np.pi)
        cy, cx = rng.uniform(radius + 1, size - radius - 1, size=2)
        # Work on the blob's bounding box only: per-blob cost is independent of the image size.
        reach = int(np.ceil(radius * ratio)) + 2
        y0, y1 = max(0, int(cy) - reach), min(size, int(cy) + reach + 1)
        x0, x1 = max(0, int(cx) - reach), min(size, int(cx) + reach + 1)
        dy, dx = yy[y0:y1, x0:x1] - cy, xx[y0:y1, x0:x1] - cx
        u = dx * np.cos(angle) + dy * np.sin(angle)
        v = -dx * np.sin(angle) + dy * np.cos(angle)
        inside = (u / (radius * ratio)) ** 2 + (v / radius) ** 2 <= 1.0
        inside &= ~occupied[y0:y1, x0:x1]  # nuclei do not overlap, as in PanNuke's masks
        if not inside.any():
            continue
        instance += 1
        occupied[y0:y1, x0:x1] |= inside
        mask[y0:y1, x0:x1, int(kind)][inside] = instance
        colour = np.asarray(look.rgb) + rng.normal(0.0, 8.0, size=3)
        texture = rng.normal(0.0, 10.0, size=(int(inside.sum()), 3))
        image[y0:y1, x0:x1][inside] = colour[None, :] + texture
    mask[..., 5] = (~occupied).astype(np.float64)
    return image, mask
