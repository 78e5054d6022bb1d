"""``featurestore export``: a bag split as one file per slide in TRIDENT's, CLAM's or STAMP's layout,
an embedding split, or a saved attention map (docs/EXTRACT.md, "Export"); the writing is
featurestore.extract.bag_export, embedding_export and attention_export."""

from __future__ import annotations

import argparse
from typing import Any

from featurestore.commands.parsers import REWRITE_EXPORT, add_verb
from featurestore.commands.storeargs import add_split_source, add_storage_options, open_store_from_args, store_errors

# Mirrors featurestore.extract.bag_export.FORMATS, kept here so `featurestore --help` imports nothing.
FORMATS = ("trident", "clam-pt", "stamp")


HELP = ("write a bag split out as one file per slide (TRIDENT h5, CLAM pt_files/ + h5_files/, STAMP h5), or an "
        "embedding split as one h5 per slide or patient, or a saved attention map as CLAM heatmap blockmaps")
DESCRIPTION = """\
Write every bag of a bag split as one file per slide, in another tool's layout. trident: OUT/<slide>.h5 with
'features' [n, D] (stored dtype; bfloat16 as float32) and 'coords' [n, 2] (level-0 pixels), the attributes the
import kept (OUT plays TRIDENT's features_<encoder>/). clam-pt: OUT/pt_files/<slide>.pt (float32 features) and
OUT/h5_files/<slide>.h5 ('features' float32, 'coords' int32). stamp: OUT/<slide>.h5 with 'feats' [n, D] and
'coords' float32 micrometres, root attributes unit='um', tile_size_um, tile_size_px (level-0 pixel coords are
converted with each bag's recorded mpp, or --mpp). Labels go to OUT/labels.csv (slide_id,label; where the
bags keep an attribute named label, the labels' column is the one the import read them from, and the export
says so). `featurestore import OUT --labels OUT/labels.csv --dtype <the split's dtype>` (with that
--label-column) gives the same bags back, byte for byte (a stamp export of pixel coordinates comes back in micrometres). An embedding split (featurestore embed:
one [E] vector per slide or patient, with ids) exports as trident (OUT/<id>.h5, 'features' (E,)) or stamp
('feats' (E,), root attributes feat_type patient or slide, encoder), labels in OUT/labels.csv.
--attention NAME instead of --format writes the attention map NAME that probe --head abmil --save-attention
saved beside the bag split: OUT/<slide>_blockmap.h5 per evaluated slide, 'attention_scores' [n, 1] float32
and 'coords' [n, 2] (the layout of CLAM's heatmap blockmaps); a stale map is refused.
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "export", run, HELP, DESCRIPTION, interrupted=REWRITE_EXPORT)
    req = add_split_source(p, encoder_help="encoder name in the store", split_help="a bag split, or an embedding split")
    req.add_argument("--format", choices=FORMATS, dest="fmt", help="the features' layout (or --attention)")
    req.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if missing)")
    p.add_argument("--attention", metavar="NAME", default=None,
                   help="write the saved attention map NAME instead of the features (CLAM blockmap h5 per slide)")
    p.add_argument("--overwrite", action="store_true", help="replace files of an earlier export in DIR")
    p.add_argument("--mpp", type=float, default=None, metavar="UM",
                   help="stamp: level-0 micrometres per pixel of bags that record no mpp (0.25 at 40x, 0.5 at 20x)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage_options(p)


def run(args: argparse.Namespace) -> int:
    from featurestore.errors import InvalidOption
    from featurestore.extract.bag_export import check_out, export_bags
    from featurestore.extract.embedding_export import export_embeddings

    if (args.fmt is None) == (args.attention is None):
        raise InvalidOption("give --format FORMAT (the features) or --attention NAME (a saved attention map), "
                            "one of the two")
    check_out(args.out)  # before the store is read: a bad --out is no failure of the store
    store = open_store_from_args(args.store, args)
    with store_errors(args.store):
        if args.attention is not None:
            from featurestore.extract.attention_export import export_attention

            if args.mpp is not None:
                raise InvalidOption("--mpp converts coordinates for --format stamp; an attention export keeps them as "
                                    "stored: drop it")
            result = export_attention(store, args.dataset, args.encoder, args.split, args.attention, out=args.out,
                                      overwrite=args.overwrite, progress=not args.no_progress)
            print(f"exported attention map {args.attention!r} of {result.key}: {result.bags} slides, {result.files} "
                  f"files in {result.out} ({result.seconds:.1f}s)", flush=True)
            return 0
        embeddings = store.split_kind(args.dataset, args.encoder, args.split) == "dense"  # slide or patient vectors
        if embeddings:
            if args.mpp is not None:
                raise InvalidOption("--mpp converts bag coordinates; an embedding split has none: drop it")
            result = export_embeddings(store, args.dataset, args.encoder, args.split, fmt=args.fmt, out=args.out,
                                       overwrite=args.overwrite, progress=not args.no_progress)
        else:
            result = export_bags(store, args.dataset, args.encoder, args.split, fmt=args.fmt, out=args.out,
                                 overwrite=args.overwrite, progress=not args.no_progress, mpp=args.mpp)
    print(f"exported {result.key}: {result.bags} {'embeddings' if embeddings else 'bags'} as {result.format}, "
          f"{result.files} files in {result.out} ({result.seconds:.1f}s)", flush=True)
    if result.note:
        print(result.note, flush=True)
    return 0
