"""Fixtures shared by the probe tests (import them into a test module to use them there)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import featurestore


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Each test on one intra-op thread: probe steps are small ops, and on a loaded 2-core runner two
    OpenMP threads spin-wait on each other (measured: 24 s vs 0.3 s for the same ABMIL probe)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


DATASET = "toy"
GRID = (4, 4)
PATCH = 4  # mask pixels per token side: masks are 16 x 16
DIM = 16
SEG_CLASSES = 3
LIN_CLASSES = 4


# ------------------------------------------------------------------------------ synthetic data


def seg_data(n: int, seed: int, prefix: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[n, prefix + 16, DIM]`` whose patch token t carries its patch's class, and the
    matching uint8 masks ``[n, 16, 16]`` (each token covers a 4 x 4 block of pixels)."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(SEG_CLASSES, DIM, generator=torch.Generator().manual_seed(99)) * 2
    patch_class = torch.randint(0, SEG_CLASSES, (n, *GRID), generator=g)
    tokens = prototypes[patch_class.reshape(n, -1)] + 0.5 * torch.randn(n, GRID[0] * GRID[1], DIM, generator=g)
    if prefix:
        tokens = torch.cat([torch.randn(n, prefix, DIM, generator=g) * 5, tokens], dim=1)
    masks = patch_class.repeat_interleave(PATCH, 1).repeat_interleave(PATCH, 2).to(torch.uint8)
    return tokens, masks


def linear_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features ``[n, 8, DIM]``: every token is its sample's class prototype plus noise."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(LIN_CLASSES, DIM, generator=torch.Generator().manual_seed(7)) * 2
    labels = torch.randint(0, LIN_CLASSES, (n,), generator=g)
    return prototypes[labels][:, None, :] + torch.randn(n, 8, DIM, generator=g), labels


def write(store: Any, encoder: str, split: str, features: torch.Tensor, labels: torch.Tensor | None,
          dtype: str, metadata: dict[str, Any] | None = None) -> None:
    writer = store.create_split(
        DATASET, encoder, split, num_samples=len(features), sample_shape=tuple(features.shape[1:]),
        dtype=dtype, label_shape=() if labels is None else tuple(labels.shape[1:]),
        label_dtype=None if labels is None else str(labels.numpy().dtype), metadata=metadata,
        chunk_bytes=16 * features[0].numel() * 4,  # several chunks per split
    )
    writer.write(0, features.numpy(), labels=None if labels is None else labels.numpy())
    writer.commit()


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Seg splits under ``seg32a``/``seg32b`` (same float32 bytes), ``seg16`` (float16, with a
    CLS token recorded in token_layout) and ``segbf`` (bfloat16); linear splits ``lin32``/``lin16``;
    ``nolab`` unlabelled."""
    path = str(tmp_path_factory.mktemp("probes") / "store")
    store = featurestore.open_store(path, mode="a")
    seg_layout = {"token_layout": {"prefix_tokens": 0, "grid": list(GRID)}}
    for split, n, seed in (("train", 64, 0), ("val", 32, 1)):
        features, masks = seg_data(n, seed)
        write(store, "seg32a", split, features, masks, "float32", seg_layout)
        write(store, "seg32b", split, features, masks, "float32", seg_layout)
        with_cls, _ = seg_data(n, seed, prefix=1)
        write(store, "seg16", split, with_cls, masks, "float16",
              {"token_layout": {"prefix_tokens": 1, "grid": list(GRID)}})
        write(store, "segbf", split, features, masks, "bfloat16", seg_layout)
        features, labels = linear_data(2 * n, seed)
        write(store, "lin32", split, features, labels, "float32")
        write(store, "lin16", split, features, labels, "float16")
        write(store, "nolab", split, features, None, "float32")
    return path
