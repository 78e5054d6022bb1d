"""A store for the web page's tests, its benchmark and its screenshots: splits whose patch tokens
have spatial structure (so PCA pictures show regions, as real encoder features do), two encoders
of one dataset/split, a split without a grid, an unfinished split, and metadata holding markup.

``make_web_store(path)`` writes, with the core API:
* ``demo/vit-s/train``: float16 [12, 1 + 16*16, 48], one prefix token, grid 16 x 16;
* ``demo/vit-s-bf16/train``: the same samples through another projection, stored as bfloat16;
* ``demo/vit-s/val``: float32 [6, 48] (class tokens only: no picture);
* ``demo/vit-s/writing``: never committed;
* ``markup/enc/split``: metadata strings holding ``<script>`` (they must show as text);
* ``demo/vit-s/slides``: a bag split of ``len(BAG_IDS)`` slides (one id is ``XSS``), level-0 pixel
  coordinates on a 256 px grid inside a blob of tissue, features that change from the blob's core
  to its rim (so the first principal component draws rings), one empty bag.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GRID = (16, 16)
DIM = 48
SAMPLES = 12
XSS = "<script>alert('featurestore')</script>"
BAG_IDS = ["TCGA-A1-0001", "TCGA-A1-0002", "TCGA-B2-0003", XSS, "empty-slide"]
PATCH = 256


def regions(sample: int, grid: tuple[int, int] = GRID) -> np.ndarray:
    """[rows, cols] region ids (0..3) of sample ``sample``: a Voronoi map of four seeded centres."""
    rng = np.random.default_rng(1000 + sample)
    centres = rng.uniform(0, 1, (4, 2)) * np.asarray(grid)
    yy, xx = np.mgrid[0 : grid[0], 0 : grid[1]]
    distance = (yy[..., None] - centres[:, 0]) ** 2 + (xx[..., None] - centres[:, 1]) ** 2
    return np.argmin(distance, axis=-1)


def tokens(samples: int, seed: int, grid: tuple[int, int] = GRID, dim: int = DIM, prefix: int = 1) -> np.ndarray:
    """[samples, prefix + rows * cols, dim] float32: per-region embeddings plus a smooth gradient
    and noise, seen through an encoder-specific random projection (``seed``)."""
    base = np.random.default_rng(7)
    embed = base.standard_normal((4, dim)) * 2.0
    direction = base.standard_normal((2, dim))
    project = np.linalg.qr(np.random.default_rng(seed).standard_normal((dim, dim)))[0] * 1.5
    out = np.empty((samples, prefix + grid[0] * grid[1], dim), np.float32)
    for i in range(samples):
        yy, xx = np.mgrid[0 : grid[0], 0 : grid[1]] / max(grid)
        latent = embed[regions(i, grid)] + xx[..., None] * direction[0] + yy[..., None] * direction[1]
        latent = latent.reshape(-1, dim) + np.random.default_rng(i).standard_normal((grid[0] * grid[1], dim)) * 0.3
        out[i, prefix:] = latent @ project
        out[i, :prefix] = latent.mean(axis=0) @ project
    return out


def _metadata(spec: str, weights: str, prefix: int = 1, grid: tuple[int, int] | None = GRID) -> dict[str, Any]:
    return {
        "encoder": {"name": spec.split(":")[-1], "spec": spec, "weights_hash": weights, "output_dtype": "float32"},
        "preprocessing": {"resize": 224, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
        "token_layout": {"tokens": "all", "prefix_tokens": prefix, "grid": list(grid) if grid else None},
        "cache_key": "sha256:" + weights[:8] * 8,
    }


def make_web_store(path: str) -> str:
    import featurestore

    store = featurestore.open_store(path, mode="a")
    shape = (1 + GRID[0] * GRID[1], DIM)
    for encoder, dtype, seed, weights in (("vit-s", "float16", 1, "3f1a9c0e7d2b4a61"),
                                           ("vit-s-bf16", "bfloat16", 2, "3f1a9c0e7d2b4a61")):  # fmt: skip
        w = store.create_split("demo", encoder, "train", num_samples=SAMPLES, sample_shape=shape, dtype=dtype,
                               label_dtype="int64", chunk_bytes=4 * shape[0] * DIM * 2,
                               metadata=_metadata("builtin:vit-s14", weights))  # fmt: skip
        w.write(0, tokens(SAMPLES, seed), labels=np.arange(SAMPLES, dtype=np.int64) % 3)
        w.commit()
    w = store.create_split("demo", "vit-s", "val", num_samples=6, sample_shape=(DIM,), dtype="float32",
                           metadata=_metadata("builtin:vit-s14", "3f1a9c0e7d2b4a61", 0, None))  # fmt: skip
    w.write(0, tokens(6, 1)[:, 0])
    w.commit()
    w = store.create_split("demo", "vit-s", "writing", num_samples=8, sample_shape=(4, DIM), dtype="float16",
                           chunk_bytes=4 * DIM * 2)  # fmt: skip
    w.write(0, tokens(2, 1, grid=(2, 2), prefix=0))
    w.close()
    meta = _metadata(f"python:{XSS}", XSS, 0, (2, 2))
    meta["preprocessing"] = XSS
    meta["note"] = XSS
    w = store.create_split("markup", "enc", "split", num_samples=3, sample_shape=(4, 8), dtype="float16", metadata=meta)
    w.write(0, tokens(3, 3, grid=(2, 2), dim=8, prefix=0))
    w.commit()
    if hasattr(store, "create_bag_split"):  # bag splits (branch bags)
        add_bags(store)
    return path


def slide(bag: int, dim: int = DIM) -> tuple[np.ndarray, np.ndarray]:
    """``(features [n, dim] float32, coords [n, 2] int64)`` of one synthetic slide."""
    rng = np.random.default_rng(50 + bag)
    rows, cols = 30 + 6 * bag, 40 + 4 * bag
    yy, xx = np.mgrid[0:rows, 0:cols]
    cy, cx = rows / 2, cols / 2
    radius = np.hypot((yy - cy) / (rows / 2), (xx - cx) / (cols / 2))
    wobble = 0.15 * np.sin(np.arctan2(yy - cy, xx - cx) * (3 + bag))
    inside = radius < 0.85 + wobble
    depth = radius[inside]  # 0 at the core, ~1 at the rim
    coords = np.stack([xx[inside], yy[inside]], axis=1).astype(np.int64) * PATCH
    direction = np.random.default_rng(9).standard_normal(dim)
    features = depth[:, None] * direction * 3 + rng.standard_normal((len(depth), dim)) * 0.4
    return features.astype(np.float32), coords


def add_bags(store: object, dataset: str = "demo", encoder: str = "vit-s", split: str = "slides") -> None:
    w = store.create_bag_split(dataset, encoder, split, dim=DIM, dtype="float16",  # type: ignore[attr-defined]
                               patch_size_level0=PATCH, label_dtype="int64",
                               metadata=_metadata("builtin:vit-s14", "3f1a9c0e7d2b4a61", 0, None))
    for i, bag_id in enumerate(BAG_IDS):
        features, coords = slide(i)
        if bag_id == "empty-slide":
            features, coords = features[:0], coords[:0]
        w.add_bag(bag_id, features, coords=coords, label=i % 2, attrs={"mpp": 0.5, "note": XSS})
    w.commit()
