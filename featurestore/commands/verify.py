"""``featurestore verify``: check a store, exit 0 (clean), 1 (damaged or stale) or 2 (nothing checked).

The exit status tells a script what happened: 1 only when damage (or a stale derived split) was found; 2 when what was
asked could not be checked at all (no such dataset, encoder or split, a bad name, a store that
is missing or unreachable), like argparse's own usage errors. A clean status never stands for
"found nothing to check" where something was named.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from featurestore.format.sizes import bytes_text as _size
from featurestore.commands.parsers import add_verb
from featurestore.commands.storeargs import (add_split_flags, add_storage_options, flagged_split, open_store_from_args,
                                            split_parts, store_errors)
from featurestore.errors import FeatureStoreError, InvalidOption

EXIT_CLEAN, EXIT_DAMAGED, EXIT_NOT_CHECKED = 0, 1, 2


HELP = "check the documents and every chunk of complete splits; exit 1 on damage"
DESCRIPTION = """\
Check the store: every group has its zarr.json, each complete split's array documents agree with its metadata
(shape, chunking, dtype), every chunk is present with the right size and crc32c, and every statistics row
carries the split's generation and its own chunk index and matches its features chunk (docs/FORMAT.md,
'Guarantees'); every chunk's crc32c is also the one chunk_seals holds for its place (bag splits, and dense
splits committed with the table), so a chunk swapped, moved or copied from another run is found
(docs/FORMAT.md, 'Chunk seals'). Every problem is listed. Incomplete splits are listed, not counted as damage;
temporary files left by killed writers are listed as leftovers (a resume removes them). A derived split
(featurestore embed) whose source was rewritten or removed since it was computed is listed as STALE. Exit
status 0 if clean, 1 if anything is damaged or stale, 2 if nothing could be checked (no such dataset, encoder
or split; a missing or unreachable store).
"""


def register(subparsers: Any) -> None:
    verify = add_verb(subparsers, "verify", run_verify, HELP, DESCRIPTION)
    verify.add_argument("url")
    verify.add_argument("names", nargs="*", metavar="DATASET ENCODER SPLIT",
                        help="optionally one split: DATASET ENCODER SPLIT, or DATASET/ENCODER/SPLIT as "
                        "`featurestore ls` prints it (default: every split)")
    add_split_flags(verify)
    add_storage_options(verify)


def run_verify(args: argparse.Namespace) -> int:
    try:
        with store_errors(args.url):
            return _run_verify(args)
    except FeatureStoreError as error:
        if getattr(args, "debug", False):
            raise
        print(f"featurestore: error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_NOT_CHECKED


def _run_verify(args: argparse.Namespace) -> int:
    from featurestore.core.lineage import stale_fix
    from featurestore.core.verify import verify_store

    names = split_parts(args.names) if args.names else []
    if names is None:
        raise InvalidOption(f"verify takes one split, DATASET ENCODER SPLIT or DATASET/ENCODER/SPLIT, or none "
                            f"(every split), but got {' '.join(args.names)!r}")
    names = flagged_split(args, positionals=bool(names)) or names
    store = open_store_from_args(args.url, args)
    found = verify_store(store, *(names or [None, None, None]))
    for problem in found.problems:
        print(f"DAMAGED {problem}")
    damaged = checked = stale = 0
    for result in found.checks:
        if result.status == "writing":
            print(f"{result.key}: incomplete (status {result.status!r}), not checked")
            continue
        checked += 1
        if result.damaged:
            damaged += 1
            for problem in result.problems:
                print(f"DAMAGED {problem}")
        else:
            print(f"{result.key}: ok ({result.chunks_checked} chunks)")
        reason = _stale(store, result.key)
        if reason is not None:
            stale += 1
            print(f"STALE {result.key}: {reason}: {stale_fix(reason, result.key, args.url)}")
    for temp in found.leftovers:
        writer = "running" if temp.writer_alive else "not running"
        print(f"LEFTOVER {temp.key}: temporary file of an unfinished write ({_size(temp.size)}, "
              f"writer pid {temp.pid} {writer}, {temp.age_s / 60:.0f} min old)")
    print(f"{checked} complete split(s) checked, {damaged} damaged"
          + (f", {stale} stale (their source changed since they were computed)" if stale else "")
          + (f"; {len(found.problems)} problem(s) in the store's group documents" if found.problems else ""))
    if damaged:
        print("to repair a damaged split: the command that wrote it plus --resume --verify-chunks (featurestore "
              "extract ... or featurestore import ...) rewrites its damaged chunks from the input (in a bag split, "
              "the bags with rows in them)")
    if found.leftovers:
        total = sum(t.size for t in found.leftovers)
        print(f"{len(found.leftovers)} leftover temporary file(s), {_size(total)}: not damage; "
              "resuming the split (extract/import --resume) removes those of writers no longer running")
    return EXIT_DAMAGED if damaged or stale or found.problems else EXIT_CLEAN


def _stale(store: Any, key: str) -> str | None:
    """Why the derived split ``key`` (dataset/encoder/split) is stale, or None (featurestore.core.lineage)."""
    from featurestore.core.lineage import stale_reason

    try:
        metadata = store.split_metadata(*key.split("/"))
    except FeatureStoreError:  # unreadable metadata is already reported as damage
        return None
    return stale_reason(store, metadata)

