"""``featurestore commit STORE DATASET ENCODER SPLIT``: commit a bag split written by ``--worker``
processes started with ``--no-commit`` (or whose committing worker died): every complete bag, in
id order, with the failed slides listed in the metadata (docs/EXTRACT.md, "Cluster workers")."""

from __future__ import annotations

import argparse
from typing import Any

from featurestore.commands.parsers import add_verb
from featurestore.commands.storeargs import add_split_names, add_storage_options, open_store_from_args, store_errors


DESCRIPTION = """\
Commit a bag split whose --worker processes ran with --no-commit (or whose committing worker died). Refused
while a live worker still holds a slide; slides recorded as failed are listed in the split's metadata
('failed').
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "commit", run, "commit a bag split written by --worker processes", DESCRIPTION)
    add_split_names(p, store=True)
    add_storage_options(p)


def run(args: argparse.Namespace) -> int:
    from featurestore.core import bag_commit, claims
    from featurestore.core.claim_status import progress, skipped_text
    from featurestore.errors import InvalidOption, SplitExists, WrongSplitKind
    from featurestore.extract.workers_share import commit_extra
    from featurestore.format import layout

    store = open_store_from_args(args.store, args, mode="a")
    with store_errors(args.store):
        meta = store.split_info(args.dataset, args.encoder, args.split)
        key = layout.split_key(args.dataset, args.encoder, args.split)
        if meta.bags is None:
            raise WrongSplitKind(f"split {key} is a dense split: `featurestore commit` commits bag splits of --worker")
        if meta.complete:
            raise SplitExists(f"split {key} is already complete: nothing to commit")
        live = [c for c in progress(store.storage, key, None)["claimed"] if not c["expired"]]
        if live:
            first = live[0]
            raise InvalidOption(f"split {key}: {len(live)} slide(s) still claimed by live workers "
                                f"(e.g. {first['id']!r} "
                                f"by {first['host']} pid {first['pid']}): wait for them (featurestore status)")
        board = claims.ClaimBoard(store.storage, key, lease=120, max_attempts=1)
        claim, _ = board.claim("_commit", special=True)
        if claim is None:
            raise InvalidOption(f"split {key}: a worker is committing it now: wait (featurestore status)")
        extra = commit_extra(store.storage, key)
        if (meta.extra.get("source") or {}).get("kind") != "wsi":
            extra.pop("skipped")  # an import records no skipped slides
        final = bag_commit.commit(store.storage, key, meta, extra=extra)
    failed = final.extra.get("failed") or []
    print(f"committed {key}: {(final.bags or {}).get('count')} bags"
          + (f", {len(failed)} failed slide(s): {', '.join(f['id'] for f in failed)}" if failed else "")
          + skipped_text(final.extra))
    return 0
