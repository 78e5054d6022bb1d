"""``featurestore extract``: images -> frozen encoder -> a complete split (docs/EXTRACT.md).

``--images wsi:...`` goes to the slide extraction (featurestore.extract.wsi_run): one bag per
slide, exit status 3 when the split is complete but some slides were skipped.

Runs as one process or under ``torchrun --nproc-per-node K featurestore extract ...``. torch and
the extraction machinery are imported inside ``run`` so ``featurestore --help`` stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from featurestore.commands.parsers import RESUME_SPLIT, add_verb
from featurestore.commands.report_line import nothing_to_do, quantization_line
from featurestore.commands.storeargs import add_rewrite_options, add_storage_options, store_errors
from featurestore.commands.storeargs import options_from_args as store_options
from featurestore.commands.workerargs import add_worker_options, worker_options
from featurestore.errors import InvalidOption


def _size(values: list[int] | None, flag: str) -> tuple[int, int] | None:
    if values is None:
        return None
    if len(values) not in (1, 2) or any(v < 1 for v in values):
        raise InvalidOption(f"{flag} takes one or two positive integers (H [W]), but got: {values}")
    return (values[0], values[-1])


def _triple(values: list[float] | None, flag: str) -> tuple[float, float, float] | None:
    if values is None:
        return None
    if len(values) == 1:
        values = values * 3
    if len(values) != 3:
        raise InvalidOption(f"{flag} takes 1 or 3 numbers (R G B), but got: {values}")
    return (values[0], values[1], values[2])


DESCRIPTION = """\
Encode an image source with a frozen encoder and write the features (and labels) into a split of a store.
Resumable (--resume), several processes under torchrun. A wsi: source (whole-slide images through OpenSlide)
writes a bag split, one bag per slide; a slide that cannot be used is skipped with one line naming it, and the
exit status is then 3.
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "extract", run, "encode images with a frozen encoder into a split", DESCRIPTION,
                 interrupted=RESUME_SPLIT)
    req = p.add_argument_group("required")
    req.add_argument("--images", required=True, metavar="SOURCE",
                     help="npy:IMAGES.npy | pannuke:DIR | folder:DIR | python:MODULE:FACTORY | "
                     "wsi:DIR | wsi:SLIDE | wsi:LIST.csv (whole-slide images, one bag per slide)")
    req.add_argument("--encoder", required=True, metavar="SPEC",
                     help="builtin:tiny-vit|vit-s14|vit-l14 | python:MODULE:FACTORY | torchhub:REPO_OR_DIR:ENTRY | hf:MODEL_ID_OR_DIR | timm:NAME[,KEY=VALUE...]")
    req.add_argument("--store", required=True, metavar="URL", help="store path or fsspec URL (s3://bucket/prefix)")
    req.add_argument("--dataset", required=True, metavar="NAME")
    req.add_argument("--split", required=True, metavar="NAME")
    p.add_argument("--encoder-name", metavar="NAME", help="name of the encoder in the store (default: from SPEC)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32", "int8"),
                   help="storage dtype; auto: the encoder's float16/bfloat16, else float16 under the overflow guard; "
                        "int8: half float16's bytes, ~0.5%% relative RMS error (docs/FORMAT.md)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    add_rewrite_options(p)
    p.add_argument("--chunk-mb", type=float, default=8.0,
                   help="chunk size target in MiB (default 8), rounded to whole batches of --batch-size")
    p.add_argument("--precision", default="auto", choices=("auto", "bf16", "fp32"),
                   help="encoder compute: auto = bf16 autocast on CUDA, float32 on CPU")
    p.add_argument("--tokens", default=None, choices=("patch", "cls", "all", "mean"),
                   help="tokens kept: the patch grid (default), the CLS token, or all; for wsi: sources, one "
                   "vector per patch: cls (default) or mean (of the patch tokens)")
    p.add_argument("--prefix-tokens", type=int, default=None, metavar="N",
                   help="CLS + register tokens before the patch grid, if the encoder does not say")
    p.add_argument("--labels", metavar="FILE", help="labels [N, ...] (.npy) for an npy: source; for wsi: a CSV "
                   "with slide_id,label columns (one number per slide)")
    p.add_argument("--num-workers", type=int, default=None, metavar="N", help="DataLoader workers (default: auto)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N images (slides)")
    p.add_argument("--crop", type=int, nargs="+", metavar="PX", help="centre crop before resizing: H, or H W")
    p.add_argument("--resize", type=int, nargs="+", metavar="PX", help="resize (bilinear, antialiased): H, or H W")
    p.add_argument("--mean", type=float, nargs="+", metavar="M", help="normalisation mean (default: the encoder's)")
    p.add_argument("--std", type=float, nargs="+", metavar="S", help="normalisation std (default: the encoder's)")
    p.add_argument("--compressor", default=None, help="opt-in chunk compression (see docs/FORMAT.md)")
    slides = p.add_argument_group("whole-slide images (wsi: sources; docs/EXTRACT.md)")
    scale = slides.add_mutually_exclusive_group()
    scale.add_argument("--magnification", type=float, default=None, metavar="X",
                       help="target magnification (default 20; 20x = 0.5 um/px)")
    scale.add_argument("--mpp", type=float, default=None, metavar="UM", help="target micrometres per pixel")
    slides.add_argument("--patch-size", type=int, default=256, metavar="PX",
                        help="patch side at the target scale (default 256)")
    slides.add_argument("--slide-mpp", type=float, default=None, metavar="UM",
                        help="level-0 micrometres per pixel of slides whose files carry no resolution "
                        "(no openslide.mpp-x, no objective power); others keep their own")
    slides.add_argument("--tissue", default="otsu", choices=("otsu", "all"),
                        help="otsu: Otsu threshold of a thumbnail's saturation (default); all: every patch")
    slides.add_argument("--min-tissue", type=float, default=0.5, metavar="F",
                        help="keep a patch when this fraction of it is tissue (default 0.5)")
    slides.add_argument("--coords-from", default=None, metavar="D/E/S",
                        help="cut each slide at the coordinates of that bag split (another encoder's), row for "
                        "row, instead of the grid and tissue mask: the bags align; same --patch-size and scale")
    slides.add_argument("--coords-store", default=None, metavar="URL",
                        help="the store of --coords-from, when not --store (same storage options)")
    add_storage_options(p)
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (pin it to get byte-identical CPU runs; torchrun uses 1)")
    p.add_argument("--queue-size", type=int, default=4, help="batches in flight to the writer thread")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_worker_options(p)


