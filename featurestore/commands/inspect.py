"""``featurestore ls`` and ``info`` (and, from its own module, ``verify``): read-only views of a store
(no torch needed)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from featurestore.commands.report_line import quantization_line
from featurestore.commands.parsers import add_verb
from featurestore.commands.storeargs import add_split_names, add_storage_options, open_store_from_args, store_errors

NOT_RECORDED = "not recorded"  # a field the split's writer did not record (never "None")


def register(subparsers: Any) -> None:
    ls = add_verb(subparsers, "ls", run_ls, "list datasets / encoders / splits with shapes, status, bytes of data "
                  "and bytes on storage")
    ls.add_argument("url", help="store path or fsspec URL (s3://bucket/prefix, memory://...)")
    add_storage_options(ls)

    info = add_verb(subparsers, "info", run_info, "show one split's metadata")
    info.add_argument("url")
    add_split_names(info)
    info.add_argument("--json", action="store_true", help="print the full metadata as JSON")
    add_storage_options(info)


def _store(args: argparse.Namespace) -> Any:
    return open_store_from_args(args.url, args)


def _size(nbytes: float) -> str:
    from featurestore.format.sizes import bytes_text  # one formatting for ls, info, verify and the page

    return bytes_text(nbytes)


def run_ls(args: argparse.Namespace) -> int:
    with store_errors(args.url):
        return _run_ls(args)


def _run_ls(args: argparse.Namespace) -> int:
    from featurestore.core.verify import iter_splits
    from featurestore.format.sizes import split_size

    from featurestore.errors import FeatureStoreError

    store = _store(args)
    rows, unreadable = [], []
    for ds, enc, sp in iter_splits(store):
        try:
            meta = store.split_info(ds, enc, sp)
        except FeatureStoreError as error:  # one damaged document must not hide the other splits
            rows.append((f"{ds}/{enc}/{sp}", "UNREADABLE", "-", "-", "-", "-"))
            unreadable.append(f"{ds}/{enc}/{sp}: {error}")
            continue
        shape = [meta.num_samples, *meta.sample_shape]
        text = "x".join(map(str, shape))
        if meta.is_bags:  # bag count, patch rows x dim (before the first commit: not counted yet)
            text = f"{(meta.bags or {}).get('count', 0)} bags, {text}" if meta.complete else f"bags, dim {shape[1]}"
        size = split_size(meta)  # the same two figures as info and the web page
        status = meta.status + (" STALE" if lineage_line(store, meta)[1] else "")
        rows.append((f"{ds}/{enc}/{sp}", status, text, meta.logical_dtype, size.data_text(),
                     size.stored_text(notes=False)))  # fmt: skip
    if not rows:
        print(f"{store.url}: empty store")
        return 0
    header = ("SPLIT", "STATUS", "SHAPE", "DTYPE", "DATA", "ON STORAGE")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for line in unreadable:
        print(f"featurestore: error: {line}", file=sys.stderr)
    return 1 if unreadable else 0


def lineage_line(store: Any, meta: Any) -> tuple[str | None, str | None]:
    """``(info's lineage line, the stale reason)`` of a derived split; ``(None, None)`` for others."""
    from featurestore.core.lineage import stale_reason
    from featurestore.format import lineage

    doc = meta.extra.get(lineage.KEY) if meta.extra else None
    if doc is None:
        return None, None
    reason = stale_reason(store, meta.to_json())
    try:
        text = lineage.describe(lineage.of(meta.to_json()) or {})
    except Exception:  # a damaged lineage: the reason says so
        text = "damaged"
    return f"{text}; " + (f"STALE: {reason}" if reason else "current"), reason


def _bag_lines(store: Any, args: argparse.Namespace, meta: Any) -> list[tuple[str, Any]]:
    """info's lines for a bag split, in place of the dense shape."""
    spec = meta.bags or {}
    coords = spec.get("coords") or {}
    counted = meta.complete
    patch = spec.get("patch_size_level0")
    if patch is None and counted and coords.get("unit") == "px":
        patch = _per_slide_patch_sizes(store, args)
    labels: Any = NOT_RECORDED
    if spec.get("labels") and not counted:
        labels = f"{spec['labels'].get('dtype')}, not counted until commit"
    elif spec.get("labels"):
        from featurestore.errors import FeatureStoreError

        try:  # info is what one runs on a damaged split too: its labels may be what is damaged
            labels = label_counts(store.open_bags(args.dataset, args.encoder, args.split).labels, class_names(meta))
        except FeatureStoreError as error:
            labels = f"{spec['labels'].get('dtype')}, unreadable: {error}"  # the error says what to run
    return [
        ("kind", "bags (ragged per-slide bags; store.open_bags)"),
        ("bags", spec.get("count") if counted else "not counted until commit"),
        ("patches", meta.num_samples if counted else "not counted until commit"),
        ("dim", meta.sample_shape[0]),
        ("coords", f"{coords.get('unit') or 'no unit'} ({coords.get('dtype')})"
                   + ("" if patch is None else f", patch size at level 0 {patch}")),
        ("bag labels", labels),
    ]


def _per_slide_patch_sizes(store: Any, args: argparse.Namespace) -> str | None:
    """``256 per slide`` or ``per slide: 256 (4), 512 (2)``: the patch sizes slide extraction
    records on each bag (the split records none), or None when no bag records one."""
    from collections import Counter

    from featurestore.errors import FeatureStoreError

    try:
        bags = store.open_bags(args.dataset, args.encoder, args.split)
        sizes = Counter(bags.patch_sizes())
    except FeatureStoreError:  # a damaged split: the lines below and verify say what
        return None
    if None in sizes or not sizes:
        return None
    if len(sizes) == 1:
        return f"{next(iter(sizes))} per slide"
    return "per slide: " + ", ".join(f"{size} ({count})" for size, count in sorted(sizes.items()))


def class_names(meta: Any) -> list[str] | None:
    """The class names a split recorded: ``label_names`` (``featurestore import --labels`` with text
    labels, slide extraction) or ``label_info.classes`` (image-folder sources, the demo)."""
    extra = meta.extra or {}
    names = extra.get("label_names") or (extra.get("label_info") or {}).get("classes")
    return [str(name) for name in names] if isinstance(names, list) else None


def label_counts(labels: Any, names: list[str] | None, most: int = 20, unit: str = "bags") -> str:
    """``int64, 2 classes: 0 negative: 12 bags, 1 positive: 8 bags``: each class with its name
    (when recorded) and how many bags (``unit``) carry it; float labels (a regression target): their range."""
    import numpy as np

    values = np.asarray(labels)
    if values.dtype.kind == "f":
        finite = values[np.isfinite(values)]
        span = f"{finite.min():.6g} .. {finite.max():.6g}" if len(finite) else "no finite value"
        return f"{values.dtype}: {span} over {len(values)} {unit}"
    classes, counts = np.unique(values, return_counts=True)
    shown = [f"{c}{' ' + names[c] if names is not None and 0 <= c < len(names) else ''}: {n} {unit}"
             for c, n in zip(classes.tolist()[:most], counts.tolist()[:most], strict=True)]
    more = f", ... {len(classes) - most} more classes" if len(classes) > most else ""
    return f"{values.dtype}, {len(classes)} classes: {', '.join(shown)}{more}"


def _dense_labels(store: Any, args: argparse.Namespace, meta: Any) -> Any:
    """info's labels line of a dense split, as a bag split's: the classes and their counts (labels
    of one value per sample, once complete), else the labels' dtype and shape."""
    if meta.is_bags or not meta.labels:
        return None
    spec = meta.labels.to_json()
    shape = list(spec.get("shape") or [])
    text = f"{spec.get('dtype')}" + (f" {shape} per sample" if shape else "")
    if shape or not meta.complete:
        return text + ("" if meta.complete else ", not counted until complete")
    from featurestore.errors import FeatureStoreError

    try:  # damaged labels: info still shows the rest
        import numpy as np

        labels = store.open(args.dataset, args.encoder, args.split).labels
        return label_counts(labels.read_numpy(np.arange(len(labels))), class_names(meta), unit="samples")
    except FeatureStoreError as error:
        return f"{text}, unreadable: {error}"


def run_info(args: argparse.Namespace) -> int:
    with store_errors(args.url):
        return _run_info(args)


def _run_info(args: argparse.Namespace) -> int:
    from featurestore.format.sizes import split_size

    store = _store(args)
    meta = store.split_info(args.dataset, args.encoder, args.split)
    if args.json:
        json.dump(meta.to_json(), sys.stdout, indent=2)
        print()
        return 0
    # quantization, encoder and creator are free-form JSON objects inside the typed metadata
    q = meta.quantization or {}
    encoder = meta.encoder or {}
    size = split_size(meta)
    lines = [
        ("split", f"{args.dataset}/{args.encoder}/{args.split}"),
        ("status", meta.status),
        ("shape", f"[{meta.num_samples}, {', '.join(map(str, meta.sample_shape))}]"),
        ("dtype", f"{meta.logical_dtype} (source {meta.source_dtype})"),
        ("chunks", f"{meta.chunk_rows} {'patches' if meta.is_bags else 'samples'} per chunk, stored whole (the last "
                   f"one padded), compressor {meta.compressor or 'none'}"),
        ("data", size.data_text()),
        ("on storage", size.stored_text()),
        ("labels", _dense_labels(store, args, meta)),
        ("encoder", f"{encoder.get('name')} spec={encoder.get('spec') or NOT_RECORDED} "
                    f"weights={encoder.get('weights_hash') or NOT_RECORDED}"),
        ("token layout", NOT_RECORDED if meta.token_layout is None else meta.token_layout),
        ("preprocessing", NOT_RECORDED if meta.preprocessing is None else meta.preprocessing),
        ("cache key", meta.cache_key or NOT_RECORDED),
        ("generation", meta.generation),
        ("created", f"{meta.created} by featurestore {(meta.creator or {}).get('version')}"),
    ]
    if q:
        lines.append(("quantization", quantization_line(q)))
    derived, reason = lineage_line(store, meta)
    if derived is not None:
        from featurestore.core.lineage import stale_fix

        key = f"{args.dataset}/{args.encoder}/{args.split}"
        lines.append(("derived from", derived + (f": {stale_fix(reason, key, args.url)}" if reason else "")))
    if meta.is_bags:
        lines = [line for line in lines if line[0] != "labels"]
        lines[2:3] = _bag_lines(store, args, meta)
        for what in ("skipped", "failed"):  # slides a run left out (wsi extraction, --worker)
            if left := meta.extra.get(what):
                lines.append((f"{what} slides", f"{len(left)}: " + ", ".join(str(s.get("id")) for s in left[:10])
                               + (f", ... {len(left) - 10} more" if len(left) > 10 else "")))
    for name, value in lines:
        print(f"{name:>14}: {value}")
    return 0
