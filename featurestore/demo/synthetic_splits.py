"""Synthetic dense splits, the dense counterpart of :mod:`featurestore.demo.synthetic_bags`'s cohorts:

* :func:`write_split`: a split for I/O, what the benches and the scripts measure reads and
  loaders on, where content does not matter but generating it would (a split of GiBs drawn sample
  by sample takes longer than the bench that reads it);
* :func:`write_catalog`: a store of many small splits with an encoder's metadata each (a catalog
  page's worth, ``bench web``);
* :func:`write_picture_split`: patch tokens on a square grid with a few strong directions over
  noise, as encoder tokens have (PCA pictures, ``bench web``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def write_split(path: str, n: int, shape: tuple[int, ...], *, dtype: str = "float16", rows: int = 256,
                names: tuple[str, str, str] = ("bench", "enc", "train"), chunk_bytes: int | None = None,
                slabs: Callable[[int, np.ndarray], Any] | None = None) -> None:
    """A split of ``n`` samples written ``rows`` at a time: one random block shifted per slab (content
    does not matter to I/O; generating it would). Each slab (float32 for int8 and bfloat16, which the
    writer converts) is also handed to ``slabs(start, values)``."""
    import featurestore

    writer = featurestore.open_store(path, mode="a").create_split(
        *names, num_samples=n, sample_shape=shape, dtype=dtype, chunk_bytes=chunk_bytes, overwrite=True)
    block = np.random.default_rng(0).standard_normal((min(rows, n), *shape), dtype=np.float32)
    try:
        block = block if dtype == "int8" else block.astype(np.dtype(dtype))
    except TypeError:  # bfloat16: float32 slabs, the writer converts
        pass
    for k, start in enumerate(range(0, n, rows)):
        values = block[: min(rows, n - start)] + block.dtype.type(k % 64)
        writer.write(start, values)
        if slabs:
            slabs(start, values)
    writer.commit()


def write_catalog(path: str, splits: int, dim: int) -> None:
    """``splits`` float16 splits of [4, 16, dim] over 5 datasets x 4 encoders x N splits."""
    import featurestore

    store = featurestore.open_store(path, mode="a")
    values = np.random.default_rng(0).standard_normal((4, 16, dim), dtype=np.float32)
    for i in range(splits):
        dataset, encoder, split = f"ds{i % 5}", f"enc{(i // 5) % 4}", f"split{i // 20:03d}"
        meta = {"encoder": {"name": encoder, "spec": f"timm:vit_{encoder}", "weights_hash": f"{i:016x}"},
                "preprocessing": {"resize": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]},
                "token_layout": {"tokens": "patch", "prefix_tokens": 0, "grid": [4, 4]},
                "cache_key": f"sha256:{i:064x}"}  # fmt: skip
        w = store.create_split(dataset, encoder, split, num_samples=4, sample_shape=(16, dim), dtype="float16",
                               metadata=meta)  # fmt: skip
        w.write(0, values + i)
        w.commit()


def write_picture_split(path: str, samples: int, side: int, dim: int) -> None:
    """``pictures/enc/train``: ``samples`` float16 samples of ``side * side`` patch tokens (a square
    grid, in the split's token layout) of ``dim`` channels."""
    import featurestore

    tokens = side * side
    meta = {"token_layout": {"tokens": "patch", "prefix_tokens": 0, "grid": [side, side]}}
    w = featurestore.open_store(path, mode="a").create_split(
        "pictures", "enc", "train", num_samples=samples, sample_shape=(tokens, dim), dtype="float16", metadata=meta)
    rng = np.random.default_rng(1)
    for i in range(samples):  # a few strong directions over noise, as encoder tokens have
        basis = rng.standard_normal((8, dim)).astype(np.float32)
        weights = rng.standard_normal((tokens, 8)).astype(np.float32) * np.linspace(4, 0.5, 8, dtype=np.float32)
        w.write(i, (weights @ basis + rng.standard_normal((tokens, dim), dtype=np.float32))[None])
    w.commit()


__all__ = ["write_catalog", "write_picture_split", "write_split"]
