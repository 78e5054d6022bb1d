"""The bag store the BagDataset/BagLoader tests share: 13 slides (lengths 0..90, one empty) as
float32, float16 and bfloat16 bag splits, and helpers that read it the quiet way."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

from client import BagDataset, BagLoader
from featurestore import open_store

DIM = 6
LENGTHS = (17, 3, 0, 90, 8, 41, 1, 25, 60, 12, 5, 33, 2)
DTYPES = ("float32", "float16", "bfloat16")


def slides() -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    rng = np.random.default_rng(7)
    return {f"slide-{i:02d}": ((rng.standard_normal((n, DIM)) * 2).astype(np.float32),
                               rng.integers(0, 50_000, (n, 2)).astype(np.int64), i % 2)
            for i, n in enumerate(LENGTHS)}


def write_bag_store(root: str) -> str:
    store = open_store(root, mode="a")
    for dtype in DTYPES:
        # 7 rows per chunk: bags span chunk boundaries, and one chunk holds pieces of several bags.
        writer = store.create_bag_split("cohort", f"enc-{dtype}", "all", dim=DIM, dtype=dtype,
                                        chunk_bytes=7 * DIM * (4 if dtype == "float32" else 2))
        for bag_id, (features, coords, label) in slides().items():
            writer.add_bag(bag_id, features, coords=coords, label=label)
        writer.commit()
    return root


@pytest.fixture(scope="module")
def bag_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_bag_store(str(tmp_path_factory.mktemp("bags") / "store"))


def expected(ds: BagDataset, index: int, rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Bag ``index`` of ``ds`` as float32 values of its stored dtype, from the written arrays."""
    features, coords, label = slides()[ds.ids[index]]
    if rows is not None:
        features, coords = features[rows], coords[rows]
    stored = torch.from_numpy(features).to(ds.torch_dtype).to(torch.float32)
    return stored, torch.from_numpy(coords), label


def quiet(loader: BagLoader, epoch: int = 0) -> list[tuple[torch.Tensor, ...]]:
    loader.set_epoch(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(loader)


def state_after(ds: BagDataset, options: dict[str, Any], epoch: int, batches: int) -> dict[str, Any]:
    """The state_dict of a loader stopped after its first ``batches`` batches of ``epoch``."""
    loader = BagLoader(ds, **options)
    loader.set_epoch(epoch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        state = loader.state_dict()
        del iterator
    return state


def resumed_from(ds: BagDataset, options: dict[str, Any], state: dict[str, Any]) -> list[tuple[torch.Tensor, ...]]:
    """The batches a new loader yields after ``load_state_dict(state)``."""
    loader = BagLoader(ds, **options)
    loader.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return list(loader)
