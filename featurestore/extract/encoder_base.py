"""What every encoder is, whatever loads it: the :class:`Encoder` wrapper, its error, the weights
hash and the small helpers the loaders share (``encoders`` for builtin/python/torchhub/hf specs,
``timm_models`` for timm specs; both import this module, neither imports the other at import time).

:class:`Encoder` runs a module on ``[B, 3, H, W]`` float images and returns ``[B, T, D]`` tokens,
refusing anything else with one clear message. It also carries what the split's metadata needs:
the weights hash (sha256 over the state dict, tensors in sorted-name order, each with its name,
dtype and shape), the count of prefix tokens (CLS and register tokens before the patch grid) and
the patch size, when the encoder tells.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featurestore.errors import FeatureStoreError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class EncoderError(FeatureStoreError, ValueError):
    """An encoder spec that does not load, or an encoder whose output is not ``[B, T, D]``."""



@dataclass
class Encoder:
    """A loaded encoder and what the split's metadata records about it."""

    module: Callable[[torch.Tensor], Any]
    spec: str
    default_name: str
    weights_hash: str
    prefix_tokens: int | None = None
    patch_size: tuple[int, int] | None = None
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def to(self, device: torch.device) -> Encoder:
        if isinstance(self.module, nn.Module):
            self.module = self.module.to(device).eval()
        return self

    def __call__(self, images: torch.Tensor, *, vectors: bool = False) -> torch.Tensor:
        """``[B, 3, H, W]`` -> ``[B, T, D]`` float tokens, or :class:`EncoderError`; with
        ``vectors=True`` an encoder's ``[B, D]`` embeddings pass too (slide patches, one row each)."""
        try:
            out = self.module(images)
        except FeatureStoreError:
            raise
        except Exception as error:  # the user's forward failed: one line, with the input shape
            raise EncoderError(f"encoder {self.spec} failed on a batch of shape {list(images.shape)}: "
                               f"{type(error).__name__}: {error}") from error
        tokens = _as_tokens(out, self)
        ranks = (2, 3) if vectors else (3,)
        if not isinstance(tokens, torch.Tensor) or tokens.ndim not in ranks or tokens.shape[0] != images.shape[0]:
            got = f"shape {list(tokens.shape)}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            want = "[B, T, D] tokens (batch, tokens, channels) or [B, D] embeddings" if vectors else \
                "[B, T, D] tokens (batch, tokens, channels)"
            raise EncoderError(f"encoder {self.spec} returned {got} for {images.shape[0]} images; it must "
                               f"return {want}")
        if not tokens.is_floating_point():
            raise EncoderError(f"encoder {self.spec} returned {tokens.dtype} tokens; it must return floats")
        return tokens


def _as_tokens(out: Any, encoder: Encoder) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "last_hidden_state"):  # transformers ModelOutput
        return out.last_hidden_state
    if isinstance(out, dict) and "x_norm_patchtokens" in out:  # DINOv2 forward_features
        parts = [out["x_norm_clstoken"][:, None]]
        if out.get("x_norm_regtokens") is not None:
            parts.append(out["x_norm_regtokens"])
        parts.append(out["x_norm_patchtokens"])
        encoder.prefix_tokens = sum(p.shape[1] for p in parts[:-1])
        return torch.cat(parts, 1)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return out



def weights_hash(module: Any, fallback: str) -> str:
    """sha256 over the state dict (sorted names; name, dtype, shape and raw bytes of each).

    A plain callable has no weights; its hash covers ``fallback`` (the spec and qualified name),
    so two different callables never share a cache key.
    """
    h = hashlib.sha256()
    if not isinstance(module, nn.Module):
        h.update(f"callable|{fallback}".encode())
        return h.hexdigest()
    for name, tensor in sorted(module.state_dict().items()):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(tensor.shape)}\n".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy().data)
    return h.hexdigest()


def int_pair(value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return int(value[0]), int(value[-1])
    return int(value), int(value)



def sanitize_name(text: str) -> str:
    """A valid store name from an arbitrary string (used for default encoder names)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")[:128]
    return name or "encoder"


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Encoder", "EncoderError", "int_pair", "sanitize_name", "weights_hash"]
