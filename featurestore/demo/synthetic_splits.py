"""Synthetic dense splits for I/O, the dense counterpart of :mod:`featurestore.demo.synthetic_bags`'s
cohorts: what the benches and the scripts measure reads and loaders on, where content does not
matter to I/O but generating it would (a split of GiBs drawn sample by sample takes longer than
the bench that reads it).
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


__all__ = ["write_split"]
