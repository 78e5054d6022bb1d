"""Feature pictures, in numpy only: the first principal components of a sample's patch tokens as
an RGB image (the figure of DINOv2's paper), and a slide map of a bag's patches coloured by their
first principal component.

The components come from a randomized subspace iteration (Halko, Martinsson & Tropp 2011,
https://arxiv.org/abs/0909.4061, algorithm 4.4): a few ``[n, d] @ [d, 8]`` products instead of a
``[d, d]`` covariance, so a ``[1024, 3072]`` sample takes ~20 ms, not the ~1 s of a full SVD. Fits
use at most ``FIT_ROWS`` rows (evenly spaced); projecting every row is one more product.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

FIT_ROWS = 4096
_OVERSAMPLE = 5
_ITERATIONS = 2
# Blocks of rows converted to float32 at a time when projecting a large bag: memory stays at the
# stored rows plus one block.
_BLOCK_ROWS = 8192

# Viridis at nine stops (matplotlib's _cm_listed.py), interpolated to a 256-entry table.
_VIRIDIS_STOPS = np.array([
    [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]], np.float64)  # fmt: skip
VIRIDIS = np.stack(
    [np.interp(np.linspace(0, 1, 256), np.linspace(0, 1, len(_VIRIDIS_STOPS)), _VIRIDIS_STOPS[:, c])
     for c in range(3)], axis=1).round().astype(np.uint8)  # fmt: skip


@dataclass(frozen=True)
class Components:
    """A fitted basis: ``mean`` [d], ``axes`` [k, d] (unit rows), ``scale`` [k, 2] (the 1st and
    99th percentile of each component over the fitted rows, the colour range)."""

    mean: np.ndarray
    axes: np.ndarray
    scale: np.ndarray

    def project(self, rows: np.ndarray) -> np.ndarray:
        """``[n, d]`` stored rows (float32 or float16) -> ``[n, k]`` float32, block by block."""
        out = np.empty((len(rows), len(self.axes)), np.float32)
        for start in range(0, len(rows), _BLOCK_ROWS):
            block = np.asarray(rows[start : start + _BLOCK_ROWS], np.float32) - self.mean
            out[start : start + len(block)] = block @ self.axes.T
        return out

    def unit(self, projected: np.ndarray) -> np.ndarray:
        """Each component mapped to [0, 1] by the fitted percentiles (clipped)."""
        lo, hi = self.scale[:, 0], self.scale[:, 1]
        return np.clip((projected - lo) / np.maximum(hi - lo, 1e-12), 0.0, 1.0)


def fit_components(rows: np.ndarray, k: int = 3, *, seed: int = 0) -> Components:
    """The first ``k`` principal axes of ``rows`` ([n, d], any float dtype; at most ``FIT_ROWS``
    evenly spaced rows are used). Deterministic for a given input: the random start is seeded and
    each axis's sign is fixed so that its projections have a positive third moment."""
    if rows.ndim != 2 or len(rows) == 0:
        raise ValueError(f"fit_components needs a non-empty [n, d] array, got shape {rows.shape}")
    if len(rows) > FIT_ROWS:
        rows = rows[np.linspace(0, len(rows) - 1, FIT_ROWS).round().astype(np.int64)]
    x = np.asarray(rows, np.float32)
    mean = x.mean(axis=0, dtype=np.float64).astype(np.float32)
    x = x - mean
    n, d = x.shape
    width = min(k + _OVERSAMPLE, n, d)
    if min(n, d) <= 4 * width:
        axes = np.linalg.svd(x, full_matrices=False)[2][:k]
    else:
        rng = np.random.default_rng(seed)
        basis = np.linalg.qr(x @ rng.standard_normal((d, width)).astype(np.float32))[0]
        for _ in range(_ITERATIONS):
            basis = np.linalg.qr(x @ np.linalg.qr(x.T @ basis)[0])[0]
        axes = np.linalg.svd(basis.T @ x, full_matrices=False)[2][:k]
    axes = np.asarray(axes, np.float32)
    if len(axes) < k:  # fewer rows or channels than components: the rest stay zero
        axes = np.concatenate([axes, np.zeros((k - len(axes), d), np.float32)])
    projected = x @ axes.T
    signs = np.where((projected.astype(np.float64) ** 3).sum(axis=0) < 0, -1.0, 1.0).astype(np.float32)
    axes, projected = axes * signs[:, None], projected * signs
    scale = np.percentile(projected, [1, 99], axis=0).T.astype(np.float32)
    return Components(mean=mean, axes=axes, scale=scale)


def token_grid(layout: Any, sample_shape: tuple[int, ...]) -> tuple[int, tuple[int, int]] | None:
    """``(prefix tokens, (rows, cols))`` of a ``[tokens, dim]`` sample whose tokens are a patch
    grid in row-major order, from the split's ``token_layout``; None when they are not one.

    A recorded grid counts when the token count is the grid plus the recorded prefix tokens (or
    the grid alone: ``tokens=patch`` dropped them); without a grid, a square count after the prefix
    tokens is taken as a square grid, as ``featurestore import`` infers it."""
    if len(sample_shape) != 2:
        return None
    tokens = sample_shape[0]
    layout = layout if isinstance(layout, dict) else {}
    try:
        prefix = int(layout.get("prefix_tokens") or 0)
        grid = layout.get("grid")
        if grid:
            rows, cols = int(grid[0]), int(grid[1])
            if rows * cols == tokens:
                return 0, (rows, cols)
            if rows * cols + prefix == tokens and rows > 0 and cols > 0:
                return prefix, (rows, cols)
            return None
    except (TypeError, ValueError, IndexError):
        return None
    side = int(round(max(tokens - prefix, 0) ** 0.5))
    if side > 1 and side * side == tokens - prefix:
        return prefix, (side, side)
    return None


