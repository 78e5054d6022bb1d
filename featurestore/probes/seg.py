"""The segmentation probe: a small transformer over the patch-token grid, scored by Jaccard.

Input batches are ``(features [B, T, D], masks [B, H, W])`` with ``T = prefix_tokens + gh * gw``
tokens in row-major grid order (``metadata["token_layout"]``) and masks holding class ids. The head
drops the prefix tokens, projects the patch tokens to a small width, mixes them with a couple of
pre-norm transformer layers (so a patch's prediction can use its neighbours, in the spirit of the
MaskTransformer head the reference suite fits on cached features), predicts per-patch class
logits, and bilinearly upsamples them to the mask size. Loss: cross-entropy + soft dice. Metric: per-image macro Jaccard
(:func:`per_image_jaccard`; exact definition there and in ``docs/PROBES.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from featurestore.errors import EmptySplit, ShapeMismatch
from featurestore.probes.train import adamw, begin_training, class_targets, epochs_of, set_cosine_lr

if TYPE_CHECKING:
    from torch import Tensor

    from featurestore.probes.train import Batch

__all__ = [
    "SegHead",
    "SegProbeConfig",
    "dice_loss",
    "evaluate_seg_probe",
    "grid_from_layout",
    "per_image_jaccard",
    "soft_dice",
    "train_seg_probe",
]


@dataclass(frozen=True)
class SegProbeConfig:
    """Hyper-parameters of the segmentation head (AdamW, per-epoch cosine decay)."""

    epochs: int = 10
    lr: float = 1e-3
    weight_decay: float = 1e-4
    dim: int = 128  # width of the head after projecting the encoder dim
    depth: int = 2  # transformer layers
    heads: int = 4
    dice_weight: float = 1.0  # loss = CE + dice_weight * dice


def grid_from_layout(
    num_tokens: int, grid: Sequence[int] | None, prefix_tokens: int = 0
) -> tuple[int, int]:
    """Check ``num_tokens`` against the token layout; a missing grid is inferred if square."""
    patches = num_tokens - prefix_tokens
    if grid is None:
        side = math.isqrt(max(patches, 0))
        if side * side != patches or patches == 0:
            raise ShapeMismatch(
                f"{num_tokens} tokens with {prefix_tokens} prefix tokens do not form a square "
                "grid and the split's metadata has no token_layout.grid; record the grid"
            )
        return side, side
    gh, gw = (int(g) for g in grid)
    if gh * gw != patches:
        raise ShapeMismatch(
            f"token grid {gh}x{gw} needs {gh * gw} patch tokens, but the features have "
            f"{num_tokens} tokens with {prefix_tokens} prefix tokens; check token_layout"
        )
    return gh, gw


class SegHead(nn.Module):
    """LayerNorm -> Linear(D, dim) + learned 2-D position table -> pre-norm transformer ->
    per-patch class logits -> bilinear upsampling to the mask size."""

    def __init__(
        self,
        in_dim: int,
        num_classes: int,
        grid: tuple[int, int],
        *,
        dim: int = 128,
        depth: int = 2,
        heads: int = 4,
    ) -> None:
        super().__init__()
        self.grid = grid
        self.num_classes = num_classes
        # Normalising the frozen features first makes one learning rate work for any encoder.
        self.norm_in = nn.LayerNorm(in_dim)
        self.proj = nn.Linear(in_dim, dim)
        self.pos = nn.Parameter(torch.zeros(1, grid[0] * grid[1], dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, dim_feedforward=2 * dim, dropout=0.0, activation="gelu",
            batch_first=True, norm_first=True,
        )
        # No dropout and no nested tensors: the head stays deterministic on CPU.
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm_out = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, patches: Tensor, out_size: tuple[int, int]) -> Tensor:
        """``patches [B, gh*gw, D]`` -> logits ``[B, C, H, W]``."""
        x = self.proj(self.norm_in(patches)) + self.pos
        x = self.classifier(self.norm_out(self.blocks(x)))
        b = x.shape[0]
        logits = x.transpose(1, 2).reshape(b, self.num_classes, *self.grid)
        if tuple(logits.shape[-2:]) == tuple(out_size):
            return logits
        return F.interpolate(logits, size=out_size, mode="bilinear", align_corners=False)


def dice_loss(logits: Tensor, target: Tensor, smooth: float = 1.0) -> Tensor:
    """Soft dice loss: ``1 - mean_c (2 sum(p_c y_c) + s) / (sum p_c + sum y_c + s)``.

    Sums run over the batch and all pixels; ``p`` is the softmax, ``y`` the one-hot target. The
    smoothing ``s`` keeps classes absent from a batch at a dice of ~1 instead of 0/0.
    """
    return soft_dice(logits.softmax(dim=1), target, smooth)


def soft_dice(probs: Tensor, target: Tensor, smooth: float = 1.0) -> Tensor:
    """:func:`dice_loss` from probabilities ``[B, C, H, W]``.

    ``sum(p_c y_c)`` is the probability of the true class summed per class, so no one-hot
    ``[B, C, H, W]`` tensor is built: at mask resolution that tensor and its backward were a
    quarter of a CPU training step.
    """
    num_classes = probs.shape[1]
    flat_target = target.reshape(-1)
    picked = probs.gather(1, target.unsqueeze(1)).reshape(-1)
    intersection = torch.zeros(num_classes, dtype=probs.dtype, device=probs.device)
    intersection = intersection.index_add(0, flat_target, picked)
    target_count = torch.bincount(flat_target, minlength=num_classes).to(probs.dtype)
    total = probs.sum(dim=(0, 2, 3)) + target_count
    return 1.0 - ((2.0 * intersection + smooth) / (total + smooth)).mean()


def per_image_jaccard(pred: Tensor, target: Tensor, num_classes: int) -> Tensor:
    """Macro Jaccard of each image: ``[B, H, W]`` class maps -> ``[B]`` float64 scores.

    For image i and class c, ``IoU_ic = |P_ic ∩ T_ic| / |P_ic ∪ T_ic|`` over pixels; image i's
    score is the mean of ``IoU_ic`` over the classes present in its prediction or its target
    (union > 0), background included. Absent classes are skipped, not scored 1 or 0.
    """
    b = pred.shape[0]
    pred = pred.reshape(b, -1).long()
    target = target.reshape(b, -1).long()
    offset = torch.arange(b, device=pred.device).unsqueeze(1) * num_classes
    size = b * num_classes

    def counts(ids: Tensor) -> Tensor:
        return torch.bincount((ids + offset).reshape(-1), minlength=size).reshape(b, num_classes)

    same = pred == target
    intersection = torch.bincount(
        (target + offset)[same], minlength=size
    ).reshape(b, num_classes)
    union = counts(pred) + counts(target) - intersection
    present = union > 0
    iou = intersection.double() / union.clamp(min=1).double()
    return (iou * present).sum(1) / present.sum(1).clamp(min=1)


def train_seg_probe(
    train: Iterable[Batch],
    evaluate: Iterable[Batch],
    *,
    num_classes: int,
    grid: Sequence[int] | None = None,
    prefix_tokens: int = 0,
    seed: int = 0,
    device: str | torch.device = "auto",
    config: SegProbeConfig | None = None,
) -> dict[str, float]:
    """Fit the segmentation head on ``train``; return ``{"jaccard": ...}`` on ``evaluate``.

    ``grid`` is ``metadata["token_layout"]["grid"]`` (inferred when square and omitted);
    ``prefix_tokens`` leading tokens are dropped when the features still carry them. Features are
    upcast to float32 on ``device``; ``seed`` fixes the head's initialisation.
    """
    config = config or SegProbeConfig()
    device = begin_training(num_classes, config.epochs, device, seed)
    model: SegHead | None = None
    optimizer: torch.optim.Optimizer | None = None
    drop = prefix_tokens
    for epoch, loader in enumerate(epochs_of(train, config.epochs)):
        for features, masks in loader:
            features = features.to(device, torch.float32)
            masks = _masks(masks, device, num_classes)
            if model is None or optimizer is None:
                # Built at the first batch, where the feature dim and token count are known.
                drop = _prefix_to_drop(features.shape[1], grid, prefix_tokens)
                shape = grid_from_layout(features.shape[1] - drop, grid, 0)
                model = SegHead(features.shape[-1], num_classes, shape, dim=config.dim,
                                depth=config.depth, heads=config.heads).to(device)
                optimizer = adamw(model, config.lr, config.weight_decay)
            set_cosine_lr(optimizer, config.lr, epoch, config.epochs)
            logits = model(features[:, drop:], (masks.shape[-2], masks.shape[-1]))
            # One log-softmax serves both terms (cross-entropy = NLL of it, dice on its exp).
            log_probs = logits.log_softmax(dim=1)
            loss = F.nll_loss(log_probs, masks)
            if config.dice_weight:
                loss = loss + config.dice_weight * soft_dice(log_probs.exp(), masks)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    if model is None:
        raise EmptySplit("the training loader yielded no batches; is the train split empty?")
    return evaluate_seg_probe(model, evaluate, drop=drop, device=device)


@torch.no_grad()
def evaluate_seg_probe(
    model: SegHead, evaluate: Iterable[Batch], *, drop: int, device: torch.device
) -> dict[str, float]:
    """Mean over evaluation images of :func:`per_image_jaccard`."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    images = 0
    for features, masks in evaluate:
        features = features.to(device, torch.float32)
        masks = _masks(masks, device, model.num_classes)
        logits = model(features[:, drop:], (masks.shape[-2], masks.shape[-1]))
        scores = per_image_jaccard(logits.argmax(dim=1), masks, model.num_classes)
        total += scores.sum()
        images += scores.numel()
    if images == 0:
        raise EmptySplit("the evaluation loader yielded no batches; is the eval split empty?")
    return {"jaccard": float(total) / images}


def _prefix_to_drop(num_tokens: int, grid: Sequence[int] | None, prefix_tokens: int) -> int:
    # Stores written with tokens=patch already dropped the prefix although token_layout still
    # records it; the token count tells which case this is.
    if grid is not None:
        return 0 if num_tokens == int(grid[0]) * int(grid[1]) else prefix_tokens
    if prefix_tokens and _is_square(num_tokens) and not _is_square(num_tokens - prefix_tokens):
        return 0
    return prefix_tokens


def _is_square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def _masks(masks: Tensor, device: torch.device, num_classes: int) -> Tensor:
    return class_targets(masks, 3, device, num_classes, "the seg probe needs class maps [B, H, W]",
                         "use the linear probe for one class id per sample")
