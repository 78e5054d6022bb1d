"""``featurestore import DIR`` for per-slide files: one bag per slide, streaming and resumable.

Called by :func:`featurestore.extract.importer.import_cache` when the source directory holds
per-slide feature files (featurestore.extract.slide_files). Every file's header is checked
first (features dataset, one dim, coords of the features' length, a label for each slide when
``--labels`` is given), so a malformed file stops the import before anything is written. Then
slides go to the bag writer one at a time (host RAM: two bags, the next is read meanwhile), in
name order, skipping the ids already complete (``--resume``, or a re-run; a file of a kept bag
modified since the split was created stops it with InputChanged, as for dense imports). A file that fails while being read (a truncated
h5) stops the import with one line naming it; the bags already added are kept (the writer is
closed, not committed), and a rerun with ``--resume`` goes on from them.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import sys
import time
from typing import Any

from featurestore.errors import InvalidLabels
from featurestore.extract.input_check import refuse_changed_inputs
from featurestore.extract.slide_files import SlideFileError, SlideFiles

__all__ = ["import_bags", "read_label_csv"]


def import_bags(opts: Any, files: SlideFiles) -> Any:
    """Write ``files`` as a bag split (``opts``: importer.ImportOptions); an ImportResult."""
    from featurestore import open_store
    from featurestore.extract.importer import ImportResult, resume_existing
    from featurestore.extract.plan import resolve_dtype

    started = time.perf_counter()
    headers = [files.header(slide) for slide in files.slides]
    first = headers[0]
    for slide, header in zip(files.slides, headers):
        if header.dim != first.dim:
            raise SlideFileError(f"{slide.path!r} has features of dim {header.dim}, but {files.slides[0].path!r} has "
                                 f"{first.dim}: one bag split holds one encoder's features (split the directory)")
        if header.coords != first.coords or header.unit != first.unit:
            raise SlideFileError(f"{slide.path!r} has {'coords in ' + header.unit if header.coords else 'no coords'}, "
                                 f"but {files.slides[0].path!r} has {'coords in ' + first.unit if first.coords else 'no coords'}: "
                                 "one bag split has one coordinate convention")
    labels, label_names, label_digest = (None, None, None)
    if opts.labels:
        labels, label_names, label_digest = read_label_csv(opts.labels, [s.bag_id for s in files.slides])
    settings = files.settings(first, files.slides[0])
    dtype = resolve_dtype(opts.dtype, first.dtype)
    fingerprint = {"source": files.fingerprint(), "labels": label_digest}
    cache_key = hashlib.sha256(json.dumps({"import-bags": fingerprint, "dtype": dtype, **settings},
                                          sort_keys=True).encode()).hexdigest()
    metadata: dict[str, Any] = {
        "encoder": {"name": opts.encoder_name, "spec": f"import:{files.spec}", "weights_hash": None,
                    "output_dtype": first.dtype, "precision": None},
        "source_dtype": first.dtype,
        "cache_key": cache_key,
        "source": {"spec": files.spec, "format": f"slide-{files.kind}", "fingerprint": fingerprint,
                   "num_bags": len(files), "labels": opts.labels},
    }
    if label_names is not None:
        metadata["label_names"] = label_names
    store = open_store(opts.store, mode="a", **opts.storage_options)
    key = f"{opts.dataset}/{opts.encoder_name}/{opts.split}"
    resume = resume_existing(store, opts, key)
    writer = store.create_bag_split(
        opts.dataset, opts.encoder_name, opts.split, dim=first.dim, dtype=dtype, metadata=metadata,
        resume=resume, overwrite=opts.overwrite, label_dtype="int64" if label_names is not None else None,
        chunk_bytes=int(opts.chunk_mb * (1 << 20)), verify_chunks=opts.verify_chunks, **settings)
    if resume:  # bags kept from an earlier run must still match their files (extract.input_check)
        kept = [i for i, slide in enumerate(files.slides) if slide.bag_id in writer.done_ids]
        refuse_changed_inputs(lambda a, b: [s.path for s in files.slides[a:b]], [(i, i + 1) for i in kept],
                              writer.metadata.created, key)
    if writer.metadata.complete:
        return ImportResult("already-complete", key, len(files), metadata=writer.metadata.to_json())
    imported = _copy(files, writer, labels, opts)
    meta = writer.commit()
    return ImportResult("complete", key, len(files), imported, time.perf_counter() - started, meta)


def _copy(files: SlideFiles, writer: Any, labels: dict[str, Any] | None, opts: Any) -> int:
    """Add the pending slides in name order; the next slide is read on a thread while this one
    is added (two slides in RAM at most)."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    done = writer.done_ids
    pending = [s for s in files.slides if s.bag_id not in done]
    bar = tqdm(total=len(pending), unit="slide", desc="import", disable=True if not opts.progress else None,
               file=sys.stderr, dynamic_ncols=True)
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="featurestore-slide") as reader:
            ahead = reader.submit(files.read, pending[0]) if pending else None
            for k, slide in enumerate(pending):
                assert ahead is not None
                features, coords, attrs = ahead.result()
                ahead = reader.submit(files.read, pending[k + 1]) if k + 1 < len(pending) else None
                if coords is not None and len(coords) != len(features):
                    raise SlideFileError(f"{slide.path!r}: coords of {len(coords)} rows for {len(features)} feature rows")
                writer.add_bag(slide.bag_id, features, coords=coords,
                               label=None if labels is None else labels[slide.bag_id], attrs=attrs)
                del features, coords
                bar.update(1)
    except BaseException:
        writer.close()  # the complete bags stay: a rerun with --resume goes on from them
        raise
    finally:
        bar.close()
    return len(pending)


