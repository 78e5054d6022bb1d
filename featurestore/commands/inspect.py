"""``featurestore ls`` and ``info`` (and, from its own module, ``verify``): read-only views of a store
(no torch needed)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from featurestore.commands.report_line import quantization_line
from featurestore.commands.storeargs import add_storage_options, open_store_from_args, store_errors


def register(subparsers: Any) -> None:
    ls = subparsers.add_parser("ls", help="list datasets / encoders / splits with shapes and status")
    ls.add_argument("url", help="store path or fsspec URL (s3://bucket/prefix, memory://...)")
    add_storage_options(ls)
    ls.set_defaults(func=run_ls)

    info = subparsers.add_parser("info", help="show one split's metadata")
    info.add_argument("url")
    info.add_argument("dataset")
    info.add_argument("encoder")
    info.add_argument("split")
    info.add_argument("--json", action="store_true", help="print the full metadata as JSON")
    add_storage_options(info)
    info.set_defaults(func=run_info)

    # verify has its own module (its exit statuses, its leftovers); registered here, after info
    from featurestore.commands import verify

    verify.register(subparsers)


def _store(args: argparse.Namespace) -> Any:
    return open_store_from_args(args.url, args)


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return ""


def run_ls(args: argparse.Namespace) -> int:
    with store_errors(args.url):
        return _run_ls(args)


def _run_ls(args: argparse.Namespace) -> int:
    from featurestore.core.verify import iter_splits
    from featurestore.format import dtypes

    store = _store(args)
    rows = []
    for ds, enc, sp in iter_splits(store):
        meta = store.split_info(ds, enc, sp)
        shape = [meta.num_samples, *meta.sample_shape]
        itemsize = dtypes.storage_dtype(meta.logical_dtype).itemsize
        nbytes = itemsize * math.prod(shape)
        text = "x".join(map(str, shape))
        if meta.is_bags:  # bag count, patch rows x dim (before the first commit: not counted yet)
            text = f"{(meta.bags or {}).get('count', 0)} bags, {text}" if meta.complete else f"bags, dim {shape[1]}"
        rows.append((f"{ds}/{enc}/{sp}", meta.status, text, meta.logical_dtype, _size(nbytes)))
    if not rows:
        print(f"{store.url}: empty store")
        return 0
    header = ("SPLIT", "STATUS", "SHAPE", "DTYPE", "SIZE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _bag_lines(meta: Any) -> list[tuple[str, Any]]:
    """info's lines for a bag split, in place of the dense shape."""
    spec = meta.bags or {}
    coords = spec.get("coords") or {}
    counted = meta.complete
    return [
        ("kind", "bags (ragged per-slide bags; store.open_bags)"),
        ("bags", spec.get("count") if counted else "not counted until commit"),
        ("patches", meta.num_samples if counted else "not counted until commit"),
        ("dim", meta.sample_shape[0]),
        ("coords", f"{coords.get('unit')} ({coords.get('dtype')}), patch size at level 0 "
                   f"{spec.get('patch_size_level0')}"),
        ("bag labels", spec.get("labels")),
    ]


def run_info(args: argparse.Namespace) -> int:
    with store_errors(args.url):
        return _run_info(args)


def _run_info(args: argparse.Namespace) -> int:
    store = _store(args)
    meta = store.split_info(args.dataset, args.encoder, args.split)
    if args.json:
        json.dump(meta.to_json(), sys.stdout, indent=2)
        print()
        return 0
    # quantization, encoder and creator are free-form JSON objects inside the typed metadata
    q = meta.quantization or {}
    encoder = meta.encoder or {}
    lines = [
        ("split", f"{args.dataset}/{args.encoder}/{args.split}"),
        ("status", meta.status),
        ("shape", f"[{meta.num_samples}, {', '.join(map(str, meta.sample_shape))}]"),
        ("dtype", f"{meta.logical_dtype} (source {meta.source_dtype})"),
        ("chunks", f"{meta.chunk_rows} {'rows' if meta.is_bags else 'samples'} per chunk, compressor {meta.compressor}"),
        ("labels", meta.labels.to_json() if meta.labels else None),
        ("encoder", f"{encoder.get('name')} spec={encoder.get('spec')} weights={encoder.get('weights_hash')}"),
        ("token layout", meta.token_layout),
        ("preprocessing", meta.preprocessing),
        ("cache key", meta.cache_key),
        ("generation", meta.generation),
        ("created", f"{meta.created} by featurestore {(meta.creator or {}).get('version')}"),
    ]
    if q:
        lines.append(("quantization", quantization_line(q)))
    if meta.is_bags:
        lines = [line for line in lines if line[0] != "labels"]
        lines[2:3] = _bag_lines(meta)
    for name, value in lines:
        print(f"{name:>14}: {value}")
    return 0
