"""Training helpers both probe heads share: in-RAM batches, epochs, the optimizer, checks.

- :class:`TensorLoader`: in-RAM batches (the baseline a host-RAM feature cache gives), with the
  same shuffled order as ``FeatureLoader(order="shuffle")``;
- :func:`epochs_of`, :func:`begin_training` (checks, device, seed), :func:`adamw`,
  :func:`set_cosine_lr`, :func:`check_class_ids`;
- :func:`resolve_device` is the one in ``featurestore.core.device`` (loaders and extraction use
  it too), re-exported for the probes' callers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from featurestore.core.device import resolve_device
from featurestore.errors import InvalidLabels, InvalidOption, ShapeMismatch
from featurestore.probes.chance import class_ids

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "Batch",
    "TensorLoader",
    "adamw",
    "begin_training",
    "check_class_ids",
    "cosine_lr",
    "epochs_of",
    "resolve_device",
    "set_cosine_lr",
]

# One batch as every loader here yields it: (features [B, ...], labels [B, ...]).
Batch = tuple["Tensor", "Tensor"]


class TensorLoader:
    """Batches of in-RAM tensors, the baseline that a feature cache in host memory gives.

    It mirrors the parts of ``FeatureLoader`` that the probes use: re-iterable, ``set_epoch``,
    batches moved to ``device`` with features cast to ``dtype``, and the same shuffled order:
    ``client.sampling.epoch_order(n, "shuffle", seed=seed, epoch=epoch)``, re-derived here so the
    core package does not import the client. With the same seed, a probe trained from this loader
    and one trained from ``FeatureLoader(order="shuffle")`` see identical batches, so a float32
    store and its in-RAM copy give bit-identical metrics on CPU.
    """

    def __init__(
        self,
        features: Tensor,
        labels: Tensor,
        *,
        batch_size: int = 64,
        shuffle: bool = False,
        seed: int = 0,
        device: str | torch.device = "auto",
        dtype: torch.dtype = torch.float32,
        drop_last: bool = False,
    ) -> None:
        if len(features) != len(labels):
            raise ShapeMismatch(
                f"features and labels differ in length ({len(features)} vs {len(labels)})"
            )
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidOption(f"batch_size must be a positive integer, but got: {batch_size!r}")
        self.features = features
        self.labels = labels
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.device = resolve_device(device)
        self.dtype = dtype
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        n = len(self.features)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        n = len(self.features)
        if self.shuffle:
            # SeedSequence([seed, epoch]) -> PCG64 permutation: client/sampling.py's "shuffle".
            sequence = np.random.SeedSequence([int(self.seed), int(self.epoch)])
            order = torch.from_numpy(np.random.Generator(np.random.PCG64(sequence)).permutation(n))
        else:
            order = torch.arange(n)
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            yield (
                self.features[index].to(self.device, self.dtype),
                self.labels[index].to(self.device),
            )


def epochs_of(loader: Iterable[Batch], epochs: int) -> Iterator[Iterable[Batch]]:
    """Yield ``loader`` once per epoch, calling ``set_epoch`` first when it has one.

    Loaders that reshuffle per epoch (``FeatureLoader``, ``TensorLoader``, a ``DistributedSampler``
    wrapper) need ``set_epoch``; plain lists of batches are simply re-iterated.
    """
    for epoch in range(epochs):
        set_epoch = getattr(loader, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        yield loader


def cosine_lr(base_lr: float, epoch: int, epochs: int) -> float:
    # Per-epoch cosine decay: needs no len() of the loader, which a generic iterable may lack.
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * epoch / max(epochs, 1)))


def begin_training(num_classes: int, epochs: int, device: str | torch.device, seed: int) -> torch.device:
    """Checks and set-up shared by the probes: the device to train on, the seed applied."""
    if num_classes < 2:
        raise InvalidOption(f"num_classes must be at least 2, but got: {num_classes}")
    if epochs < 1:
        raise InvalidOption(f"epochs must be a positive integer, but got: {epochs}")
    resolved = resolve_device(device)
    torch.manual_seed(seed)
    return resolved


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The probes' optimizer, with the model put in training mode."""
    model.train()
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)


def set_cosine_lr(optimizer: torch.optim.Optimizer, base_lr: float, epoch: int, epochs: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = cosine_lr(base_lr, epoch, epochs)


def class_targets(labels: Tensor, ndim: int, device: torch.device, num_classes: int, needs: str,
                  instead: str) -> Tensor:
    """``labels`` as int64 class ids of ``ndim`` dimensions on ``device`` (a singleton dimension 1
    dropped), checked by :func:`check_class_ids`; labels of another shape are one
    :class:`InvalidLabels` line: ``needs`` (what the probe takes), the shape, ``instead`` (the probe for it)."""
    if labels.ndim == ndim + 1 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != ndim:
        raise InvalidLabels(f"{needs}, but got labels of shape {tuple(labels.shape)}; {instead}")
    if labels.is_floating_point():  # .long() would truncate 2.5 to 2 and turn NaN into garbage
        class_ids(labels.detach().cpu().numpy(), "a batch's labels")
    return check_class_ids(labels.to(device).long(), num_classes)


def check_class_ids(labels: Tensor, num_classes: int) -> Tensor:
    """``labels`` if every id lies in ``[0, num_classes)``, else :class:`InvalidLabels` naming the bad id.

    Checked per batch because cross-entropy on an out-of-range id fails deep inside torch (or,
    on CUDA, with an asynchronous device assert) instead of saying which label is wrong.
    """
    if labels.numel():
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= num_classes:
            bad = low if low < 0 else high
            raise InvalidLabels(
                f"label {bad} is outside [0, {num_classes}); pass the right num_classes "
                "(--num-classes) or fix the labels"
            )
    return labels
