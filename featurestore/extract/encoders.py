"""Encoders for extraction: ``builtin:`` (tiny-vit, vit-s14, vit-l14), ``python:``, ``torchhub:``,
``hf:`` and ``timm:`` specs, and the token layout of their output.

``timm:`` specs live in :mod:`featurestore.extract.timm_models`; the :class:`Encoder` wrapper every
spec loads into, its error and the weights hash in :mod:`featurestore.extract.encoder_base`
(re-exported here).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from featurestore.extract.encoder_base import IMAGENET_MEAN, IMAGENET_STD, Encoder, EncoderError, int_pair
from featurestore.extract.encoder_base import sanitize_name, weights_hash
from featurestore.extract.sources import import_callable

TOKEN_MODES = ("patch", "cls", "all")


# --------------------------------------------------------------------------- builtin: ViTs
class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """A ViT with a CLS token, register tokens and a patch grid (DINOv2-reg layout).

    The defaults are sized for CPU demos (dim 128, 3 blocks: ~0.7 M parameters); ``BUILTINS``
    also builds it at ViT-S/14 and ViT-L/14 sizes, real encoders' cost without a download.
    Weights come from a fixed seed, so every machine builds the same encoder and the same weights
    hash. Positional embeddings are fixed 2-D sin-cos, computed for any grid, so images of any size
    divisible by the patch size work without interpolation.
    """

    def __init__(self, *, dim: int = 128, depth: int = 3, heads: int = 4, patch_size: int = 16,
                 registers: int = 2, mlp_ratio: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.num_prefix_tokens = 1 + registers
        self.dim = dim
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.register_tokens = nn.Parameter(torch.zeros(1, registers, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("bias"):
                    param.zero_()
                elif "norm" in name:
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            # A visible mean per channel makes the channel statistics and float16 error non-trivial.
            self.norm.bias.copy_(torch.randn(dim, generator=generator) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embed(x)
        gh, gw = patches.shape[-2:]
        tokens = patches.flatten(2).transpose(1, 2) + _sincos_2d(gh, gw, self.dim).to(patches)
        b = x.shape[0]
        x = torch.cat([self.cls_token.expand(b, -1, -1), self.register_tokens.expand(b, -1, -1), tokens], 1)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _sincos_2d(gh: int, gw: int, dim: int) -> torch.Tensor:
    quarter = dim // 4
    omega = 1.0 / (10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter))
    ys, xs = torch.meshgrid(torch.arange(gh, dtype=torch.float32), torch.arange(gw, dtype=torch.float32), indexing="ij")
    out = [torch.sin(ys.reshape(-1, 1) * omega), torch.cos(ys.reshape(-1, 1) * omega),
           torch.sin(xs.reshape(-1, 1) * omega), torch.cos(xs.reshape(-1, 1) * omega)]
    emb = torch.cat(out, 1)
    return F.pad(emb, (0, dim - emb.shape[1]))[None]


BUILTINS: dict[str, Callable[[], nn.Module]] = {
    "tiny-vit": TinyViT,
    # DINOv2-reg ViT-S/14 (22 M parameters) and ViT-L/14 (304 M) shapes with seeded random
    # weights: what a pathology encoder costs per image (e.g. `bench extract`), no download.
    "vit-s14": functools.partial(TinyViT, dim=384, depth=12, heads=6, patch_size=14, registers=4),
    "vit-l14": functools.partial(TinyViT, dim=1024, depth=24, heads=16, patch_size=14, registers=4),
}


class _ForwardFeatures(nn.Module):
    """Calls ``forward_features`` (DINOv2 / timm hub models return all tokens there)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> Any:
        forward_features: Callable[[torch.Tensor], Any] = getattr(self.model, "forward_features")
        return forward_features(x)


class _HFModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).last_hidden_state


