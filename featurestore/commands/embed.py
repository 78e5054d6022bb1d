"""``featurestore embed``: slide or patient embeddings of a bag split, as a dense split with lineage
(docs/EXTRACT.md, "Slide and patient embeddings: featurestore embed").

The run is imported inside ``run`` (torch only for ``python:`` slide encoders).
"""

from __future__ import annotations

import argparse
from typing import Any

from featurestore.commands.parsers import RESUME_EMBEDDING, add_verb
from featurestore.commands.storeargs import (add_split_source, add_storage_options, kind_hint, options_from_args,
                                             store_errors)
from featurestore.errors import InvalidOption


HELP = "slide or patient embeddings of a bag split (mean, max or a torch slide encoder), with lineage"
DESCRIPTION = """\
Compute one embedding per bag (slide) of a bag split, or per group of bags (--group-by case_id: one per
patient), and write them as a dense split DATASET/ENCODER_NAME/OUT_SPLIT of shape [rows, E] with ids (bag ids
or group values, sorted) and the bags' labels. --slide-encoder mean or max pools the patches in
float64/float32 (mean: the float32 rounding of the exact mean); python:MODULE:FACTORY calls FACTORY() for a
torch module, called as forward(features [1, N, D] float32, coords [1, N, 2] int64, patch_size_level0=int) ->
[1, E] or [E], under --autocast; its featurestore_requires attribute (input_dim, patch_size_level0,
magnification, coords_unit) is checked against the bag split. A group's slides are concatenated with each
later slide's x shifted by the running max x + patch size of the ones before. The split records its lineage
(source split and generation, slide encoder, weights hash, autocast, --max-patches and --seed, grouping); once
the source is rewritten it is reported stale (ls, info, verify, the server) and a re-run or --resume
recomputes it whole. --no-labels leaves the bags' labels out (a patient whose slides disagree; the task
then comes from a table at probe time: probe --labels CSV --id-column case_id). Resumable (--resume keeps
the chunks written) and torchrun-aware (rows partitioned by rank).
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "embed", run, HELP, DESCRIPTION, interrupted=RESUME_EMBEDDING)
    req = add_split_source(p, encoder_help="the bag split's encoder name", split_help="the bag split")
    req.add_argument("--slide-encoder", required=True, metavar="SPEC", help="mean | max | python:MODULE:FACTORY")
    req.add_argument("--encoder-name", required=True, help="encoder name of the embedding split")
    p.add_argument("--out-split", default=None, help="the embedding split's name (default: --split)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                   help="stored dtype of the embeddings (default float32)")
    p.add_argument("--max-patches", type=int, default=None, metavar="K",
                   help="use a seeded uniform subset of K patches of each row (sorted); default all")
    p.add_argument("--seed", type=int, default=0, help="seed of --max-patches subsets (default 0)")
    p.add_argument("--group-by", default=None, metavar="COLUMN",
                   help="one row per value of this bag attribute (e.g. case_id), pooling all its bags' patches")
    p.add_argument("--groups", default=None, metavar="CSV",
                   help="--group-by from this table (UTF-8 CSV with --id-column and COLUMN) instead of the bags' "
                   "attributes: slides extracted from whole-slide images carry no case_id")
    p.add_argument("--id-column", default="slide_id", metavar="COL",
                   help="--groups: the column of slide ids (default slide_id)")
    p.add_argument("--empty-bags", default="refuse", choices=("refuse", "skip"),
                   help="a row without patches: refuse the run (default) or leave it out (recorded in the lineage)")
    p.add_argument("--no-labels", action="store_true",
                   help="leave the bags' labels out of the embedding split (recorded in the lineage): for groups "
                   "whose bags disagree; give the task at probe time (probe --labels CSV --id-column COLUMN)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run (keeps written chunks)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing embedding split")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N (python: slide encoders)")
    p.add_argument("--autocast", default="none", choices=("none", "bfloat16", "float16"),
                   help="autocast dtype of a python: slide encoder (recorded; default none: float32)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it shows on a terminal only)")
    add_storage_options(p)


def run(args: argparse.Namespace) -> int:
    from featurestore.embed.run import EmbedOptions, embed
    from featurestore.embed.slide_encoders import POOLINGS

    if args.slide_encoder in POOLINGS and args.device not in ("auto", "cpu"):  # auto, the default: the CPU here
        raise InvalidOption(f"--device {args.device} applies to python: slide encoders; {args.slide_encoder} pooling "
                            "runs in float32/float64 on the CPU: drop --device")
    opts = EmbedOptions(
        store=args.store, dataset=args.dataset, encoder=args.encoder, split=args.split,
        slide_encoder=args.slide_encoder, encoder_name=args.encoder_name, out_split=args.out_split,
        dtype=args.dtype, max_patches=args.max_patches, seed=args.seed, group_by=args.group_by,
        groups=args.groups, id_column=args.id_column,
        empty_bags=args.empty_bags, no_labels=args.no_labels, resume=args.resume, overwrite=args.overwrite,
        device=args.device, autocast=args.autocast, storage_options=options_from_args(args, args.store),
        progress=args.progress)
    with store_errors(args.store), kind_hint("featurestore embed derives slide or patient embeddings from a bag "
                                             "split (--encoder, --split name it)"):
        result = embed(opts)
    if result.rank != 0:
        return 0
    if result.status == "already-complete":
        print(f"{result.key}: already complete ({result.num_rows} rows); --overwrite to recompute")
    else:
        print(f"{result.key}: {result.num_rows} rows ({result.computed} computed by this run) in "
              f"{result.seconds:.1f} s")
    return 0