def is_slides(args: argparse.Namespace) -> bool:
    return str(args.images).startswith("wsi:")


_SLIDE_ONLY = ("magnification", "mpp", "slide_mpp", "coords_from", "coords_store")


def slide_options_from_args(args: argparse.Namespace) -> Any:
    from featurestore.extract.wsi_run import SlideOptions

    why = {"--crop": "patches are cut at --patch-size", "--resize": "patches are cut at --patch-size",
           "--compressor": "bag chunks are not compressed"}
    for flag, value in (("--crop", args.crop), ("--resize", args.resize), ("--compressor", args.compressor)):
        if value:
            raise InvalidOption(f"{flag} does not apply to wsi: sources ({why[flag]}): drop it")
    return SlideOptions(
        images=args.images, encoder=args.encoder, store=args.store, dataset=args.dataset, split=args.split,
        encoder_name=args.encoder_name, dtype=args.dtype, batch_size=args.batch_size, device=args.device,
        resume=args.resume, overwrite=args.overwrite, chunk_mb=args.chunk_mb, precision=args.precision,
        tokens=args.tokens or "cls", prefix_tokens=args.prefix_tokens, labels=args.labels,
        num_workers=args.num_workers, limit=args.limit, magnification=args.magnification, mpp=args.mpp,
        slide_mpp=args.slide_mpp, patch_size=args.patch_size, tissue=args.tissue, min_tissue=args.min_tissue,
        mean=_triple(args.mean, "--mean"), std=_triple(args.std, "--std"),
        storage_options=store_options(args, args.store, args.coords_store), queue_size=args.queue_size,
        progress=not args.no_progress, threads=args.threads, verify_chunks=args.verify_chunks,
        coords_from=args.coords_from, coords_store=args.coords_store, worker=worker_options(args))


def options_from_args(args: argparse.Namespace) -> Any:
    from featurestore.extract.run import ExtractOptions

    for name in _SLIDE_ONLY:
        if getattr(args, name, None) is not None:
            raise InvalidOption(f"--{name.replace('_', '-')} applies to wsi: sources only (whole-slide images)")
    if args.tokens == "mean":
        raise InvalidOption("--tokens mean applies to wsi: sources only; use patch, cls or all")
    return ExtractOptions(
        images=args.images, encoder=args.encoder, store=args.store, dataset=args.dataset, split=args.split,
        encoder_name=args.encoder_name, dtype=args.dtype, batch_size=args.batch_size, device=args.device,
        resume=args.resume, overwrite=args.overwrite, chunk_mb=args.chunk_mb, precision=args.precision,
        tokens=args.tokens or "patch", prefix_tokens=args.prefix_tokens, labels=args.labels,
        num_workers=args.num_workers, limit=args.limit, crop=_size(args.crop, "--crop"),
        resize=_size(args.resize, "--resize"), mean=_triple(args.mean, "--mean"),
        std=_triple(args.std, "--std"), compressor=args.compressor,
        storage_options=store_options(args, args.store), queue_size=args.queue_size,
        progress=not args.no_progress, threads=args.threads, verify_chunks=args.verify_chunks)


