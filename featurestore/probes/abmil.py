"""The slide-level reference probe: gated-attention MIL (ABMIL) on frozen patch features.

:class:`GatedABMIL` is the attention pooling of Ilse, Tomczak and Welling, "Attention-based Deep
Multiple Instance Learning", ICML 2018 (https://arxiv.org/abs/1802.04712), section 2.4, gated
variant (eq. 9), as CLAM and most MIL baselines use it on frozen features:

    h_k = ReLU(W_h x_k)                                    patch embedding, [P, H]
    a_k = softmax_k( w^T (tanh(V h_k) * sigmoid(U h_k)) )  attention over the bag's patches
    z   = sum_k a_k h_k                                    slide embedding, [H]
    logits = W_c z

Padded rows of a batch (``mask`` false) get no attention (their score is -inf before the
softmax), so a padded batch gives each bag the result it would get alone.

:func:`train_abmil` trains it from any iterable of ``(features, mask, coords, labels)`` batches
(``client.BagLoader``, or :class:`featurestore.probes.bag_ram.BagTensorLoader` over bags held in
RAM) and reports the slide-level **AUC** (binary; macro one-vs-rest for more classes) and
**balanced accuracy** on the evaluation batches. On CPU, a seed gives bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featurestore.errors import EmptySplit, InvalidLabels
from featurestore.probes.auc import roc_auc, slide_auc
from featurestore.probes.linear import balanced_accuracy, confusion_matrix
from featurestore.probes.train import adamw, begin_training, check_class_ids, epochs_of, set_cosine_lr

__all__ = ["ABMILConfig", "GatedABMIL", "evaluate_abmil", "roc_auc", "train_abmil"]

BagBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ABMILConfig:
    """Hyper-parameters of the ABMIL probe (AdamW, per-epoch cosine decay, cross-entropy)."""

    epochs: int = 20
    lr: float = 1e-3
    weight_decay: float = 1e-4
    hidden: int = 128  # H: patch embedding width
    attention: int = 64  # width of the gated attention's V and U
    dropout: float = 0.0  # on the patch embedding; > 0 draws from the global generator (seeded)


class GatedABMIL(nn.Module):
    """Gated attention MIL head (Ilse et al. 2018, eq. 9) over ``[B, P, D]`` with a ``[B, P]`` mask."""

    def __init__(self, in_dim: int, num_classes: int, hidden: int = 128, attention: int = 64,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Dropout(dropout))
        self.attention_v = nn.Linear(hidden, attention)
        self.attention_u = nn.Linear(hidden, attention)
        self.attention_w = nn.Linear(attention, 1)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, features: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits [B, C], attention [B, P])``."""
        h = self.embed(features)
        scores = self.attention_w(torch.tanh(self.attention_v(h)) * torch.sigmoid(self.attention_u(h))).squeeze(-1)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attention = torch.softmax(scores, dim=1)
        pooled = torch.bmm(attention.unsqueeze(1), h).squeeze(1)
        return self.classifier(pooled), attention


# ------------------------------------------------------------------------------ training


def train_abmil(
    train: Iterable[BagBatch],
    evaluate: Iterable[BagBatch],
    *,
    in_dim: int,
    num_classes: int,
    seed: int = 0,
    device: str | torch.device = "auto",
    config: ABMILConfig | None = None,
    attention_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    prediction_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> dict[str, float]:
    """Fit the gated-attention head on ``train`` batches; return ``auc`` and ``balanced_accuracy``
    on ``evaluate``. ``seed`` fixes the initialisation (the loaders' own seeds fix the order and
    the patch subsets); the head is built before the first batch, after ``torch.manual_seed``.
    ``attention_sink(attention [B, P], mask [B, P])`` sees each evaluation batch's attention
    (featurestore.probes.attention keeps it), ``prediction_sink(probabilities [B, C], class ids
    [B])`` its class probabilities (featurestore.probes.predictions)."""
    config = config or ABMILConfig()
    device = begin_training(num_classes, config.epochs, device, seed)
    model = GatedABMIL(in_dim, num_classes, config.hidden, config.attention, config.dropout).to(device)
    optimizer = adamw(model, config.lr, config.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    seen = 0
    for epoch, loader in enumerate(epochs_of(train, config.epochs)):
        set_cosine_lr(optimizer, config.lr, epoch, config.epochs)
        for features, mask, _coords, labels in loader:
            logits, _ = model(features.to(device, torch.float32), mask.to(device))
            loss = loss_fn(logits, _class_ids(labels, device, num_classes))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += 1
    if seen == 0:
        raise EmptySplit("the training loader yielded no bags; is the train split (or fold) empty?")
    return evaluate_abmil(model, evaluate, num_classes=num_classes, device=device, attention_sink=attention_sink,
                          prediction_sink=prediction_sink)


@torch.no_grad()
def evaluate_abmil(model: nn.Module, evaluate: Iterable[BagBatch], *, num_classes: int, device: torch.device,
                   attention_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                   prediction_sink: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> dict[str, Any]:
    model.eval()
    probabilities, targets = [], []
    for features, mask, _coords, labels in evaluate:
        logits, attention = model(features.to(device, torch.float32), mask.to(device))
        if attention_sink is not None:
            attention_sink(attention, mask)
        probabilities.append(torch.softmax(logits, dim=1).cpu())
        targets.append(_class_ids(labels, device, num_classes).cpu())
        if prediction_sink is not None:
            prediction_sink(probabilities[-1], targets[-1])
    if not targets:
        raise EmptySplit("the evaluation loader yielded no bags; is the eval split (or fold) empty?")
    prob, target = torch.cat(probabilities), torch.cat(targets)
    confusion = confusion_matrix(target, prob.argmax(dim=1), num_classes)
    return {"auc": slide_auc(prob.numpy(), target.numpy(), num_classes),
            "balanced_accuracy": balanced_accuracy(confusion)}


def _class_ids(labels: torch.Tensor, device: torch.device, num_classes: int) -> torch.Tensor:
    labels = labels.to(device)
    if labels.ndim != 1 or labels.dtype.is_floating_point:
        raise InvalidLabels(f"the ABMIL probe needs one integer class id per bag, but got labels of shape "
                            f"{tuple(labels.shape)} and dtype {labels.dtype}")
    return check_class_ids(labels.long(), num_classes)
