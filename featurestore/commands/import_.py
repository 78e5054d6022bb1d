"""``featurestore import``: an existing feature cache as a split (docs/EXTRACT.md, "Importing a cache").

torch and the importer are imported inside ``run`` so ``featurestore --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any

from featurestore.commands.parsers import RESUME_SPLIT, add_verb
from featurestore.commands.report_line import nothing_to_do, quantization_line
from featurestore.commands.storeargs import add_rewrite_options, add_storage_options, options_from_args, store_errors
from featurestore.commands.workerargs import add_worker_options, worker_options


DESCRIPTION = """\
Write an existing feature cache into a split of a store, streaming (one batch in RAM) and resumable: a
directory of one .pt/.npy file per sample, an HDF5 file (one [N, ...] dataset or one dataset per sample), or a
[N, ...] torch tensor / .npy file. Same precision policy (--dtype) and quantization report as extract. Slide
bags: a directory of per-slide .h5 files (TRIDENT/CLAM 'features' + 'coords' in level-0 pixels, STAMP 'feats'
+ 'coords' in micrometres), a CLAM job directory (h5_files/, else pt_files/) or CLAM's pt_files/ (features
only) becomes a bag split: one bag per file, id = file name without extension, the file's attributes kept per
bag, one slide in RAM at a time; --labels CSV gives bag labels (columns slide_id,label, or
--id-column/--label-column; text labels become class indices, names in the metadata's label_names; the CSV's
other columns, e.g. case_id, are kept as bag attributes; a slide without a row is refused); --resume (or a
re-run) skips the bags already complete. Hidden files (names starting with '.') are left out, said in one
line. A malformed file (no features dataset, a group in its place, coords of another length, another dim, an
attribute JSON cannot hold, a truncated h5) stops the import with one line naming it; bags already imported
are kept.
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "import", run, "bring an existing feature cache in as a split", DESCRIPTION,
                 interrupted=RESUME_SPLIT)
    p.add_argument("source", metavar="SOURCE", help="DIR | FILE.h5 | FILE.pt | FILE.npy")
    req = p.add_argument_group("required")
    req.add_argument("--store", required=True, metavar="URL", help="store path or fsspec URL")
    req.add_argument("--dataset", required=True)
    req.add_argument("--encoder-name", required=True, help="encoder name in the store")
    req.add_argument("--split", required=True)
    p.add_argument("--dtype", default="auto", choices=("auto", "float16", "bfloat16", "float32", "int8"),
                   help="storage dtype; auto: float16/bfloat16 kept, float32 -> float16 under the overflow guard; "
                        "int8: half float16's bytes, ~0.5%% relative RMS error (docs/FORMAT.md)")
    p.add_argument("--labels", metavar="FILE_OR_KEY",
                   help="labels [N, ...]: a .npy/.pt file, or a key of the source's torch dict (beside --key) or a "
                   "dataset name in the HDF5 source; "
                   "for slide bags a UTF-8 CSV with columns slide_id,label (see --label-column)")
    p.add_argument("--label-column", metavar="COL",
                   help="slide bags: the --labels CSV column stored as each bag's label (default: label); the "
                   "columns other than it and the id column become bag attributes (text, or numbers where every "
                   "cell is a JSON number; empty cells null)")
    p.add_argument("--id-column", metavar="COL",
                   help="slide bags: the --labels CSV column naming the slides (default: slide_id; a name may "
                   "carry its extension, TCGA-xx.svs)")
    p.add_argument("--bags", action="store_true",
                   help="read a directory of .pt files as one bag per file (automatic for .h5 files, "
                   "h5_files/ and pt_files/)")
    p.add_argument("--key", help="the features inside the source: HDF5 dataset/group name, or dict key of a .pt")
    p.add_argument("--prefix-tokens", type=int, default=0,
                   help="CLS/register tokens before the patch grid in each sample (default 0)")
    p.add_argument("--grid", type=int, nargs=2, metavar=("H", "W"),
                   help="patch grid of the samples (default: square, when the patch tokens make one)")
    add_rewrite_options(p)
    p.add_argument("--batch-size", type=int, default=256, help="rows read and written at a time (default 256)")
    p.add_argument("--chunk-mb", type=float, default=8.0, help="chunk size target in MiB (default 8)")
    add_storage_options(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_worker_options(p)


def run(args: argparse.Namespace) -> int:
    from featurestore.extract.importer import ImportOptions, import_cache

    options = ImportOptions(
        source=args.source, store=args.store, dataset=args.dataset, encoder_name=args.encoder_name,
        split=args.split, dtype=args.dtype, labels=args.labels, key=args.key, prefix_tokens=args.prefix_tokens,
        grid=tuple(args.grid) if args.grid else None, batch_size=args.batch_size, chunk_mb=args.chunk_mb,
        resume=args.resume, overwrite=args.overwrite, storage_options=options_from_args(args, args.store),
        progress=not args.no_progress, verify_chunks=args.verify_chunks, bags=args.bags,
        label_column=args.label_column, id_column=args.id_column, worker=worker_options(args))
    with store_errors(args.store):
        result = import_cache(options)
    for note in result.notes:
        print(f"note: {note}")
    meta = result.metadata
    if not meta:  # --worker that did not commit
        print(f"worker: {result.imported} bag(s) added to {result.key}; not committed by this worker (another "
              "worker commits, or `featurestore commit`; `featurestore status` shows progress)", flush=True)
        return 0
    if meta.get("kind") == "bags":
        what = (f"{meta['bags']['count']} bags, {meta['num_samples']} patches x {meta['sample_shape'][0]} "
                f"{meta.get('logical_dtype')}")
        return _report(result, "bag split", what, "bags", args)
    shape = "x".join(str(s) for s in [result.num_samples, *meta.get("sample_shape", [])])
    return _report(result, "split", f"{shape} {meta.get('logical_dtype')}", "samples", args)


def _report(result: Any, kind: str, what: str, units: str, args: argparse.Namespace) -> int:
    """The import's lines, dense or bags alike: nothing to do, or the quantization and what was written."""
    meta = result.metadata
    if result.status == "already-complete":
        print(nothing_to_do(f"{kind} {result.key} is already complete with the same cache key ({what})", meta,
                            store=args.store, key=result.key, worker=bool(getattr(args, "worker", False))))
        return 0
    q = meta.get("quantization") or {}
    if q:
        print(f"quantization: {quantization_line(q)}")
    print(f"imported {result.key}: {what}, {result.imported} {units} written in {result.seconds:.1f}s, "
          f"status {meta.get('status')}", flush=True)
    return 0
