"""The nanopath reference segmentation probe, trained from a featurestore split.

The recipe of ``docs/PROBES.md`` ("The nanopath recipe"): the reference probe keeps the whole
feature cache in host RAM (``torch.cat`` of float32 batches) and trains a MaskTransformer head on it.
This script trains the same head, with the same random draws, from features streamed out of a
store by ``client.FeatureLoader``:

- ``torch.manual_seed(seed)``, then the head is built **on the CPU** (its init consumes the global
  CPU random stream) and moved to the device;
- Adam (lr 1e-3, weight decay 1e-4), ``epochs`` epochs; each epoch ``perm = torch.randperm(n)`` on
  the global CPU generator, batches of 64 in that order including the last partial one. The
  batches go to the loader as its ``batch_sampler``, so the loader reads exactly those rows; it
  upcasts float16/bfloat16 to float32 on the device. Nothing in featurestore draws from the global
  random stream, so every later ``randperm`` is the reference's;
- loss: multiclass dice on the logits upsampled bilinearly to the label size, summing over the
  batch and both pixel axes (dims 0, 2, 3): the loss depends on which images share a batch;
- validation in sequential batches of 64; the epoch with the lowest mean per-batch dice loss is
  kept; the score is the weighted per-image macro Jaccard of that head on the validation split.

Run it on a store made by ``featurestore extract`` (PanNuke: ``--images pannuke:DIR``, patch tokens):

    python examples/nanopath_seg_probe.py --store ./store --dataset pannuke --encoder NAME \\
        --train fold1 --val fold2 [--epochs 30] [--seed 1337] [--device auto]

The head is written here from the architecture's description (Segmenter's MaskTransformer as the
reference configures it: 2 layers, 8 heads, width 768, MLP 3072), with the reference's parameter
creation order, so the same seed gives the same initial weights.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BATCH_SIZE = 64


# --------------------------------------------------------------------------- the head
class _SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, d))


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _Layer(nn.Module):
    """Pre-norm transformer layer (attention, then MLP, each with a residual)."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = _SelfAttention(dim, heads)
        self.mlp = _Mlp(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MaskTransformer(nn.Module):
    """Patch tokens ``[B, gs*gs, d_encoder]`` + one learned token per class -> ``[B, n_cls, gs, gs]``.

    Class masks are scalar products of normalised patch and class embeddings after two
    transformer layers. Parameters are created in the reference's order (projection, layers,
    class tokens, the two scaled ``randn`` projections, norms), then every Linear gets a truncated
    normal (std 0.02) weight and zero bias and the class tokens a truncated normal: with the same
    seed, the same draws land in the same tensors.
    """

    def __init__(self, n_cls: int, d_encoder: int, n_layers: int = 2, n_heads: int = 8,
                 d_model: int = 768, d_ff: int = 3072) -> None:
        super().__init__()
        self.n_cls = n_cls
        scale = d_model ** -0.5
        self.proj_dec = nn.Linear(d_encoder, d_model)
        self.blocks = nn.ModuleList(_Layer(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.cls_emb = nn.Parameter(torch.randn(1, n_cls, d_model))
        self.proj_patch = nn.Parameter(scale * torch.randn(d_model, d_model))
        self.proj_classes = nn.Parameter(scale * torch.randn(d_model, d_model))
        self.decoder_norm = nn.LayerNorm(d_model)
        self.mask_norm = nn.LayerNorm(n_cls)
        for module in self.modules():  # same order as Module.apply: children first, depth first
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.trunc_normal_(self.cls_emb, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        side = math.isqrt(n)
        x = torch.cat([self.proj_dec(x), self.cls_emb.expand(b, -1, -1)], dim=1)
        for block in self.blocks:
            x = block(x)
        x = self.decoder_norm(x)
        patches = x[:, : -self.n_cls] @ self.proj_patch
        classes = x[:, -self.n_cls :] @ self.proj_classes
        patches = patches / patches.norm(dim=-1, keepdim=True)
        classes = classes / classes.norm(dim=-1, keepdim=True)
        masks = self.mask_norm(patches @ classes.transpose(1, 2))
        return masks.reshape(b, side, side, self.n_cls).permute(0, 3, 1, 2)


# --------------------------------------------------------------------------- loss and metric
def multiclass_dice_loss(logits: torch.Tensor, labels: torch.Tensor, smooth: float = 1.0) -> torch.Tensor:
    """``1 - mean_c (2 I_c + s) / (U_c + s)`` with sums over batch and pixels (dims 0, 2, 3)."""
    probs = torch.softmax(logits, dim=1)
    target = F.one_hot(labels, num_classes=probs.shape[1]).permute(0, 3, 1, 2).to(probs.dtype)
    intersection = (probs * target).sum(dim=(0, 2, 3))
    union = probs.sum(dim=(0, 2, 3)) + target.sum(dim=(0, 2, 3))
    return 1.0 - ((2.0 * intersection + smooth) / (union + smooth)).mean()


def upsampled_logits(head: nn.Module, features: torch.Tensor, label_hw: Sequence[int]) -> torch.Tensor:
    return F.interpolate(head(features), size=tuple(label_hw), mode="bilinear")


def macro_jaccard(target: np.ndarray, pred: np.ndarray) -> float:
    """sklearn's ``jaccard_score(t, p, average="macro", zero_division=0)`` on flat int maps:
    the mean IoU over the labels present in ``t`` or ``p``."""
    labels = np.union1d(target, pred)
    scores = []
    for c in labels:
        t, p = target == c, pred == c
        union = np.count_nonzero(t | p)
        scores.append(np.count_nonzero(t & p) / union if union else 0.0)
    return float(np.mean(scores))


def weighted_jaccard(targets: np.ndarray, preds: np.ndarray) -> float:
    """Per-image macro Jaccard, averaged with weight ``max(1, 16 * f)`` for images that are not
    background-only, 1 for background-only ones (``f``: the fraction of background-only images)."""
    flat_t = targets.reshape(len(targets), -1)
    flat_p = preds.reshape(len(preds), -1)
    scores = np.array([macro_jaccard(t, p) for t, p in zip(flat_t, flat_p)])
    background_only = ~flat_t.any(axis=1)
    weights = np.where(background_only, 1.0, max(1.0, 16.0 * float(background_only.mean())))
    return float((scores * weights).sum() / weights.sum())


# --------------------------------------------------------------------------- training
Batches = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor]]]


class EpochBatches:
    """The batch sampler handed to FeatureLoader: this epoch's batches, set by the training loop
    after it draws ``torch.randperm(n)`` itself (the draw stays where the reference makes it)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.history: list[list[list[int]]] = []  # what the loader took, per iteration (for checks)

    def set(self, perm: torch.Tensor, batch_size: int = BATCH_SIZE) -> None:
        order = perm.tolist()
        self.batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        self.history.append(list(self.batches))
        return iter(list(self.batches))


def train_head(*, n_train: int, n_cls: int, d_encoder: int, label_hw: Sequence[int],
               train_epoch: Callable[[torch.Tensor], Iterable[tuple[torch.Tensor, torch.Tensor]]],
               val_batches: Batches, device: torch.device, epochs: int = 30, seed: int = 1337,
               head_kwargs: dict[str, Any] | None = None,
               on_epoch: Callable[[int, list[list[int]], float], None] | None = None) -> tuple[nn.Module, float]:
    """The reference loop. ``train_epoch(perm)`` yields that epoch's ``(features, labels)`` batches
    in ``perm`` order, on ``device``, float32. Returns the kept head and its mean val dice loss."""
    torch.manual_seed(seed)
    head = MaskTransformer(n_cls, d_encoder, **(head_kwargs or {})).to(device)  # built on the CPU
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-3, weight_decay=1e-4)
    best_loss, best_state = math.inf, copy.deepcopy(head.state_dict())
    for epoch in range(epochs):
        perm = torch.randperm(n_train)  # the global CPU generator, as the reference draws it
        head.train()
        for features, labels in train_epoch(perm):
            loss = multiclass_dice_loss(upsampled_logits(head, features, label_hw), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_loss = evaluate_loss(head, val_batches(), label_hw)
        if on_epoch is not None:
            on_epoch(epoch, [perm[i : i + BATCH_SIZE].tolist() for i in range(0, n_train, BATCH_SIZE)], val_loss)
        if val_loss < best_loss:
            best_loss, best_state = val_loss, copy.deepcopy(head.state_dict())
    head.load_state_dict(best_state)
    return head, best_loss


@torch.no_grad()
def evaluate_loss(head: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  label_hw: Sequence[int]) -> float:
    head.eval()
    losses = [float(multiclass_dice_loss(upsampled_logits(head, f, label_hw), y)) for f, y in batches]
    return float(np.mean(losses))


@torch.no_grad()
def score(head: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], label_hw: Sequence[int]) -> float:
    head.eval()
    preds, targets = [], []
    for features, labels in batches:
        preds.append(upsampled_logits(head, features, label_hw).argmax(1).cpu().numpy())
        targets.append(labels.cpu().numpy())
    return weighted_jaccard(np.concatenate(targets), np.concatenate(preds))


# --------------------------------------------------------------------------- featurestore side
def patch_tokens(metadata: dict[str, Any]) -> int:
    """How many leading tokens to drop: the split's stored prefix tokens (0 for --tokens patch)."""
    layout = metadata.get("token_layout") or {}
    return int(layout.get("prefix_tokens") or 0)


def train_from_store(store: str, dataset: str, encoder: str, train: str, val: str, *, epochs: int = 30,
                     seed: int = 1337, device: str = "auto", num_classes: int | None = None, head_kwargs: dict[str, Any] | None = None,
                     on_epoch: Callable[[int, list[list[int]], float], None] | None = None,
                     storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train and score the reference head on ``train``/``val`` splits of a store (or server)."""
    from client import FeatureDataset, FeatureLoader
    from featurestore.probes.train import resolve_device

    dev = resolve_device(device)
    train_ds = FeatureDataset(store, dataset, encoder, train, storage_options=storage_options)
    val_ds = FeatureDataset(store, dataset, encoder, val, storage_options=storage_options)
    if not (train_ds.has_labels and val_ds.has_labels) or len(train_ds.label_shape) != 2:
        raise SystemExit(f"{dataset}/{encoder}: the splits need [H, W] class maps as labels")
    prefix = patch_tokens(dict(train_ds.metadata))
    d_encoder = int(train_ds.sample_shape[-1])
    label_hw = tuple(int(s) for s in train_ds.label_shape)
    if num_classes is None:  # PanNuke splits record their class names (background first)
        classes = ((train_ds.metadata.get("source") or {}).get("labels") or {}).get("classes")
        if not classes:
            raise SystemExit(f"{dataset}/{encoder}/{train} records no class names: pass --num-classes")
        num_classes = len(classes)
    n_cls = int(num_classes)
    sampler = EpochBatches()
    train_loader = FeatureLoader(train_ds, batch_sampler=sampler, device=dev, dtype=torch.float32)
    val_loader = FeatureLoader(val_ds, batch_size=BATCH_SIZE, shuffle=False, device=dev, dtype=torch.float32)

    def strip(batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for features, labels in batches:
            yield features[:, prefix:], labels

    def train_epoch(perm: torch.Tensor) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        sampler.set(perm)
        return strip(train_loader)

    head, best = train_head(n_train=len(train_ds), n_cls=n_cls, d_encoder=d_encoder, label_hw=label_hw,
                            train_epoch=train_epoch, val_batches=lambda: strip(val_loader), device=dev,
                            epochs=epochs, seed=seed, head_kwargs=head_kwargs, on_epoch=on_epoch)
    return {"best_val_dice_loss": best, "weighted_jaccard": score(head, strip(val_loader), label_hw),
            "num_classes": n_cls, "device": str(dev), "loader_batches": sampler.history}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", required=True, help="store path, fsspec URL or http(s):// server")
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--encoder", required=True, help="encoder name in the store")
    parser.add_argument("--train", default="fold1")
    parser.add_argument("--val", default="fold2")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-classes", type=int, default=None, help="default: from the split's metadata")
    args = parser.parse_args(argv)

    def report(epoch: int, batches: list[list[int]], val_loss: float) -> None:
        print(f"epoch {epoch + 1:3d}: {len(batches)} batches, val dice loss {val_loss:.5f}", flush=True)

    result = train_from_store(args.store, args.dataset, args.encoder, args.train, args.val, epochs=args.epochs,
                              seed=args.seed, device=args.device, num_classes=args.num_classes,
                              on_epoch=report)
    print(f"best val dice loss {result['best_val_dice_loss']:.5f}; weighted Jaccard "
          f"{result['weighted_jaccard']:.5f} ({result['num_classes']} classes, {result['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
