"""DDP training of the gated-attention MIL head (ABMIL) on a bag split, one bag shard per rank.

Each rank streams its share of the epoch's bags with ``client.BagLoader(rank=, world_size=)``
(the ranks' shares are disjoint and together hold every bag once, when the bag count is a
multiple of the world size; docs/LOADER.md, "DDP"), and ``DistributedDataParallel`` averages the
gradients of :class:`featurestore.probes.abmil.GatedABMIL`, so every rank ends with the same
weights. From object storage, give each node a local chunk cache (``--cache-dir`` or
``$FEATURESTORE_CACHE_DIR``): the second epoch reads its chunks from local disk.

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \\
        examples/ddp_abmil.py s3://bucket/features cohort ENCODER all --epochs 20 --cache-dir /scratch/fs

The task's labels are the split's own, or a clinical table's column (``--labels CSV --label-column
COL``, as ``featurestore probe`` takes them: slides the table does not list are left out).
gloo on the CPU, nccl with ``cuda:LOCAL_RANK`` when CUDA is there. ``--ids-dir DIR`` writes the
bag ids each rank saw per epoch (``rank{R}-epoch{E}.txt``), ``--save DIR`` each rank's final
weights (``rank{R}.pt``); the last line of each rank's output is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from client import BagLoader
from featurestore.commands.storeargs import add_cache_options, add_storage_options, options_from_args
from featurestore.errors import FeatureStoreError
from featurestore.probes.abmil import GatedABMIL
from featurestore.probes.labels import read_label_table
from featurestore.probes.mil_run import num_classes_of, open_bags


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DDP ABMIL on a bag split (run under torchrun)")
    parser.add_argument("store")
    parser.add_argument("dataset")
    parser.add_argument("encoder")
    parser.add_argument("split")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--num-classes", type=int, default=None,
                        help="default: the table's classes, else the split's (its class names, else max label + 1)")
    parser.add_argument("--labels", metavar="CSV", default=None, help="the task's labels from this table")
    parser.add_argument("--label-column", metavar="COL", default=None, help="--labels: the labels' column")
    parser.add_argument("--id-column", metavar="COL", default="slide_id", help="--labels: the slide ids' column")
    parser.add_argument("--max-patches", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ids-dir", default=None, help="write each rank's bag ids per epoch here")
    parser.add_argument("--save", default=None, help="write each rank's final state_dict here")
    add_storage_options(parser)
    add_cache_options(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if (args.labels is None) != (args.label_column is None):
        sys.exit("ddp_abmil.py: error: --labels CSV and --label-column COL go together")
    if "RANK" not in os.environ:
        sys.exit("ddp_abmil.py: run it under torchrun (e.g. torchrun --nproc-per-node 2 examples/ddp_abmil.py ...)")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    try:
        # Labels required: the split's, or the table's (ds.labelled: the slides it labels).
        table = read_label_table(args.labels, args.label_column, args.id_column) if args.labels else None
        ds = open_bags(args.store, args.dataset, args.encoder, args.split,
                       storage_options=options_from_args(args, args.store), table=table)
        # Same seed on every rank: the same epoch order, so the shares are a partition of it.
        loader = BagLoader(ds, batch_size=1, shuffle=True, seed=args.seed, device=device, indices=ds.labelled,
                           max_patches=args.max_patches, rank=rank, world_size=world_size, return_ids=True)
        for folder in (args.ids_dir, args.save):
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)
        torch.manual_seed(args.seed)  # DDP broadcasts rank 0's weights anyway; this keeps runs repeatable
        model = GatedABMIL(ds.dim, args.num_classes or num_classes_of([ds], table)).to(device)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        loss_fn = nn.CrossEntropyLoss()
        losses = []
        for epoch in range(args.epochs):
            loader.set_epoch(epoch)
            seen: list[str] = []
            total = 0.0
            for features, mask, _coords, labels, ids in loader:
                logits, _ = ddp(features, mask)
                loss = loss_fn(logits, labels.to(device).long())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # all-reduces the gradients: every rank takes the same step
                optimizer.step()
                total += loss.item()
                seen.extend(ids)
            losses.append(total / max(1, len(seen)))
            if args.ids_dir:
                Path(args.ids_dir, f"rank{rank}-epoch{epoch}.txt").write_text("".join(f"{i}\n" for i in seen))
        if args.save:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()}, Path(args.save, f"rank{rank}.pt"))
        print(json.dumps({"rank": rank, "world_size": world_size, "batches_per_epoch": len(loader),
                          "losses": losses, "finite": all(math.isfinite(x) for x in losses)}), flush=True)
    except FeatureStoreError as error:  # one line, as the featurestore commands print it
        sys.exit(f"ddp_abmil.py: error: {error}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