def _closing_lines(result: Any, already: str, extracted: Callable[[float], str], store: str,
                   worker: bool) -> list[str]:
    """The quantization line and ``extracted(seconds)``, the run's own line (``seconds`` of the
    encode loop, never 0); or, for a split complete before this run, ``already`` alone."""
    if result.status == "already-complete":
        return [nothing_to_do(already, result.metadata, store=store, key=result.key, worker=worker)]
    q = result.metadata.get("quantization") or {}
    lines = [f"quantization: {quantization_line(q)}"] if q else []
    return [*lines, extracted(max(result.seconds, 1e-9))]


def format_report(result: Any, store: str) -> list[str]:
    """The closing lines: quantization report, then one summary line."""
    meta = result.metadata
    shape = "x".join(str(s) for s in [result.num_samples, *meta.get("sample_shape", [])])
    return _closing_lines(
        result, f"split {result.key} is already complete with the same cache key ({shape} {meta.get('logical_dtype')})",
        lambda secs: f"extracted {result.key}: {shape} {meta.get('logical_dtype')}, {result.encoded} samples encoded "
        f"in {result.seconds:.1f}s ({result.encoded / secs:.1f} img/s, "
        f"{result.bytes_written / secs / 1e6:.3g} MB/s written; {result.wall_seconds:.1f}s in all), "
        f"status {meta.get('status')}", store, worker=False)


def format_slide_report(result: Any, store: str, worker: bool) -> list[str]:
    """The closing lines of a slide extraction (skipped slides go to stderr, one line each)."""
    meta = result.metadata
    bags = meta.get("bags") or {}
    return _closing_lines(
        result, f"bag split {result.key} is already complete with the same cache key ({bags.get('count')} bags, "
        f"{meta.get('num_samples')} patches, {meta.get('logical_dtype')})",
        lambda secs: f"extracted {result.key}: {result.bags} bag{'' if result.bags == 1 else 's'} of {result.slides} "
        f"slides, {result.patches} patches "
        f"encoded in {result.seconds:.1f}s ({result.patches / secs:.1f} patches/s; {result.wall_seconds:.1f}s in all), "
        f"{len(result.skipped)} skipped" + (f", {len(meta['failed'])} failed" if meta.get("failed") else "")
        + f"; split: {bags.get('count')} bags, {meta.get('num_samples')} patches, "
        f"{meta.get('logical_dtype')}, status {meta.get('status')}", store, worker)


def run_slides(args: argparse.Namespace) -> int:
    import dataclasses
    import sys

    from featurestore.extract.wsi_run import EXIT_SKIPPED, extract_slides

    opts = slide_options_from_args(args)
    coord, result = _on_this_rank(opts.store, lambda coord: extract_slides(opts, coord))
    if coord.rank != 0:
        return 0
    if not result.metadata:  # --worker that did not commit
        print(f"worker: {result.bags} bag(s) added to {result.key}; not committed by this worker (another "
              "worker commits, or `featurestore commit`; `featurestore status` shows progress)", flush=True)
        return 0
    failed: list[dict[str, Any]] = []
    if result.status == "complete" and args.worker:  # this worker committed: every worker's slides
        result = dataclasses.replace(result, skipped=result.metadata.get("skipped") or result.skipped)
        failed = result.metadata.get("failed") or []
    for skipped in result.skipped:
        print(f"skipped slide {skipped['id']}: {skipped['reason']}", file=sys.stderr, flush=True)
    for slide in failed:
        last = (slide.get("errors") or ["?"])[-1]
        print(f"failed slide {slide['id']} after {slide.get('attempts')} attempt(s): {last}", file=sys.stderr, flush=True)
    for line in format_slide_report(result, args.store, bool(args.worker)):
        print(line, flush=True)
    return EXIT_SKIPPED if result.skipped or failed else 0


def _on_this_rank(store: str, job: Callable[[Any], Any]) -> tuple[Any, Any]:
    """``job(coordinator)`` on this torchrun rank (or the one process), a storage failure as one
    line; the coordinator is shut down however the job ends. Returns (coordinator, result)."""
    from featurestore.extract.dist import coordinated

    with coordinated(None) as coord, store_errors(store):
        return coord, job(coord)


def run(args: argparse.Namespace) -> int:
    from featurestore.extract.run import extract

    if is_slides(args):
        return run_slides(args)
    if args.worker:
        raise InvalidOption(f"--worker shares the slides of a wsi: source, but got --images {args.images!r}: "
                            "use torchrun for image folders")
    opts = options_from_args(args)
    coord, result = _on_this_rank(opts.store, lambda coord: extract(opts, coord))
    if coord.rank == 0:
        for line in format_report(result, args.store):
            print(line, flush=True)
    return 0