def _module_hints(module: Any) -> tuple[int | None, tuple[int, int] | None]:
    """Prefix tokens and patch size from the attributes common encoders expose (timm, DINOv2)."""
    prefix = getattr(module, "num_prefix_tokens", None)
    if prefix is None and getattr(module, "num_register_tokens", None) is not None:
        prefix = 1 + int(module.num_register_tokens)  # DINOv2: CLS + registers
    if prefix is None:
        prefix = getattr(module, "prefix_tokens", None)
    patch = getattr(module, "patch_size", None)
    if patch is None and hasattr(module, "patch_embed"):
        patch = getattr(module.patch_embed, "patch_size", None)
    return (int(prefix) if prefix is not None else None), int_pair(patch)


def load_encoder(spec: str) -> Encoder:
    """Parse an encoder SPEC (see docs/EXTRACT.md) and load it on the CPU."""
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise EncoderError(f"invalid encoder spec {spec!r}: use builtin:NAME ({', '.join(BUILTINS)}), python:MODULE:FACTORY, "
                           "torchhub:REPO_OR_DIR:ENTRY, hf:MODEL_ID_OR_DIR or timm:MODEL_NAME")
    if kind == "builtin":
        if rest not in BUILTINS:
            raise EncoderError(f"unknown builtin encoder {rest!r}: available: {', '.join(sorted(BUILTINS))}")
        with torch.random.fork_rng(devices=[]):  # module construction must not move the user's RNG
            module = BUILTINS[rest]()
        prefix, patch = _module_hints(module)
        return Encoder(module.eval(), spec, rest, weights_hash(module, spec), prefix, patch)
    if kind == "python":
        factory = import_callable(rest, "encoder", EncoderError)
        try:
            module = factory()
        except Exception as error:
            raise EncoderError(f"encoder factory {spec!r} failed: {type(error).__name__}: {error}") from error
        if not callable(module):
            raise EncoderError(f"encoder factory {spec!r} returned {type(module).__name__}, not a module or callable")
        prefix, patch = _module_hints(module)
        qualname = getattr(module, "__qualname__", type(module).__qualname__)
        return Encoder(module, spec, sanitize_name(rest.rpartition(":")[2]),
                       weights_hash(module, f"{spec}|{qualname}"), prefix, patch)
    if kind == "torchhub":
        return _load_torchhub(spec, rest)
    if kind == "hf":
        return _load_hf(spec, rest)
    if kind == "timm":
        from featurestore.extract.timm_models import load_timm  # imports timm only for timm: specs

        return load_timm(spec, rest)
    raise EncoderError(f"unknown encoder kind {kind!r} in {spec!r}: use builtin:, python:, torchhub:, hf: or timm:")


def _load_torchhub(spec: str, rest: str) -> Encoder:
    repo, sep, entry = rest.rpartition(":")
    if not sep or not repo or not entry:
        raise EncoderError(f"invalid torchhub spec {spec!r}: use torchhub:REPO_OR_DIR:ENTRY")
    local = os.path.isdir(repo)
    try:
        # A local directory with a hubconf.py loads offline; otherwise torch.hub fetches GitHub.
        model = torch.hub.load(repo, entry, source="local" if local else "github", trust_repo=True)
    except Exception as error:
        raise EncoderError(f"cannot load torchhub encoder {spec!r}: {type(error).__name__}: {error}") from error
    prefix, patch = _module_hints(model)
    module: Any = _ForwardFeatures(model) if hasattr(model, "forward_features") else model
    return Encoder(module, spec, sanitize_name(entry), weights_hash(model, spec), prefix, patch)


