"""Small helpers shared by the core store tests (data, batching, raw chunk access)."""

from __future__ import annotations

from typing import Any

import numpy as np

import featurestore
from featurestore.format import layout

SAMPLE_SHAPE = (4, 8)  # [tokens, dim]
FLOAT32_SAMPLE_BYTES = 4 * 8 * 4


def batches(num_samples: int, rng: np.random.Generator, sizes: tuple[int, ...] = (1, 2, 3, 7)) -> list[tuple[int, int]]:
    """[start, stop) batches of odd sizes covering every row, in shuffled order."""
    out, start = [], 0
    while start < num_samples:
        stop = min(num_samples, start + int(rng.choice(sizes)))
        out.append((start, stop))
        start = stop
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def write_shuffled(writer: Any, features: Any, labels: Any = None, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for start, stop in batches(len(features), rng):
        writer.write(start, features[start:stop], labels=None if labels is None else labels[start:stop])


def chunk_keys(store: featurestore.FeatureStore, dataset: str, encoder: str, split: str, array: str,
               ndim: int, count: int) -> list[str]:
    base = f"{layout.split_key(dataset, encoder, split)}/{array}"
    return [layout.chunk_key(base, i, ndim) for i in range(count)]


def float32_source(num_samples: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((num_samples, *SAMPLE_SHAPE)) * scale).astype(np.float32)


def bits(tensor: Any) -> np.ndarray:
    """The raw bits of a float32 / float16 / bfloat16 torch tensor as unsigned integers."""
    import torch

    if tensor.dtype == torch.float32:
        return tensor.view(torch.int32).numpy().view(np.uint32)
    return tensor.view(torch.int16).numpy().view(np.uint16)


def options(store: featurestore.FeatureStore) -> dict[str, Any]:
    """The storage options a store was opened with (none for local paths)."""
    return dict(getattr(store.storage, "storage_options", {}))


def comparable_chunk_file(rel: str, data: bytes) -> bytes:
    """A chunk file's bytes, less what differs between two runs by design: a statistics row's
    generation slot (each run of a split draws its own) and so its crc32c; ``chunk_seals`` rows
    less their generation column, for the same reason."""
    if rel.startswith("chunk_seals/c/"):
        rows = np.frombuffer(data[:-4], "<u8").reshape(-1, 4).copy()
        rows[:, 3] = 0
        return rows.tobytes()
    if not rel.startswith("chunk_stats/c/"):
        return data
    # row = statistics, generation, chunk index; then the 4-byte crc32c
    return data[:-20] + b"\0" * 8 + data[-12:-4]
