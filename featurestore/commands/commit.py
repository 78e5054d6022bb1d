"""``featurestore commit STORE DATASET ENCODER SPLIT``: commit a bag split written by ``--worker``
processes started with ``--no-commit`` (or whose committing worker died): every complete bag, in
id order, with the failed slides listed in the metadata (docs/EXTRACT.md, "Cluster workers")."""

from __future__ import annotations

import argparse
import contextlib
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
    from featurestore.core.claim_status import progress, run_total, skipped_text
    from featurestore.errors import InvalidOption, WrongSplitKind
    from featurestore.extract.workers_share import commit_extra
    from featurestore.format import layout

    # Opened as an existing store (a mistyped path must not become a new one); the commit writes
    # through its storage below.
    store = open_store_from_args(args.store, args)
    with store_errors(args.store):
        meta = store.split_info(args.dataset, args.encoder, args.split)
        key = layout.split_key(args.dataset, args.encoder, args.split)
        if meta.bags is None:
            raise WrongSplitKind(f"split {key} is a dense split: `featurestore commit` commits bag splits of --worker")
        if meta.complete:  # a step after the workers, run when the last worker already committed: fine
            print(f"split {key} is already complete ({(meta.bags or {}).get('count')} bags): nothing to commit")
            return 0
        state = progress(store.storage, key, run_total(meta.extra))
        live = [c for c in state["claimed"] if not c["expired"]]
        if live:
            first = live[0]
            raise InvalidOption(f"split {key}: {len(live)} slide(s) still claimed by live workers "
                                f"(e.g. {first['id']!r} "
                                f"by {first['host']} pid {first['pid']}): wait for them (featurestore status)")
        board = claims.ClaimBoard(store.storage, key, lease=120, max_attempts=1)
        claim, _ = board.claim("_commit", special=True)
        if claim is None:
            raise InvalidOption(f"split {key}: a worker is committing it now: wait (featurestore status)")
        try:
            # Slides neither done nor failed (given back, or never started): counted against the
            # bags complete on storage too, which a run before the workers (a resume) may have
            # written. Read once, under the claim, and laid out by the commit as read.
            found = bag_commit.collect(store.storage, key, meta)
            ended = set(found.records) | set(state["ended"])
            left = None if state["total"] is None else max(0, state["total"] - len(ended))
            if left:
                back = state["given_back"]
                given = f" ({len(back)} given back by stopped workers, e.g. {back[0]!r})" if back else ""
                raise InvalidOption(f"split {key}: {left} of {state['total']} slides are not done yet{given}"
                                    + ": start --worker processes to finish them (the one that ends the run "
                                      "commits; featurestore status shows progress)")
            extra = commit_extra(store.storage, key)
            if (meta.extra.get("source") or {}).get("kind") != "wsi":
                extra.pop("skipped")  # an import records no skipped slides
            final = bag_commit.commit(store.storage, key, meta, extra=extra, found=found)
        except BaseException:
            with contextlib.suppress(Exception):  # given back: the next try need not wait out its lease
                board.release(claim, "its commit failed")
            raise
    failed = final.extra.get("failed") or []
    print(f"committed {key}: {(final.bags or {}).get('count')} bags"
          + (f", {len(failed)} failed slide(s): {', '.join(f['id'] for f in failed)}" if failed else "")
          + skipped_text(final.extra))
    return 0