def _load_hf(spec: str, rest: str) -> Encoder:
    try:
        import transformers
    except ImportError as error:
        raise EncoderError("hf: encoders need transformers: pip install 'featurestore[hf]'") from error
    try:
        model = transformers.AutoModel.from_pretrained(rest)
    except Exception as error:
        raise EncoderError(f"cannot load hf encoder {rest!r}: {type(error).__name__}: {error}") from error
    config = model.config
    registers = getattr(config, "num_register_tokens", None)
    prefix = None if registers is None else 1 + int(registers)
    mean, std = IMAGENET_MEAN, IMAGENET_STD
    try:  # the model's own normalisation, when it ships a preprocessor config
        processor = transformers.AutoImageProcessor.from_pretrained(rest)
        mean = tuple(float(v) for v in processor.image_mean)  # type: ignore[assignment]
        std = tuple(float(v) for v in processor.image_std)  # type: ignore[assignment]
    except Exception:  # no preprocessor_config.json: keep the ImageNet statistics
        pass
    name = os.path.basename(rest.rstrip("/")) if os.path.isdir(rest) else rest
    return Encoder(_HFModel(model).eval(), spec, sanitize_name(name), weights_hash(model, spec), prefix,
                   int_pair(getattr(config, "patch_size", None)), mean, std)


# --------------------------------------------------------------------------- token layout
@dataclass(frozen=True)
class TokenLayout:
    mode: str
    encoder_tokens: int
    encoder_prefix_tokens: int | None
    grid: tuple[int, int] | None

    def select(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.mode == "patch":
            return tokens[:, self.encoder_prefix_tokens or 0 :]
        if self.mode == "cls":
            return tokens[:, 0]
        return tokens

    def to_dict(self) -> dict[str, Any]:
        """The split's ``token_layout``: prefix tokens and grid *of the stored samples*."""
        stored_prefix = {"patch": 0, "cls": 0, "all": self.encoder_prefix_tokens or 0}[self.mode]
        return {"tokens": self.mode, "prefix_tokens": stored_prefix,
                "grid": list(self.grid) if self.grid and self.mode != "cls" else None,
                "encoder_tokens": self.encoder_tokens, "encoder_prefix_tokens": self.encoder_prefix_tokens}


def resolve_layout(encoder: Encoder, tokens: int, image_hw: tuple[int, int], mode: str,
                   prefix_override: int | None = None) -> TokenLayout:
    """Work out prefix tokens and the patch grid, from what the encoder tells or the shapes."""
    if mode not in TOKEN_MODES:
        raise EncoderError(f"--tokens {mode!r} is not one of {', '.join(TOKEN_MODES)}")
    prefix = prefix_override if prefix_override is not None else encoder.prefix_tokens
    h, w = image_hw
    grid: tuple[int, int] | None = None
    if encoder.patch_size is not None:
        grid = (h // encoder.patch_size[0], w // encoder.patch_size[1])
        if prefix is None:
            prefix = tokens - grid[0] * grid[1]
    elif prefix is None:
        # No hints: take the patch size whose grid leaves a small number of prefix tokens.
        for patch in (16, 14, 8, 32, 4, 2, 1):
            if h % patch == 0 and w % patch == 0 and 0 <= tokens - (h // patch) * (w // patch) <= 16:
                grid, prefix = (h // patch, w // patch), tokens - (h // patch) * (w // patch)
                break
    if prefix is not None and grid is None:
        side = math.isqrt(max(0, tokens - prefix))
        grid = (side, side) if side * side == tokens - prefix else None
    if prefix_override is not None and not 0 <= prefix_override <= tokens:
        raise EncoderError(f"--prefix-tokens {prefix_override} does not fit encoder {encoder.spec}'s {tokens} tokens: "
                           f"give 0..{tokens} (its CLS + register tokens), or leave it out")
    if prefix is None or not 0 <= prefix <= tokens:
        if mode == "all":
            return TokenLayout(mode, tokens, None, None)
        raise EncoderError(f"cannot tell how many of encoder {encoder.spec}'s {tokens} tokens are CLS/register "
                           f"tokens for --tokens {mode}: pass --prefix-tokens N (or --tokens all)")
    if grid is not None and grid[0] * grid[1] != tokens - prefix:
        grid = None
    if mode == "cls" and prefix < 1:
        raise EncoderError(f"encoder {encoder.spec} has no CLS token (0 prefix tokens): use --tokens patch or all")
    if mode == "patch" and prefix == tokens:
        raise EncoderError(f"encoder {encoder.spec} returned only prefix tokens: use --tokens cls or all")
    return TokenLayout(mode, tokens, prefix, grid)

