"""``--worker`` and its flags, shared by ``featurestore extract`` (wsi: sources) and ``import DIR``
(per-slide files): any number of independent processes claim the split's slides one at a time
(featurestore.extract.workers_share; docs/EXTRACT.md, "Cluster workers")."""

from __future__ import annotations

import argparse
from typing import Any

from featurestore.errors import InvalidOption


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster workers (docs/EXTRACT.md, 'Cluster workers')")
    group.add_argument("--worker", action="store_true",
                       help="one of any number of independent workers on this split (same command anywhere, any "
                       "time): create or attach to it, claim one slide at a time on the store, until none is left; "
                       "the last to finish commits. SIGTERM or Ctrl-C gives the slide held back at once (exit 143 "
                       "or 130)")
    group.add_argument("--lease-seconds", type=float, default=120.0, metavar="S",
                       help="--worker: a claim not renewed for S seconds is taken over by another worker "
                       "(renewed every S/3; default 120)")
    group.add_argument("--max-attempts", type=int, default=3, metavar="K",
                       help="--worker: a slide that fails K times is recorded as failed, not retried (default 3)")
    group.add_argument("--no-commit", action="store_true",
                       help="--worker: leave the commit to `featurestore commit STORE DATASET ENCODER SPLIT`")


def worker_options(args: argparse.Namespace) -> Any:
    """The WorkerOptions of ``--worker``; None without it (its flags alone are refused)."""
    if not args.worker:
        if args.no_commit or args.lease_seconds != 120.0 or args.max_attempts != 3:
            raise InvalidOption("--lease-seconds, --max-attempts and --no-commit apply to --worker: add --worker")
        return None
    if getattr(args, "resume", False) or getattr(args, "overwrite", False):
        raise InvalidOption("--worker creates the split or attaches to it: leave out --resume/--overwrite")
    from featurestore.extract.workers_share import WorkerOptions

    options = WorkerOptions(args.lease_seconds, args.max_attempts, not args.no_commit)
    options.check()
    return options
