"""The linear probe on pooled tokens (training helpers: :mod:`featurestore.probes.train`).

- :func:`train_linear_probe` fits a linear classifier on mean-pooled patch tokens (or the CLS
  token) from any iterable of ``(features, labels)`` batches and reports AUC (binary, or the macro
  mean of one-vs-rest AUCs over K classes: :func:`featurestore.probes.auc.slide_auc`, as the ABMIL
  head reports it), balanced accuracy and macro-F1, the last two from a confusion matrix in torch
  (:func:`macro_f1`, :func:`balanced_accuracy`). On ``[n, E]`` slide embeddings it is the
  logistic-regression probe (a linear layer trained with cross-entropy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from featurestore.errors import EmptySplit, InvalidLabels, InvalidOption, ShapeMismatch
from featurestore.probes.auc import slide_auc
from featurestore.probes.train import Batch, adamw, begin_training, class_targets, epochs_of, set_cosine_lr

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "LinearProbe",
    "LinearProbeConfig",
    "balanced_accuracy",
    "confusion_matrix",
    "evaluate_linear_probe",
    "macro_f1",
    "pool_tokens",
    "train_linear_probe",
]


# ----------------------------------------------------------------------------------- metrics


def confusion_matrix(target: Tensor, pred: Tensor, num_classes: int) -> Tensor:
    """``[C, C]`` int64 counts, rows = target class, columns = predicted class."""
    target = target.reshape(-1).long()
    pred = pred.reshape(-1).long()
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= num_classes):
        raise InvalidLabels(
            f"labels must lie in [0, {num_classes}), but got values in "
            f"[{int(target.min())}, {int(target.max())}]; pass the right num_classes"
        )
    flat = torch.bincount(target * num_classes + pred, minlength=num_classes * num_classes)
    return flat.reshape(num_classes, num_classes)


def macro_f1(confusion: Tensor) -> float:
    """Mean per-class F1 over classes present in the target or the prediction.

    ``F1_c = 2 TP / (2 TP + FP + FN)``; a class absent from both has 0/0 and is left out (what
    scikit-learn does when ``labels`` is not given), so unused class ids do not dilute the mean.
    """
    confusion = confusion.double()
    tp = confusion.diag()
    denominator = 2 * tp + (confusion.sum(0) - tp) + (confusion.sum(1) - tp)
    present = denominator > 0
    if not bool(present.any()):
        return float("nan")
    return float((2 * tp[present] / denominator[present]).mean())


def balanced_accuracy(confusion: Tensor) -> float:
    """Mean per-class recall over classes present in the target (scikit-learn's definition)."""
    confusion = confusion.double()
    support = confusion.sum(1)
    present = support > 0
    if not bool(present.any()):
        return float("nan")
    return float((confusion.diag()[present] / support[present]).mean())


# ------------------------------------------------------------------------------ linear probe


@dataclass(frozen=True)
class LinearProbeConfig:
    """Hyper-parameters of the linear probe (AdamW, per-epoch cosine decay)."""

    epochs: int = 20
    # 1e-2 suits a linear head on standardised inputs; 1e-3 needed many more epochs to converge
    # on small splits, which a probe that is re-run for K seeds cannot afford.
    lr: float = 1e-2
    weight_decay: float = 1e-4
    pool: str = "mean"  # "mean": mean over patch tokens; "cls": the first prefix token
    prefix_tokens: int = 0  # leading non-patch tokens (CLS, registers) in each sample


def pool_tokens(features: Tensor, pool: str = "mean", prefix_tokens: int = 0) -> Tensor:
    """``[B, T, D]`` -> ``[B, D]``: mean over the patch tokens (prefix dropped) or the CLS token.

    ``[B, D]`` features are already pooled and pass through; more dims are flattened to tokens.
    """
    if features.ndim == 2:
        return features
    if features.ndim > 3:
        features = features.reshape(features.shape[0], -1, features.shape[-1])
    if pool == "cls":
        if prefix_tokens < 1:
            raise ShapeMismatch(
                "pool='cls' needs a CLS token, but these features have no prefix tokens "
                "(token_layout.prefix_tokens = 0); use pool='mean'"
            )
        return features[:, 0]
    if pool == "mean":
        return features[:, prefix_tokens:].mean(dim=1)
    raise InvalidOption(f"pool must be 'mean' or 'cls', but got: {pool!r}")


class LinearProbe(nn.Module):
    """BatchNorm without affine parameters, then one linear layer.

    The parameter-free BatchNorm standardises each channel with running statistics, as in MAE's
    linear probe (He et al. 2021, sec. A.2: https://arxiv.org/abs/2111.06377), so one learning
    rate fits encoders whose feature scales differ by orders of magnitude.
    """

    def __init__(self, in_dim: int, num_classes: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(in_dim, affine=False, eps=1e-6)
        self.head = nn.Linear(in_dim, num_classes)

    def forward(self, pooled: Tensor) -> Tensor:
        return self.head(self.norm(pooled))


def train_linear_probe(
    train: Iterable[Batch],
    evaluate: Iterable[Batch],
    *,
    num_classes: int,
    seed: int = 0,
    device: str | torch.device = "auto",
    config: LinearProbeConfig | None = None,
    prediction_sink: Callable[[Tensor, Tensor], None] | None = None,
) -> dict[str, float]:
    """Fit a linear probe on ``train`` batches; return AUC, balanced accuracy and macro-F1 on ``evaluate``
    (``prediction_sink(probabilities [B, C], class ids [B])`` sees each evaluation batch's).

    Features of any float dtype are upcast to float32 on ``device``; labels are class ids.
    ``seed`` fixes the initialisation (the loader's own seed fixes the shuffle), so on CPU two
    runs with the same seed and the same batches give bit-identical metrics.
    """
    config = config or LinearProbeConfig()
    device = begin_training(num_classes, config.epochs, device, seed)
    model: LinearProbe | None = None
    optimizer: torch.optim.Optimizer | None = None
    loss_fn = nn.CrossEntropyLoss()
    for epoch, loader in enumerate(epochs_of(train, config.epochs)):
        for features, labels in loader:
            pooled = pool_tokens(features.to(device, torch.float32), config.pool, config.prefix_tokens)
            if model is None or optimizer is None:
                # Built at the first batch because the feature dim is only known there; nothing
                # between manual_seed and here draws from the global generator.
                model = LinearProbe(pooled.shape[-1], num_classes).to(device)
                optimizer = adamw(model, config.lr, config.weight_decay)
            set_cosine_lr(optimizer, config.lr, epoch, config.epochs)
            if pooled.shape[0] < 2:
                continue  # BatchNorm cannot normalise a batch of one sample in training mode
            loss = loss_fn(model(pooled), _class_ids(labels, device, num_classes))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    if model is None:
        raise EmptySplit("the training loader yielded no batches; is the train split empty?")
    return evaluate_linear_probe(model, evaluate, num_classes=num_classes, device=device,
                                 pool=config.pool, prefix_tokens=config.prefix_tokens, prediction_sink=prediction_sink)


@torch.no_grad()
def evaluate_linear_probe(
    model: nn.Module,
    evaluate: Iterable[Batch],
    *,
    num_classes: int,
    device: torch.device,
    pool: str = "mean",
    prefix_tokens: int = 0,
    prediction_sink: Callable[[Tensor, Tensor], None] | None = None,
) -> dict[str, float]:
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
    probabilities, targets = [], []
    for features, labels in evaluate:
        pooled = pool_tokens(features.to(device, torch.float32), pool, prefix_tokens)
        logits = model(pooled)
        target = _class_ids(labels, device, num_classes)
        confusion += confusion_matrix(target, logits.argmax(dim=1), num_classes)
        probabilities.append(torch.softmax(logits, dim=1).cpu())
        targets.append(target.cpu())
        if prediction_sink is not None:
            prediction_sink(probabilities[-1], targets[-1])
    if not targets:
        raise EmptySplit("the evaluation loader yielded no batches; is the eval split empty?")
    auc = slide_auc(torch.cat(probabilities).double().numpy(), torch.cat(targets).numpy(), num_classes)
    return {"auc": auc, "balanced_accuracy": balanced_accuracy(confusion.cpu()),
            "macro_f1": macro_f1(confusion.cpu())}


def _class_ids(labels: Tensor, device: torch.device, num_classes: int) -> Tensor:
    return class_targets(labels, 1, device, num_classes, "the linear probe needs one class id per sample",
                         "use the seg probe for masks")


