"""``featurestore bench extract``: extraction wall time against encoding alone and numpy ``tofile``.

What it measures: docs/BENCHMARKS.md, "What each bench measures"; ``--wsi`` is
:mod:`featurestore.bench.extract_wsi`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from typing import Any

import numpy as np

from featurestore.bench import extract_wsi, harness
from featurestore.bench.harness import Method, interleaved

# Seconds the trivial encoder waits per batch (``--device-ms``); set by ``run`` in this process,
# which is where extraction calls the encoder.
_DEVICE_SECONDS = [0.0]


def trivial_encoder() -> Any:
    """``python:featurestore.bench.extract:trivial_encoder``: patch embedding (16 px, 384 channels)
    + LayerNorm with a mean-pooled CLS token, ``[B, 1 + P, 384]``. torch is imported here, not
    at module import, so ``featurestore --help`` stays light."""
    import torch

    class Trivial(torch.nn.Module):
        num_prefix_tokens = 1
        patch_size = 16

        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(0)
            self.proj = torch.nn.Conv2d(3, 384, 16, 16, bias=False)
            with torch.no_grad():
                self.proj.weight.copy_(torch.randn(self.proj.weight.shape, generator=generator) * 0.05)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if _DEVICE_SECONDS[0]:
                time.sleep(_DEVICE_SECONDS[0] * len(x) / 64)  # an accelerator's time per batch of 64
            grid = self.proj(x).flatten(2).transpose(1, 2)
            tokens = torch.cat([grid.mean(1, keepdim=True), grid], 1)
            return torch.nn.functional.layer_norm(tokens, (384,))

    return Trivial()


def zero_encoder() -> Any:
    """``python:featurestore.bench.extract:zero_encoder``: ``[B, 1 + 256, 384]`` float32 (a CLS
    token and a 16 x 16 grid at any image size) for no work: one precomputed tensor per (batch
    size, grid, device), returned as it is (the writer never modifies its input)."""
    import torch

    class Zero(torch.nn.Module):
        num_prefix_tokens = 1
        patch_size = 16

        def __init__(self) -> None:
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))  # so .to(device) has something to move
            self.cache: dict[tuple[int, int, str], torch.Tensor] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # A 16 x 16 grid whatever the image size (the patch follows it): small images keep the
            # image loader out of the ceiling while the features stay [256, 384].
            self.patch_size = max(1, x.shape[-1] // 16)
            tokens = 1 + (x.shape[-2] // self.patch_size) * (x.shape[-1] // self.patch_size)
            key = (len(x), tokens, str(x.device))
            if key not in self.cache:
                generator = torch.Generator().manual_seed(len(x))
                self.cache[key] = torch.randn((len(x), tokens, 384), generator=generator).to(x.device)
            return self.cache[key]

    return Zero()


ENCODERS = {"trivial": "python:featurestore.bench.extract:trivial_encoder",
            "zero": "python:featurestore.bench.extract:zero_encoder"}


def register(subparsers: Any) -> None:
    parser = harness.add_bench(subparsers, "extract", "extraction wall time vs encoding alone; write MB/s",
                               repeats=3, keep="best")
    parser.add_argument("--n", type=int, default=512, help="images (default 512)")
    parser.add_argument("--image-size", type=int, default=224, help="square image side (default 224)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunk-mb", type=float, default=8.0)
    parser.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: auto)")
    parser.add_argument("--encoder", default="trivial",
                        help="trivial (patch embedding + LayerNorm), zero (zero-cost: the pipeline's own "
                        "ceiling) or any encoder spec, e.g. builtin:vit-s14 (a ViT-S/14's cost, no download) "
                        "or timm:vit_small_patch14_dinov2,pretrained=false,img_size=224; with --wsi the "
                        "default is zero")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda (default auto)")
    parser.add_argument("--precision", default="auto", help="auto, bf16 or fp32 (default auto: bf16 on CUDA)")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="emulated accelerator time per batch of 64, host CPU idle (default 0)")
    extract_wsi.add_arguments(parser)


def _encode_only(opts: Any) -> tuple[float, Any]:
    """The extraction's loader, batches and encoder, the device synchronised per batch; the
    features are dropped. Returns (seconds, the first batch's features, on the device)."""
    from featurestore.extract.encode_loop import default_num_workers
    from featurestore.extract.sources import Failure, PreparedImages, Preprocessing, collate, open_source

    source = open_source(opts.images)
    n = len(source)
    # New splits hold whole batches per chunk, so extraction's plan is these consecutive batches.
    plan = [list(range(a, min(a + opts.batch_size, n))) for a in range(0, n, opts.batch_size)]
    workers = opts.num_workers if opts.num_workers is not None else default_num_workers()

    def call(encoder: Any, batch: Any, device: Any) -> Any:
        assert not isinstance(batch, Failure)
        return encoder(batch[1].to(device, non_blocking=True))

    return extract_wsi.encode_pass(opts, lambda e: PreparedImages(source, Preprocessing(mean=e.mean, std=e.std)),
                                   plan, workers, collate, call)


def compare_device_stats(features: Any, logical: str = "float16") -> dict[str, Any]:
    """The writer's statistics of one batch on its device and on the CPU: byte identity of the
    stored values, equality of the maxima, the largest relative difference of the sums."""
    from featurestore.core import device_stats

    tokens = features[:, -256:] if features.ndim == 3 else features  # patch tokens, as stored
    channels = int(tokens.shape[-1])
    here = device_stats.prepare(tokens, logical, channels, 0)
    cpu = device_stats.prepare(tokens.cpu(), logical, channels, 0)
    out: dict[str, Any] = {"device": str(tokens.device), "shape": list(tokens.shape),
                           "source_dtype": str(tokens.dtype).removeprefix("torch."),
                           "bytes_identical": here.stored.tobytes() == cpu.stored.tobytes()}
    for name in ("abs_max", "max_abs_error", "max_rel_error"):
        out[f"{name}_identical"] = bool(np.array_equal(getattr(here.rows, name), getattr(cpu.rows, name)))
    for name in ("sq_error", "sq_source", "mean", "m2"):
        a, b = getattr(here.rows, name), getattr(cpu.rows, name)
        scale = np.maximum(np.abs(b), 1e-30)
        out[f"{name}_max_rel_diff"] = float((np.abs(a - b) / scale).max())
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "wsi", False):  # whole-slide extraction: its own bench (featurestore.bench.extract_wsi)
        return extract_wsi.run(args)
    from featurestore.extract.run import ExtractOptions, extract

    _DEVICE_SECONDS[0] = getattr(args, "device_ms", 0.0) / 1000.0
    encoder = getattr(args, "encoder", "trivial")
    spec = ENCODERS.get(encoder, encoder)
    try:
        with harness.scratch(args, "extract") as work:
            images_path = os.path.join(work, "images.npy")
            rng = np.random.default_rng(0)
            images = np.lib.format.open_memmap(images_path, mode="w+", dtype=np.uint8,
                                               shape=(args.n, args.image_size, args.image_size, 3))
            for lo in range(0, args.n, 64):
                images[lo : lo + 64] = rng.integers(0, 256, images[lo : lo + 64].shape, dtype=np.uint8)
            images.flush()
            del images
            opts = ExtractOptions(images=f"npy:{images_path}", encoder=spec, store=os.path.join(work, "store"),
                                  dataset="bench", split="s", batch_size=args.batch_size, chunk_mb=args.chunk_mb,
                                  num_workers=args.num_workers, progress=False, device=getattr(args, "device", "auto"),
                                  precision=getattr(args, "precision", "auto"))
            waits: list[float] = []
            state: dict[str, Any] = {}

            def encode_only() -> float:
                seconds, state["first"] = _encode_only(opts)
                return seconds

            def run_extract() -> None:
                result = extract(opts)
                os.sync()  # the same finish line as tofile's
                waits.append(result.writer_wait_seconds)
                state["shape"] = tuple(result.metadata["sample_shape"])

            def stored_bytes() -> int:
                return args.n * int(np.prod(state["shape"])) * 2

            def block(rows: int) -> np.ndarray:
                return np.random.default_rng(0).standard_normal((rows, *state["shape"]), dtype=np.float32)

            def write_raw(path: str) -> float:  # the disk's own write rate, for the same bytes
                seconds = harness.tofile_synced(path, block(args.n).astype(np.float16))
                os.unlink(path)
                return seconds

            def clean() -> None:
                for path in ("store", "write"):
                    shutil.rmtree(os.path.join(work, path), ignore_errors=True)
                os.sync()

            # Interleaved: a slow moment hits every method alike.
            times = interleaved([Method("encode_only_s", encode_only, own=True), Method("extract_s", run_extract),
                                 Method("tofile_s", lambda: write_raw(os.path.join(work, "raw")), own=True),
                                 Method("write_only_s", lambda: harness.write_synced(
                                     os.path.join(work, "write"), block(64), 64, n=args.n,
                                     chunk_bytes=int(args.chunk_mb * (1 << 20))), teardown=clean, own=True)],
                                args.repeats)
            sample_shape, first = state["shape"], state["first"]
            nbytes = stored_bytes()
            best = {name: min(values) for name, values in times.items()}
            encode, extracted, write, tofile = best["encode_only_s"], best["extract_s"], best["write_only_s"], best["tofile_s"]
            results = {
                "benchmark": "extract", "encoder": spec, "device": str(getattr(args, "device", "auto")),
                "images": args.n, "image_size": args.image_size, "batch_size": args.batch_size,
                "device_ms": getattr(args, "device_ms", 0.0), "cpu_count": os.cpu_count(),
                "load_average_1m": os.getloadavg()[0],
                "sample_shape": list(sample_shape), "stored_dtype": "float16", "bytes": nbytes,
                "encode_only_s": encode, "extract_s": extracted, "ratio": extracted / encode,
                "tofile_s": tofile, "extract_vs_tofile": tofile / extracted,
                "writer_wait_s": waits[times["extract_s"].index(extracted)],
                "extract_write_mb_s": nbytes / extracted / 1e6, "write_only_mb_s": nbytes / write / 1e6,
                "tofile_mb_s": nbytes / tofile / 1e6,
                "encode_only_img_s": args.n / encode, "extract_img_s": args.n / extracted,
                "repeats": dict(times),
            }
            if first is not None and first.device.type != "cpu":
                results["device_vs_cpu_stats"] = compare_device_stats(first.float())
    finally:
        _DEVICE_SECONDS[0] = 0.0
    return results


__all__ = ["compare_device_stats", "register", "run", "trivial_encoder", "zero_encoder"]
