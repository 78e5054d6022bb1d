"""``featurestore status STORE DATASET ENCODER SPLIT``: how far a split is, and for one being written
by ``--worker`` processes: slides done, claimed (by which worker, lease age), failed, left, and
an estimated time to finish (docs/EXTRACT.md, "Cluster workers")."""

from __future__ import annotations

import argparse
import datetime as _dt
from typing import Any

from featurestore.commands.parsers import add_verb
from featurestore.commands.report_line import split_args
from featurestore.commands.storeargs import add_split_names, add_storage_options, open_store_from_args, store_errors


HELP = "progress of a split (slides done, claimed, failed, left, time to finish)"
DESCRIPTION = """\
Show a split's status. For a bag split being written by --worker processes: the slides done, claimed (worker
host/pid/start, lease age), failed and left, and an estimated time to finish from the pace of the done slides.
A derived split (featurestore embed) whose source changed since reads complete STALE, with why and the fix,
as verify says it.
"""


def register(subparsers: Any) -> None:
    p = add_verb(subparsers, "status", run, HELP, DESCRIPTION)
    add_split_names(p, store=True)
    add_storage_options(p)


def _when(seconds: float | None) -> str:
    return _dt.datetime.fromtimestamp(seconds or 0, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def run(args: argparse.Namespace) -> int:
    from featurestore.core.claim_status import done_text, progress, run_total, skipped_text
    from featurestore.format import layout

    store = open_store_from_args(args.store, args)
    with store_errors(args.store):
        meta = store.split_info(args.dataset, args.encoder, args.split)
        key = layout.split_key(args.dataset, args.encoder, args.split)
        if meta.complete:
            from featurestore.core.lineage import stale_fix, stale_reason

            count = (meta.bags or {}).get("count", meta.num_samples)
            failed = meta.extra.get("failed") or []
            reason = stale_reason(store, meta.to_json())  # a derived split whose source changed since (as ls, verify)
            print(f"split {key}: complete" + (" STALE" if reason else "")
                  + f", {count} {'bags' if meta.bags else 'samples'}"
                  + (f", {len(failed)} slide(s) failed: {', '.join(f['id'] for f in failed)}" if failed else "")
                  + skipped_text(meta.extra))
            if reason:
                print(f"  STALE: {reason}: {stale_fix(reason, key, args.store)}")
            return 0
        state = progress(store.storage, key, run_total(meta.extra))
        if not (state["workers"] or state["committing"]):  # a plain run (torchrun, one process): no claims
            print(_plain_run(store.storage, key, meta))
            return 0
    left = "?" if state["left"] is None else state["left"]
    print(f"split {key}: {meta.status}; slides done {done_text(state)}, claimed {len(state['claimed'])}, "
          f"failed {len(state['failed'])}, left {left} (of {state['total'] or '?'}); "
          f"{state['workers']} worker(s) seen")
    for c in state["claimed"]:
        print(f"  claimed {c['id']!r} by {c['host']} pid {c['pid']} (worker started {_when(c['started'])}), "
              f"lease age {c['lease_age']:.0f}s of {c['lease']:.0f}s{' EXPIRED' if c['expired'] else ''}, "
              f"attempt {c['attempt']}")
    if state["failed"]:
        print(f"  failed: {', '.join(state['failed'])}")
    if state["given_back"]:
        print(f"  given back by stopped workers, for the next worker: {', '.join(state['given_back'])}")
    if c := state["committing"]:
        print(f"  committing: by {c['host']} pid {c['pid']}, lease age {c['lease_age']:.0f}s of {c['lease']:.0f}s"
              + (" EXPIRED (its worker is gone: `featurestore commit` or the next worker takes it over)"
                 if c["expired"] else ""))
    if state["left"] == 0 and not state["claimed"] and not state["committing"]:  # --no-commit workers all done
        print(f"  every slide is done: commit it with `featurestore commit {split_args(args.store, key)}`")
    elif state["eta_seconds"] is not None:
        print(f"  estimated time to finish: {state['eta_seconds']:.0f}s")
    return 0


def _plain_run(storage: Any, key: str, meta: Any) -> str:
    """What a split written without --worker holds on storage: its complete bags, or its chunks."""
    from featurestore.core.claim_status import run_total

    if meta.bags is not None:
        from featurestore.core.bag_commit import collect

        total = run_total(meta.extra)
        done = len(collect(storage, key, meta).records)
        return (f"split {key}: {meta.status}; {done} bag(s) complete on storage"
                + (f" of {total} slides" if total is not None else "")
                + "; no --worker claims (a plain run): --resume goes on from them")
    from featurestore.core.present import present_chunks
    from featurestore.format.metadata import chunk_arrays

    done = len(present_chunks(storage, key, chunk_arrays(meta)))
    return (f"split {key}: {meta.status}; {done} of {meta.num_chunks} chunks on storage "
            f"({meta.chunk_rows} samples each); --resume writes the others")
