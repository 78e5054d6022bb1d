"""``featurestore rm STORE DATASET ENCODER SPLIT``: remove one split (its arrays, its index, what
lies under it), after a y/N question on a terminal or with ``--yes``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from featurestore.commands.parsers import add_verb
from featurestore.commands.storeargs import add_split_names, add_storage_options, open_store_from_args, store_errors


DESCRIPTION = """\
Remove one split (dense or bags) and everything under it. On a terminal it asks y/N first; elsewhere (a
script, a pipe) it refuses unless --yes is given. A name that does not exist is refused. The split is marked
incomplete before its files go, so a removal cut short never leaves a split that reads as complete.
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "rm", run, "remove one split from a store", DESCRIPTION)
    add_split_names(p, store=True)
    p.add_argument("--yes", action="store_true", help="remove without asking")
    add_storage_options(p)


def run(args: argparse.Namespace) -> int:
    from featurestore.errors import InvalidOption, SplitNotFound
    from featurestore.format import layout
    from featurestore.format.names import validate_name

    key = layout.split_key(validate_name(args.dataset, "dataset"), validate_name(args.encoder, "encoder"),
                           validate_name(args.split, "split"))
    # Opened as an existing store (a mistyped path must not become a new, empty one: StoreNotFound,
    # "check the URL"); the removal writes through its storage below.
    store = open_store_from_args(args.store, args)
    with store_errors(args.store):
        splits = store.splits(args.dataset, args.encoder)  # DatasetNotFound / EncoderNotFound, one line
        if args.split not in splits:
            shown = ", ".join(splits[:5]) + (", ..." if len(splits) > 5 else "")
            raise SplitNotFound(f"no split {key} in {store.url} (splits of {args.dataset}/{args.encoder}: "
                                f"{shown or 'none'}): nothing removed; check the name (featurestore ls)")
        what = _describe(store, args)
        if not args.yes:
            if not sys.stdin.isatty():
                raise InvalidOption(f"refusing to remove split {key} ({what}) without --yes: stdin is not a "
                                    "terminal to ask on; pass --yes to remove it")
            answer = input(f"remove split {key} ({what}) from {store.url}? [y/N] ")
            if answer.strip().lower() not in ("y", "yes"):
                print(f"split {key} kept", file=sys.stderr)
                return 1
        _remove(store, key)
    print(f"removed {key} ({what})")
    return 0


def _describe(store: Any, args: argparse.Namespace) -> str:
    from featurestore.errors import FeatureStoreError

    try:
        meta = store.split_metadata(args.dataset, args.encoder, args.split)
    except FeatureStoreError:
        return "unreadable metadata"
    if meta.get("kind") == "bags":
        count = (meta.get("bags") or {}).get("count")
        return f"bags, {count} bags, {meta.get('num_samples')} patches, {meta.get('status')}"
    return f"{meta.get('num_samples')} samples of {meta.get('sample_shape')}, {meta.get('status')}"


def _remove(store: Any, key: str) -> None:
    from featurestore.format import layout

    storage = store.storage
    document = f"{key}/{layout.ZARR_JSON}"
    try:  # as an overwrite does: incomplete first, so a delete cut short never reads as complete
        doc = json.loads(storage.read(document))
        attrs = dict((doc.get("attributes") or {}).get("featurestore") or {})
        attrs["status"] = "writing"
        storage.write(document, layout.group_document({"featurestore": attrs}))
    except (FileNotFoundError, ValueError, AttributeError):
        pass  # a damaged document: the delete below removes it too
    storage.delete_tree(key)
