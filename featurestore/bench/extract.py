"""``featurestore bench extract``: are writes hidden behind encoding?

In one run, on the same images and the same trivial encoder (a patch embedding + LayerNorm, so
the encoder is cheap and storage has the most chance to show):

* **encode only**: the extraction's own DataLoader, batch plan and encoder, results copied to the
  host and dropped;
* **extract**: ``featurestore.extract.run.extract`` into a fresh local store (float16, overflow
  guard, quantization report, chunk writes on the writer thread, commit);
* **write only**: ``create_split`` + ``write`` + ``commit`` of the same number of bytes from
  memory, for the store's raw write MB/s.

Target: extract wall time <= 1.1x encode-only. Repeats are interleaved and the best of each is
kept, because a shared machine is noisy.

On a CPU-only host the encoder, the image workers and the writer's quantization all share the
same cores, so the ratio there measures CPU contention as much as overlap. ``--device-ms`` adds
a wait per batch to the trivial encoder, during which the host CPU is free, as it is while an
accelerator computes: the ratio then shows whether the writes hide behind device time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any

import numpy as np

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


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("extract", help="extraction wall time vs encoding alone; write MB/s")
    parser.add_argument("--n", type=int, default=512, help="images (default 512)")
    parser.add_argument("--image-size", type=int, default=224, help="square image side (default 224)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--chunk-mb", type=float, default=8.0)
    parser.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: auto)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; the best is kept")
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="emulated accelerator time per batch of 64, host CPU idle (default 0)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    results = run(args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _encode_only(opts: Any) -> tuple[float, int]:
    import torch

    from featurestore.extract.encoders import load_encoder
    from featurestore.extract.run import (
        _autocast,
        _worker_init,
        plan_batches,
        resolve_device,
        resolve_precision,
    )
    from featurestore.extract.sources import Failure, PreparedImages, Preprocessing, collate, open_source

    start = time.perf_counter()
    source = open_source(opts.images)
    encoder = load_encoder(opts.encoder)
    device = resolve_device(opts.device)
    encoder.to(device)
    precision = resolve_precision(opts.precision, device)
    images = PreparedImages(source, Preprocessing(mean=encoder.mean, std=encoder.std))
    # The extraction's chunk rows for the same sample size, so both loops see the same batches.
    probe = images[0]
    assert not isinstance(probe, Failure)
    with torch.inference_mode():
        sample = encoder(probe[1][None].to(device))[:, 1:]
    rows = max(1, int(opts.chunk_mb * (1 << 20)) // (sample[0].numel() * 2))
    n = len(source)
    plan = plan_batches(list(range(-(-n // rows))), rows, n, opts.batch_size)
    workers = opts.num_workers if opts.num_workers is not None else min(4, max(0, (os.cpu_count() or 1) - 1))
    loader = torch.utils.data.DataLoader(images, batch_sampler=plan, num_workers=workers, collate_fn=collate,
                                         worker_init_fn=_worker_init if workers else None)
    nbytes = 0
    with torch.inference_mode():
        for batch in loader:
            assert not isinstance(batch, Failure)
            with _autocast(device, precision):
                out = encoder(batch[1].to(device))[:, 1:].contiguous().cpu()
            nbytes += out.numel() * 2  # as float16
    return time.perf_counter() - start, nbytes


def _write_only(store_url: str, n: int, sample_shape: tuple[int, ...], chunk_mb: float) -> float:
    from featurestore import open_store

    rng = np.random.default_rng(0)
    block = rng.standard_normal((64, *sample_shape), dtype=np.float32)
    start = time.perf_counter()
    writer = open_store(store_url, mode="a").create_split(
        "bench", "write-only", "s", num_samples=n, sample_shape=sample_shape, dtype="float16",
        chunk_bytes=int(chunk_mb * (1 << 20)))
    for lo in range(0, n, 64):
        writer.write(lo, block[: min(64, n - lo)])
    writer.commit()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> dict[str, Any]:
    from featurestore.extract.run import ExtractOptions, extract

    _DEVICE_SECONDS[0] = getattr(args, "device_ms", 0.0) / 1000.0
    work = args.workdir or tempfile.mkdtemp(prefix="fs-bench-extract-")
    os.makedirs(work, exist_ok=True)
    try:
        images_path = os.path.join(work, "images.npy")
        rng = np.random.default_rng(0)
        images = np.lib.format.open_memmap(images_path, mode="w+", dtype=np.uint8,
                                           shape=(args.n, args.image_size, args.image_size, 3))
        for lo in range(0, args.n, 64):
            images[lo : lo + 64] = rng.integers(0, 256, images[lo : lo + 64].shape, dtype=np.uint8)
        images.flush()
        del images
        encode_times, extract_times, write_times, waits = [], [], [], []
        nbytes = 0
        sample_shape: tuple[int, ...] = ()
        for repeat in range(args.repeats):
            opts = ExtractOptions(images=f"npy:{images_path}",
                                  encoder="python:featurestore.bench.extract:trivial_encoder",
                                  store=os.path.join(work, f"store-{repeat}"), dataset="bench", split="s",
                                  batch_size=args.batch_size, chunk_mb=args.chunk_mb,
                                  num_workers=args.num_workers, progress=False)
            seconds, nbytes = _encode_only(opts)
            encode_times.append(seconds)
            start = time.perf_counter()
            result = extract(opts)
            extract_times.append(time.perf_counter() - start)
            waits.append(result.writer_wait_seconds)
            sample_shape = tuple(result.metadata["sample_shape"])
            write_times.append(_write_only(os.path.join(work, f"write-{repeat}"), args.n, sample_shape, args.chunk_mb))
            shutil.rmtree(os.path.join(work, f"store-{repeat}"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, f"write-{repeat}"), ignore_errors=True)
        encode, extracted, write = min(encode_times), min(extract_times), min(write_times)
        results = {
            "benchmark": "extract",
            "images": args.n, "image_size": args.image_size, "batch_size": args.batch_size,
            "device_ms": getattr(args, "device_ms", 0.0), "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "sample_shape": list(sample_shape), "stored_dtype": "float16", "bytes": nbytes,
            "encode_only_s": encode, "extract_s": extracted, "ratio": extracted / encode, "target_ratio": 1.1,
            "writer_wait_s": waits[extract_times.index(extracted)],
            "extract_write_mb_s": nbytes / extracted / 1e6, "write_only_mb_s": nbytes / write / 1e6,
            "encode_only_img_s": args.n / encode, "extract_img_s": args.n / extracted,
            "repeats": {"encode_only_s": encode_times, "extract_s": extract_times, "write_only_s": write_times},
        }
    finally:
        _DEVICE_SECONDS[0] = 0.0
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"bench extract: {args.n} images {args.image_size}px -> {results['sample_shape']} float16, "
          f"{nbytes / 1e6:.0f} MB; device wait {results['device_ms']:g} ms/64 images; "
          f"{os.cpu_count()} cores, load {results['load_average_1m']:.1f}")
    print(f"  encode only {encode:.2f}s ({results['encode_only_img_s']:.0f} img/s); extract {extracted:.2f}s "
          f"({results['extract_img_s']:.0f} img/s): ratio {results['ratio']:.3f} (target <= 1.1)")
    print(f"  the encoder waited {results['writer_wait_s']:.2f}s for the writer (full queue + final drain)")
    print(f"  written during extraction {results['extract_write_mb_s']:.0f} MB/s; "
          f"write only (create_split+write+commit) {results['write_only_mb_s']:.0f} MB/s")
    return results


__all__ = ["register", "run", "trivial_encoder"]
