"""Compare int8 quantization schemes on ViT-like features (the table in docs/FORMAT.md "int8").

Schemes (symmetric, codes in [-127, 127], value back = code * scale):
  chunk-position  scale per (chunk, token, channel): absmax over the chunk's rows (what the writer does)
  chunk-channel   scale per (chunk, channel): absmax over the chunk's rows and tokens
  split-channel   scale per channel over the whole split (two passes: not streamable, offline only)
  row             one scale per sample (absmax over its tokens and channels)
  row-token       one scale per (sample, token)

Features: synthetic ViT-like tokens [N, T, D] with a few massive-activation channels (x100) and
high-norm prefix tokens (x20), Gaussian or heavy-tailed (Student-t(5)) values; and, with --tiny-vit, the demo
encoder builtin:tiny-vit on random images. Bytes are per sample relative to float16, scales
included, at the chunk rows a default 8 MiB int8 chunk gives.

    PYTHONPATH=. python scripts/int8_schemes.py [--tiny-vit]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

sys.path.insert(0, ".")
from featurestore.format import int8  # noqa: E402

CHUNK_BYTES = 8 << 20


def synthetic(n: int = 512, tokens: int = 21, dim: int = 384, seed: int = 0, tail: float = 0.0) -> np.ndarray:
    """Gaussian tokens (``tail``: Student-t with that many degrees of freedom instead), 4 channels
    with massive activations (x100), 5 prefix tokens (cls + 4 registers) with large norms (x20),
    an all-zero channel and a constant one."""
    rng = np.random.default_rng(seed)
    shape = (n, tokens, dim)
    x = (rng.standard_t(tail, size=shape) if tail else rng.standard_normal(shape)).astype(np.float32)
    x[:, :, rng.choice(np.arange(9, dim), 4, replace=False)] *= 100.0
    x[:, :5] *= 20.0
    x[:, :, 7] = 0.0
    x[:, :, 8] = 3.25
    return x


def tiny_vit(n: int = 256, seed: int = 0) -> np.ndarray:
    import torch

    from featurestore.extract.encoders import load_encoder

    encoder = load_encoder("builtin:tiny-vit")
    size = 8 * (encoder.patch_size or (16, 16))[0]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = [encoder(torch.rand(32, 3, size, size)) for _ in range(n // 32)]
    return torch.cat(out).float().numpy()


def by_axes(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    scale = (np.abs(x).max(axis=axes, keepdims=True).astype(np.float64) / 127).astype(np.float32)
    codes = np.clip(np.rint(np.divide(x, scale, out=np.zeros_like(x), where=scale > 0)), -127, 127)
    return codes.astype(np.float32) * scale


def schemes(x: np.ndarray, rows: int) -> dict[str, tuple[np.ndarray, float]]:
    """name -> (values back, scale bytes per sample)."""
    n, tokens, dim = x.shape
    out: dict[str, tuple[np.ndarray, float]] = {}
    chunks = range(0, n, rows)
    back = np.concatenate([int8.decode(*int8.encode(x[lo:lo + rows])[:2]) for lo in chunks])
    out["chunk-position"] = (back, 4 * tokens * dim / rows)
    out["chunk-channel"] = (np.concatenate([by_axes(x[lo:lo + rows], (0, 1)) for lo in chunks]), 4 * dim / rows)
    out["split-channel"] = (by_axes(x, (0, 1)), 4 * dim / n)
    out["row"] = (by_axes(x, (1, 2)), 4.0)
    out["row-token"] = (by_axes(x, (2,)), 4.0 * tokens)
    return out


def table(x: np.ndarray, name: str) -> list[str]:
    n, tokens, dim = x.shape
    rows = min(n, max(1, CHUNK_BYTES // (tokens * dim)))
    lines = [f"{name}: {n} x {tokens} x {dim}, chunk rows {rows}",
             "| scheme | rel RMS | max abs err / absmax | saturated | bytes vs float16 |",
             "|---|---|---|---|---|"]
    f16 = x.astype(np.float16).astype(np.float32)
    rel = float(np.sqrt(((f16 - x) ** 2).sum() / (x ** 2).sum()))
    lines.append(f"| float16 | {rel:.3%} | {np.abs(f16 - x).max() / np.abs(x).max():.2e} | 0 | 1.000 |")
    for scheme, (back, scale_bytes) in schemes(x, rows).items():
        rel = float(np.sqrt(((back - x) ** 2).sum() / (x ** 2).sum()))
        size = (tokens * dim + scale_bytes) / (2 * tokens * dim)
        worst = np.abs(back - x).max() / np.abs(x).max()
        lines.append(f"| {scheme} | {rel:.3%} | {worst:.2e} | 0 | {size:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-vit", action="store_true", help="also measure builtin:tiny-vit features (needs torch)")
    args = parser.parse_args()
    print("\n".join(table(synthetic(), "synthetic ViT-like, Gaussian (4 channels x100, 5 prefix tokens x20)")))
    print()
    print("\n".join(table(synthetic(tail=5.0), "synthetic ViT-like, Student-t(5) tails (same outliers)")))
    if args.tiny_vit:
        print()
        print("\n".join(table(tiny_vit(), "builtin:tiny-vit on random images")))


if __name__ == "__main__":
    main()
