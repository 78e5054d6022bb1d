"""``featurestore export``: a bag split as one file per slide in TRIDENT's, CLAM's or STAMP's layout
(docs/EXTRACT.md, "Export"); the writing is featurestore.extract.bag_export."""

from __future__ import annotations

import argparse
from typing import Any

from featurestore.commands.parsers import add_debug_option, add_verb
from featurestore.commands.storeargs import (add_split_source, add_storage_options, kind_hint, open_store_from_args,
                                             store_errors)

# Mirrors featurestore.extract.bag_export.FORMATS, kept here so `featurestore --help` imports nothing.
FORMATS = ("trident", "clam-pt", "stamp")


HELP = "write a bag split out as one file per slide (TRIDENT h5, CLAM pt_files/ + h5_files/, STAMP h5)"
DESCRIPTION = """\
Write every bag of a bag split as one file per slide, in another tool's layout. trident: OUT/<slide>.h5 with
'features' [n, D] (stored dtype; bfloat16 as float32) and 'coords' [n, 2] (level-0 pixels), the attributes the
import kept (OUT plays TRIDENT's features_<encoder>/). clam-pt: OUT/pt_files/<slide>.pt (float32 features) and
OUT/h5_files/<slide>.h5 ('features' float32, 'coords' int32). stamp: OUT/<slide>.h5 with 'feats' [n, D] and
'coords' float32 micrometres, root attributes unit='um', tile_size_um, tile_size_px (level-0 pixel coords are
converted with each bag's recorded mpp, or --mpp). Labels go to OUT/labels.csv (slide_id,label).
`featurestore import OUT --labels OUT/labels.csv --dtype <the split's dtype>` gives the same bags back, byte
for byte (a stamp export of pixel coordinates comes back in micrometres).
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "export", run, HELP, DESCRIPTION)
    req = add_split_source(p, encoder_help="encoder name in the store", split_help="a bag split")
    req.add_argument("--format", required=True, choices=FORMATS, dest="fmt")
    req.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if missing)")
    p.add_argument("--overwrite", action="store_true", help="replace files of an earlier export in DIR")
    p.add_argument("--mpp", type=float, default=None, metavar="UM",
                   help="stamp: level-0 micrometres per pixel of bags that record no mpp (0.25 at 40x, 0.5 at 20x)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage_options(p)
    add_debug_option(p)


def run(args: argparse.Namespace) -> int:
    from featurestore.extract.bag_export import export_bags

    store = open_store_from_args(args.store, args)
    with store_errors(args.store), kind_hint("featurestore export writes a bag split out, one file per slide; read "
                                             "a dense split with FeatureDataset or store.open(...)"):
        result = export_bags(store, args.dataset, args.encoder, args.split, fmt=args.fmt, out=args.out,
                             overwrite=args.overwrite, progress=not args.no_progress, mpp=args.mpp)
    print(f"exported {result.key}: {result.bags} bags as {result.format}, {result.files} files in {result.out} "
          f"({result.seconds:.1f}s)", flush=True)
    return 0
