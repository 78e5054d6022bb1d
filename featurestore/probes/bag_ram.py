"""Bags held in host RAM: the classic MIL cache (one float32 tensor per slide), as a loader.

:class:`BagTensorLoader` yields the same batches as ``client.BagLoader`` with the same arguments
(the same epoch order, bucketing, patch subsets and zero padding, from
:mod:`client.bag_sampling`), so a probe trained from RAM and one trained from a float32 store
see identical inputs and, on CPU, give identical metrics: the ABMIL parity test relies on it.
:func:`read_bags` fills such a cache from a ``client.BagDataset`` (``featurestore probe
--loader ram``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from client import bag_sampling
from client.dataset import NO_LABEL
from featurestore.format import dtypes

__all__ = ["BagTensorLoader", "read_bags"]


def read_bags(ds: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every bag of ``ds`` (a ``client.BagDataset``) as float32 features and coords, plus labels."""
    features, coords = [], []
    for i in range(ds.num_bags):
        n = int(ds.lengths[i])
        quantized = ds.quantized  # int8: read as values, codes times scales
        f = np.empty((n, ds.dim), np.float32 if quantized else ds.numpy_dtype)
        c = np.empty((n, 2), ds.coords_dtype)
        if n:
            ds.read_into(i, None, f, c)
        features.append(torch.from_numpy(f) if quantized else dtypes.to_torch(f, ds.dtype).to(torch.float32))
        coords.append(torch.from_numpy(c))
    labels = (torch.full((ds.num_bags,), NO_LABEL, dtype=torch.int64) if ds.labels is None
              else torch.from_numpy(np.asarray(ds.labels)))
    return features, coords, labels


class BagTensorLoader:
    """Batches ``(features [B, P, D], mask, coords, labels)`` of in-RAM bags, in
    ``client.BagLoader``'s order (see the module doc); re-iterable, with ``set_epoch``."""

    def __init__(self, features: Sequence[torch.Tensor], coords: Sequence[torch.Tensor], labels: torch.Tensor, *,
                 batch_size: int = 1, shuffle: bool = True, seed: int = 0, max_patches: int | None = None,
                 bucket: bool = False, skip_empty: bool = True, indices: Sequence[int] | np.ndarray | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.features, self.coords, self.labels = list(features), list(coords), labels
        self.lengths = np.array([len(f) for f in self.features], np.int64)
        self.batch_size, self.shuffle, self.seed = int(batch_size), bool(shuffle), int(seed)
        self.max_patches, self.bucket, self.skip_empty = max_patches, bool(bucket), bool(skip_empty)
        self.indices = None if indices is None else np.asarray(indices, np.int64)
        self.device, self.dtype = torch.device(device), dtype
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def plan(self) -> list[np.ndarray]:
        order, _ = bag_sampling.bag_order(self.lengths, shuffle=self.shuffle, seed=self.seed, epoch=self.epoch,
                                          indices=self.indices, skip_empty=self.skip_empty)
        return bag_sampling.bag_batches(order, self.batch_size,
                                        lengths=bag_sampling.effective_lengths(self.lengths, self.max_patches),
                                        bucket=self.bucket, seed=self.seed, epoch=self.epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        for batch in self.plan():
            picked = []
            for i in batch:
                rows = bag_sampling.subset_rows(int(self.lengths[i]), self.max_patches, seed=self.seed,
                                                epoch=self.epoch, bag=int(i))
                f, c = self.features[i], self.coords[i]
                if rows is not None:
                    index = torch.from_numpy(rows)
                    f, c = f[index], c[index]
                picked.append((f, c))
            longest = max(len(f) for f, _ in picked)
            dim = self.features[int(batch[0])].shape[1]
            features = torch.zeros((len(batch), longest, dim), dtype=self.dtype)
            coords = torch.zeros((len(batch), longest, 2), dtype=picked[0][1].dtype)
            mask = torch.zeros((len(batch), longest), dtype=torch.bool)
            for b, (f, c) in enumerate(picked):
                features[b, : len(f)] = f
                coords[b, : len(c)] = c
                mask[b, : len(f)] = True
            labels = self.labels[torch.from_numpy(batch)]
            yield (features.to(self.device), mask.to(self.device), coords.to(self.device), labels.to(self.device))