def read_label_csv(path: str, bag_ids: list[str]) -> tuple[dict[str, Any], list[str] | None, str]:
    """``(labels by bag id, class names or None, digest)`` from a CSV with ``slide_id`` and
    ``label`` columns. Numbers are kept; text labels become class indices in sorted name order
    (the names go to the split metadata as ``label_names``). A slide id may carry its file
    extension (``TCGA-xx.svs``). Every bag needs a label."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            raw = f.read()
    except OSError as error:
        raise InvalidLabels(f"cannot read the labels CSV {path!r} ({error.strerror or error})") from None
    reader = csv.DictReader(raw.splitlines())
    if reader.fieldnames:  # "slide_id, label" (a space after the comma) names the same columns
        reader.fieldnames = [str(name).strip() for name in reader.fieldnames]
    rows = list(reader)
    columns = set(rows[0]) if rows else set()
    if not {"slide_id", "label"} <= columns:
        raise InvalidLabels(f"labels CSV {path!r} needs the columns slide_id,label (it has: "
                            f"{', '.join(sorted(c for c in columns if c)) or 'none'})")
    exact: dict[str, str] = {}  # slide_id as written
    stems: dict[str, dict[str, str]] = {}  # slide_id without its extension -> {label: the row's slide_id}
    for row in rows:
        slide, value = (row["slide_id"] or "").strip(), (row["label"] or "").strip()
        if exact.get(slide, value) != value:  # a slide listed twice with two labels: which is right?
            raise InvalidLabels(f"labels CSV {path!r} gives slide {slide!r} two labels ({exact[slide]!r} and "
                                f"{value!r}): keep one row per slide")
        exact[slide] = value
        stem = os.path.splitext(slide)[0]
        if stem != slide:
            stems.setdefault(stem, {}).setdefault(value, slide)
    given: dict[str, str] = {}
    for bag in bag_ids:  # the row naming the slide exactly, else the one row naming it with an extension
        if bag in exact:
            given[bag] = exact[bag]
        elif len(stems.get(bag, {})) > 1:
            rows_of = sorted(stems[bag].values())
            raise InvalidLabels(f"labels CSV {path!r}: slide {bag!r} matches rows {rows_of[0]!r} and {rows_of[1]!r} "
                                "with different labels: name the slide exactly (its file name without extension)")
        elif bag in stems:
            given[bag] = next(iter(stems[bag]))
    missing = [b for b in bag_ids if not given.get(b)]
    if missing:
        raise InvalidLabels(f"labels CSV {path!r} has no (or an empty) label for slide {missing[0]!r}"
                            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                            + ": add a slide_id,label row for each slide, or move the slide out of the directory")
    values = [given[b] for b in bag_ids]
    names = None
    parsed: list[Any]
    try:
        parsed = [int(v) for v in values]
    except ValueError:
        try:
            parsed = [float(v) for v in values]
        except ValueError:
            names = sorted(set(values))
            parsed = [names.index(v) for v in values]
    digest = hashlib.sha256(raw.encode()).hexdigest()
    return dict(zip(bag_ids, parsed)), names, digest