def upscale(image: np.ndarray, max_side: int) -> np.ndarray:
    """Nearest-neighbour enlargement by the largest whole factor that keeps both sides within
    ``max_side`` (at least 1: a grid bigger than ``max_side`` is shown as is)."""
    factor = max(1, max_side // max(image.shape[:2]))
    return np.repeat(np.repeat(image, factor, axis=0), factor, axis=1) if factor > 1 else image


def pca_picture(sample: np.ndarray, prefix: int, grid: tuple[int, int], *, max_side: int = 384) -> np.ndarray:
    """``sample``: one ``[tokens, dim]`` sample as float32 -> uint8 ``[h, w, 3]``: its patch
    tokens' first three principal components as red, green and blue, one square per token."""
    patches = sample[prefix:]
    components = fit_components(patches, 3)
    rgb = components.unit(components.project(patches))
    image = (rgb * 255).round().astype(np.uint8).reshape(grid[0], grid[1], 3)
    return upscale(image, max_side)


def patch_step(coords: np.ndarray) -> int:
    """The grid step of patch coordinates: the smallest positive gap between distinct x (or y)
    values; 1 when there is none (a single patch, a single column)."""
    steps = []
    for axis in range(2):
        values = np.unique(coords[:, axis])
        if len(values) > 1:
            steps.append(int(np.diff(values).min()))
    return max(1, min(steps)) if steps else 1


def ranks(values: np.ndarray) -> np.ndarray:
    """Each value's rank among ``values`` mapped to [0, 1] (the smallest 0, the largest 1; ties in
    input order): attention weights span orders of magnitude, their ranks the whole colour scale."""
    values = np.asarray(values, np.float64).reshape(-1)
    out = np.empty(len(values), np.float64)
    out[np.argsort(values, kind="stable")] = np.arange(len(values), dtype=np.float64)
    return out / max(len(values) - 1, 1)


def slide_map(coords: np.ndarray, values: np.ndarray, *, patch: int | None = None, max_side: int = 512,
              background: int = 245) -> np.ndarray:
    """uint8 ``[h, w, 3]``: each patch (``coords`` [n, 2] level-0 x, y of its top-left corner) as a
    square of its size, coloured by ``values`` [n] in [0, 1] (viridis), on a light background.
    Where patches overlap, the later one (higher index) shows, as if painted in order.

    The work is bounded by the picture, not by the patches: each pixel is coloured once, by the
    last patch whose square covers it, so ``O(n + pixels * log2(side))`` whatever the overlap.
    Painting square by square costs ``n * side**2``, which overlapping patches (a step smaller
    than the patch) make minutes of CPU for a large bag."""
    coords = np.asarray(coords, np.int64).reshape(-1, 2)
    if len(coords) == 0:
        return np.full((8, 8, 3), background, np.uint8)
    patch = patch if patch and patch > 0 else patch_step(coords)
    origin = coords.min(axis=0)
    extent = coords.max(axis=0) - origin + patch  # (x, y)
    scale = max_side / float(extent.max())
    width, height = (max(1, int(np.ceil(e * scale))) for e in extent)
    corner = ((coords - origin) * scale).astype(np.int64)
    side = max(1, int(np.ceil(patch * scale)))
    colours = VIRIDIS[(np.clip(values, 0.0, 1.0) * 255).round().astype(np.int64)]
    # owner[y, x]: the last patch whose top-left corner is that pixel (-1: none) ...
    owner = np.full(height * width, -1, np.int64)
    np.maximum.at(owner, corner[:, 1] * width + corner[:, 0], np.arange(len(coords), dtype=np.int64))
    owner = owner.reshape(height, width)
    # ... then the last patch covering each pixel: the largest owner within side pixels up and left.
    owner = _trailing_max(_trailing_max(owner, side, axis=1), side, axis=0)
    image = np.full((height, width, 3), background, np.uint8)
    covered = owner >= 0
    image[covered] = colours[owner[covered]]
    return image


def _trailing_max(values: np.ndarray, window: int, axis: int) -> np.ndarray:
    """``out[..., i] = max(values[..., i - window + 1 : i + 1])`` along ``axis``, by doubling the
    window: ``ceil(log2(window))`` whole-array passes."""
    out = values.copy()
    reach = 1  # out[i] is the max over the last `reach` positions
    view = np.moveaxis(out, axis, -1)
    while reach < window:
        step = min(reach, window - reach)
        if step >= view.shape[-1]:
            break  # the window already spans everything before each position
        np.maximum(view[..., step:], view[..., :-step].copy(), out=view[..., step:])
        reach += step
    return out
