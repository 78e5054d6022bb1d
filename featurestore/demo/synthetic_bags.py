"""Synthetic slide bags, the one cohort builder of the tests, the demo and the benches.

* :func:`bag_lengths`: patches per slide, log-normal (a long tail, as real cohorts), by count or
  by a byte budget with one slide at the maximum;
* :func:`io_bags`: cheap bags of given lengths (content does not matter to I/O): features cut from
  one random block, shifted per bag, on a grid of level-0 coordinates; :func:`write_io_cohort`
  writes them as a bag split (the benches' cohorts), handing each bag to a copier too;
* :func:`synthetic_slides`: bags with a slide-level label a MIL head can learn (below);
* :func:`write_bag_splits`: such slides written as bag splits, once per storage dtype.

Each of :func:`synthetic_slides`'s slides is a bag of patch features ``[n, dim]`` (n drawn between ``min_patches`` and
``max_patches``) on a grid of level-0 pixel coordinates (256 px patches). Patch features are
standard normal around one of a few "tissue" centres; a *positive* slide (label 1) also holds a
small share of "tumour" patches shifted along a fixed direction, the way a metastasis is a few
patches of a large slide. A mean over all patches hides that signal; attention pooling finds it.
numpy only; deterministic for a given seed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np

PATCH_PX = 256


def bag_lengths(median: int, *, count: int | None = None, gib: float | None = None, dim: int = 0,
                sigma: float = 0.6, low: int = 16, high: int | None = None, seed: int = 0) -> np.ndarray:
    """Patches per slide, log-normal around ``median`` (``sigma``), clipped to ``[low, high]``
    (``high`` default: 8x the median). ``count`` slides; or, with ``gib``, slides until ``gib``
    GiB of float16 ``dim``-wide features, one of them (anywhere in the cohort) at ``high``."""
    rng = np.random.default_rng(seed)
    high = high if high is not None else 8 * median
    if count is not None:
        return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(count))), low, high).astype(np.int64)
    budget = int((gib or 0) * (1 << 30)) // (dim * 2)
    lengths = [high]
    while sum(lengths) < budget:
        lengths.append(int(np.clip(rng.lognormal(np.log(median), sigma), low, high)))
    return np.asarray(lengths, dtype=np.int64)[rng.permutation(len(lengths))]


def grid_coords(n: int) -> np.ndarray:
    """Level-0 pixel coordinates ``int64 [n, 2]`` of ``n`` patches on a square grid."""
    side = int(np.ceil(np.sqrt(max(n, 1))))
    k = np.arange(n, dtype=np.int64)
    return np.stack([(k % side) * PATCH_PX, (k // side) * PATCH_PX], axis=1)


def io_bags(lengths: np.ndarray, dim: int, *, seed: int = 1) -> Iterator[tuple[str, np.ndarray, np.ndarray, int]]:
    """``(slide id, features float32 [n, dim], coords, label)`` per length: rows of one random
    block, shifted per bag (distinct bags, cheap to make); labels alternate 0/1."""
    block = np.random.default_rng(seed).standard_normal((min(4096, int(max(lengths, default=1))), dim),
                                                        dtype=np.float32)
    for i, n in enumerate(lengths):
        features = block[np.arange(int(n)) % len(block)] + np.float32(i % 7)
        yield f"slide-{i:05d}", features, grid_coords(int(n)), i % 2


def write_io_cohort(store: str, names: tuple[str, str, str], lengths: np.ndarray, dim: int, dtype: str, *,
                    each: Any = None, storage_options: dict[str, Any] | None = None) -> None:
    """:func:`io_bags` of ``lengths`` as the bag split ``names`` (dataset, encoder, split) of
    ``store``, float16 bags stored as float16; ``each(bag_id, features, coords)``, if given, gets
    every bag as stored, e.g. to write the same cohort in another format."""
    import featurestore

    writer = featurestore.open_store(store, mode="a", **(storage_options or {})).create_bag_split(
        *names, dim=dim, dtype=dtype, overwrite=True, label_dtype="int64", coords_unit="px",
        coords_dtype="int64", patch_size_level0=PATCH_PX)
    for bag_id, features, coords, label in io_bags(lengths, dim):
        features = features.astype(np.float16) if dtype == "float16" else features
        writer.add_bag(bag_id, features, coords=coords, label=label, attrs={"patch_size_level0": PATCH_PX})
        if each is not None:
            each(bag_id, features, coords)
    writer.commit()


def synthetic_slides(num: int, dim: int, *, seed: int = 0, min_patches: int = 20, max_patches: int = 200,
                     tumour_share: float = 0.15, signal: float = 3.0, empty: int = 0,
                     ) -> Iterator[tuple[str, np.ndarray, np.ndarray, int]]:
    """``(slide id, features float32 [n, dim], coords int64 [n, 2], label)`` per slide; labels
    alternate 0/1 in id order; the last ``empty`` slides have no patches (a slide without tissue)."""
    rng = np.random.default_rng(seed)
    # Fixed across seeds of one dim: every cohort of that dim shares what "tumour" looks like.
    basis = np.random.default_rng(dim)
    direction = basis.standard_normal(dim).astype(np.float32)
    direction /= np.linalg.norm(direction)
    centres = basis.standard_normal((4, dim)).astype(np.float32)
    for i in range(num):
        label = i % 2
        n = 0 if i >= num - empty else int(rng.integers(min_patches, max_patches + 1))
        features = rng.standard_normal((n, dim), dtype=np.float32)
        features += centres[rng.integers(0, len(centres), n)]
        if label and n:
            tumour = rng.choice(n, size=max(1, int(round(tumour_share * n))), replace=False)
            features[tumour] += signal * direction
        side = int(np.ceil(np.sqrt(max(n, 1)) * 1.5))
        cells = rng.choice(side * side, size=n, replace=False)
        coords = np.stack([cells % side, cells // side], axis=1).astype(np.int64) * PATCH_PX
        yield f"slide-{i:04d}", features, coords, label


def write_bag_splits(store_url: str | os.PathLike[str], dataset: str, encoders: dict[str, str],
                     splits: dict[str, dict[str, Any]], *, dim: int, chunk_bytes: int = 8 << 20,
                     storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write each split (``{name: synthetic_slides kwargs incl. num}``) once per storage dtype
    (``encoders``: ``{dtype: encoder name}``); the same slides for every dtype. Returns counts."""
    import featurestore

    store = featurestore.open_store(os.fspath(store_url), mode="a", **(storage_options or {}))
    patches = 0
    for split, options in splits.items():
        writers = {dtype: store.create_bag_split(dataset, name, split, dim=dim, dtype=dtype, label_dtype="int64",
                                                 chunk_bytes=chunk_bytes, overwrite=True,
                                                 metadata={"label_info": {"classes": ["negative", "positive"]}})
                   for dtype, name in encoders.items()}
        for bag_id, features, coords, label in synthetic_slides(dim=dim, **options):
            patches += len(features)
            for writer in writers.values():
                writer.add_bag(bag_id, features, coords=coords, label=label, attrs={"mpp": 0.5, "magnification": 20})
        for writer in writers.values():
            writer.commit()
    return {"patches_per_dtype": patches, "splits": list(splits), "encoders": dict(encoders)}


__all__ = ["PATCH_PX", "bag_lengths", "grid_coords", "io_bags", "synthetic_slides", "write_bag_splits", "write_io_cohort"]
