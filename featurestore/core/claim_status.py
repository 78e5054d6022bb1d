"""Progress of a split written by ``--worker`` processes, from its claims (featurestore.core.claims):
what ``featurestore status`` prints and the web page's split page shows."""

from __future__ import annotations

import time
from typing import Any

from featurestore.core import claims
from featurestore.core.storage import Storage

__all__ = ["progress", "run_total"]


def run_total(extra: dict[str, Any]) -> int | None:
    """The slides of the run, as the split's metadata records them (wsi extraction, bag import)."""
    source = extra.get("source") or {}
    total = source.get("slides", source.get("num_bags"))
    return int(total) if total is not None else None


def progress(storage: Storage, split_key: str, total: int | None, now: float | None = None) -> dict[str, Any]:
    """Counts (done, of them skipped, claimed, failed, left), the live claims (worker, host, pid, start,
    lease age)
    and an estimated time to finish from the pace of the done slides (None until two are done).
    ``total``: slides in the run (None: unknown, left is then None)."""
    now = now or time.time()
    records = claims.read_records(storage, split_key)
    done = [r for r in records.values() if r.get("state") == claims.DONE]
    failed = sorted(u for u, r in records.items() if r.get("state") == claims.FAILED)
    claimed = []
    for unit, r in sorted(records.items()):
        if r.get("state") == claims.WORKING:
            age = now - float(r.get("renewed", now))
            claimed.append({"id": unit, "worker": r.get("worker"), "host": r.get("host"), "pid": r.get("pid"),
                            "started": r.get("started"), "lease_age": round(age, 1), "lease": r.get("lease"),
                            "expired": claims.expired(r, now), "attempt": r.get("attempts")})
    left = None if total is None else max(total - len(done) - len(failed), 0)
    eta = None
    # The pace since the run's first claim, all workers together: between the first and the last
    # slide done, workers started together finish their first slides within milliseconds of each
    # other, and that pace said "0 s" with most of the run left.
    starts = [float(r["claimed"]) for r in records.values() if isinstance(r.get("claimed"), (int, float))]
    if left is not None and len(done) >= 2 and starts and now > min(starts):
        eta = left / (len(done) / (now - min(starts)))
    workers = sorted({r.get("worker") for r in records.values() if r.get("worker")})
    skipped = sorted(u for u, r in records.items() if r.get("state") == claims.DONE and r.get("skipped"))
    # given back by a stopped worker (SIGTERM, Ctrl-C: ClaimBoard.release), for the next worker to take
    given_back = sorted(u for u, r in records.items() if r.get("state") == claims.RELEASED and r.get("released"))
    ended = sorted(u for u, r in records.items() if r.get("state") in (claims.DONE, claims.FAILED))
    return {"done": len(done), "skipped": skipped, "claimed": claimed, "failed": failed, "left": left,
            "total": total, "eta_seconds": eta, "workers": len(workers), "given_back": given_back, "ended": ended,
            "committing": _committing(storage, split_key, now)}


def _committing(storage: Storage, split_key: str, now: float) -> dict[str, Any] | None:
    """The worker committing the split now (its ``_commit`` claim), or None: a commit holds the
    split for its lease even when its worker died, so status shows who and for how long."""
    import json

    try:
        record = json.loads(storage.read(claims.special_key(split_key, "_commit")))
    except (FileNotFoundError, ValueError):
        return None
    if record.get("state") != claims.WORKING:
        return None
    return {"worker": record.get("worker"), "host": record.get("host"), "pid": record.get("pid"),
            "lease_age": round(now - float(record.get("renewed", now)), 1), "lease": record.get("lease"),
            "expired": claims.expired(record, now)}


def done_text(state: dict[str, Any]) -> str:
    """``3`` or ``3 (1 skipped)``: the done slides of :func:`progress`, for `status` and the web page."""
    return f"{state['done']}" + (f" ({len(state['skipped'])} skipped)" if state["skipped"] else "")


def skipped_text(extra: dict[str, Any]) -> str:
    """``, 1 skipped: junk`` for a committed split's skipped slides (its metadata's ``skipped``), else ''."""
    skipped = extra.get("skipped") or []
    return f", {len(skipped)} skipped: {', '.join(str(s.get('id')) for s in skipped)}" if skipped else ""
