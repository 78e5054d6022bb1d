"""``timm:NAME[,KEY=VALUE...]`` encoders: any ``timm.create_model`` architecture, pretrained or not.

Pathology foundation models (UNI, Virchow, H-optimus, Prov-GigaPath) ship as timm models, so a
timm spec covers most of them:

- ``timm:vit_small_patch14_dinov2.lvd142m``: timm's pretrained weights (from the Hugging Face hub);
- ``timm:hf-hub:bioptimus/H-optimus-0``: a hub model id, passed to timm as given (also
  ``local-dir:DIR``); reachable hubs only: this module never downloads anything itself;
- ``timm:vit_large_patch16_224,checkpoint=./uni.bin,img_size=224,init_values=1e-5``: the
  architecture from timm, the weights from a local file, loaded through timm's own pretrained
  loader (``pretrained_cfg_overlay=dict(file=...)``, which drops a classifier head the file has and
  the model has not, and applies the architecture's checkpoint filter);
- ``timm:vit_small_patch14_reg4_dinov2,pretrained=false``: random weights (tests, a baseline).

Options after the name, comma-separated: ``pretrained`` (default true), ``checkpoint=FILE``,
``img_size=N``, ``dynamic_img_size=true|false``, and any other ``create_model`` keyword whose
value is a bool, int, float or string (``depth=2``, ``embed_dim=64``, ``init_values=1e-5``).
The model is built with ``num_classes=0`` and called through ``forward_features``, which returns
every token (prefix tokens first) for ViTs, ``[B, C, H, W]`` maps for CNNs (turned into row-major
grid tokens here). The token layout comes from the model: ``num_prefix_tokens`` (CLS and register
tokens) and the patch embedding's patch size, so the grid follows the image size; mean/std from
the model's ``pretrained_cfg``. The weights hash covers whatever weights the model ends up with,
so a checkpoint file changes the cache key.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from featurestore.extract.encoder_base import IMAGENET_MEAN, IMAGENET_STD, Encoder, EncoderError, int_pair
from featurestore.extract.encoder_base import sanitize_name, weights_hash

__all__ = ["TimmFeatures", "load_timm", "parse_timm_spec"]

_BOOL = {"true": True, "false": False}


def _value(text: str) -> Any:
    """``true``/``false`` -> bool, then int, then float, else the string itself."""
    if text.lower() in _BOOL:
        return _BOOL[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_timm_spec(spec: str, rest: str) -> tuple[str, dict[str, Any]]:
    """``NAME,KEY=VALUE,...`` -> (model name, options), or :class:`EncoderError`."""
    name, *pairs = rest.split(",")
    if not name:
        raise EncoderError(f"invalid timm spec {spec!r}: use timm:MODEL_NAME[,pretrained=false]"
                           "[,checkpoint=FILE][,img_size=N][,KEY=VALUE...]")
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise EncoderError(f"invalid option {pair!r} in timm spec {spec!r}: options are KEY=VALUE, "
                               "comma-separated (e.g. timm:vit_small_patch14_dinov2,pretrained=false)")
        if key in options:
            raise EncoderError(f"option {key!r} given twice in timm spec {spec!r}")
        options[key] = text if key == "checkpoint" else _value(text.strip())
    if "pretrained" in options and not isinstance(options["pretrained"], bool):
        raise EncoderError(f"pretrained={options['pretrained']!r} in timm spec {spec!r}: use true or false")
    return name, options


class TimmFeatures(nn.Module):
    """``forward_features`` of a timm model as ``[B, T, D]`` tokens (CNN maps -> grid tokens)."""

    def __init__(self, model: nn.Module, spec: str) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        patch_embed = getattr(model, "patch_embed", None)
        # A fixed-size ViT refuses other image sizes deep inside; say which option fixes it.
        fixed = patch_embed is not None and not getattr(patch_embed, "dynamic_img_size", False) \
            and getattr(patch_embed, "strict_img_size", False)
        self.fixed_size = int_pair(getattr(patch_embed, "img_size", None)) if fixed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_size is not None and tuple(x.shape[-2:]) != self.fixed_size:
            h, w = self.fixed_size
            raise EncoderError(
                f"timm encoder {self.spec} takes {h}x{w} images but got {x.shape[-2]}x{x.shape[-1]}: "
                f"add img_size={x.shape[-2]} (or dynamic_img_size=true) to the spec, or "
                f"--crop/--resize {h} {w}")
        forward_features: Any = getattr(self.model, "forward_features")
        out = forward_features(x)
        if isinstance(out, torch.Tensor) and out.ndim == 4:  # CNN: [B, C, H, W] -> [B, H*W, C]
            return out.flatten(2).transpose(1, 2)
        return out


def load_timm(spec: str, rest: str) -> Encoder:
    """Build ``timm:`` encoder ``rest`` on the CPU (see the module docstring)."""
    name, options = parse_timm_spec(spec, rest)
    try:
        import timm
    except ImportError as error:
        raise EncoderError("timm: encoders need timm: pip install 'featurestore[timm]'") from error
    except Exception as error:  # e.g. a torchvision built for another torch fails at import
        raise EncoderError(f"timm does not import here ({type(error).__name__}: {error}); timm needs a "
                           "torchvision built for the installed torch") from error
    checkpoint = options.pop("checkpoint", None)
    pretrained = bool(options.pop("pretrained", True))
    kwargs: dict[str, Any] = {"num_classes": 0, **options}
    if checkpoint is not None:
        if not os.path.isfile(checkpoint):
            raise EncoderError(f"checkpoint file {checkpoint!r} of timm spec {spec!r} does not exist")
        # timm's pretrained loader reads the file instead of the hub (and adapts heads/filters).
        kwargs["pretrained_cfg_overlay"] = {"file": os.path.abspath(checkpoint)}
        pretrained = True
    try:
        with torch.random.fork_rng(devices=[]):  # random init must not move the user's RNG
            model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except Exception as error:
        hint = ""
        if pretrained and checkpoint is None:
            hint = ("; the pretrained weights come from a hub: without one, pass checkpoint=FILE "
                    "(local weights) or pretrained=false (random weights)")
        elif checkpoint is not None:
            hint = f"; is {checkpoint!r} a state dict for {name}?"
        raise EncoderError(f"cannot build timm encoder {spec!r}: {type(error).__name__}: {error}{hint}") from error
    if not hasattr(model, "forward_features"):
        raise EncoderError(f"timm model {name!r} has no forward_features: it cannot give tokens")
    model.eval()
    cfg = getattr(model, "pretrained_cfg", None) or {}
    mean = tuple(float(v) for v in cfg.get("mean", IMAGENET_MEAN))
    std = tuple(float(v) for v in cfg.get("std", IMAGENET_STD))
    if len(mean) != 3 or len(std) != 3:
        mean, std = IMAGENET_MEAN, IMAGENET_STD
    prefix = getattr(model, "num_prefix_tokens", None)
    patch_embed = getattr(model, "patch_embed", None)
    patch = int_pair(getattr(patch_embed, "patch_size", None)) if patch_embed is not None else None
    if patch_embed is None:  # a CNN: every token is a grid cell, the stride sets the grid
        prefix = 0
        reduction = (getattr(model, "feature_info", None) or [{}])[-1].get("reduction")
        patch = int_pair(reduction)
    default_name = name.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return Encoder(TimmFeatures(model, spec).eval(), spec, sanitize_name(default_name), weights_hash(model, spec),
                   int(prefix) if prefix is not None else None, patch,
                   mean, std)  # type: ignore[arg-type]
