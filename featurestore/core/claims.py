"""Claims: which worker does which unit (slide) of a split, on the store's own atomic writes.

``featurestore extract/import --worker`` runs any number of independent processes on one split;
nothing coordinates them but objects under ``<split>/segments/.claims/`` (a name ``collect``
skips and a commit deletes with the segments). Each unit has one claim object, a small JSON
record ``{"unit", "state", "worker", "host", "pid", "pid_space", "started", "claimed", "renewed",
"lease", "attempts", "errors", ...}``:

* **claim**: ``put_if_absent`` (local: link of a finished file; S3/GCS/Azure: PUT If-None-Match).
  Exactly one worker creates it; the others see it taken.
* **renew**: every ``lease/3`` the holder rewrites its own record with ``replace_if`` the token
  it last wrote (local: inode+mtime under a lock; object stores: If-Match etag). A record taken
  over by someone else has another token, so a stale holder's renew fails and it stops.
* **take over**: a record in state ``working`` whose ``renewed`` is older than its lease (its
  worker died or stopped) or whose worker's process is gone from this pid namespace (a worker
  killed on this machine, in this container: no lease to wait out), or ``released`` (an attempt
  failed), is replaced with ``replace_if`` the token read: of two takers, one wins.
* **finish**: ``done`` (the bag is complete on storage) or, after ``max_attempts`` failed
  attempts, ``failed`` with the errors: never retried, listed in the committed split's metadata.
* **release**: a worker stopped (SIGTERM, Ctrl-C) gives its unit back as ``released`` with the
  attempt uncounted: the next worker takes it at once.

Clocks: lease ages compare the holder's clock (``renewed``) with the reader's, so hosts must agree
within a fraction of the lease (NTP does).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote

from featurestore.core.storage import Storage
from featurestore.core.storage.process import pid_alive, pid_space
from featurestore.errors import ConditionalWritesUnsupported

__all__ = ["Claim", "ClaimBoard", "WorkerId", "claims_prefix", "probe", "read_records", "special_key"]

WORKING, RELEASED, DONE, FAILED = "working", "released", "done", "failed"
SUFFIX = ".json"
#: Bytes of an encoded id in a claim's name: file systems take 255 a name, and a put's temporary
#: name adds its writer's pid and a random part.
MAX_NAME = 150


def claims_prefix(split_key: str) -> str:
    return f"{split_key}/segments/.claims"


@dataclass(frozen=True)
class WorkerId:
    """Who holds a claim: host, pid and start time (a restarted pid is another worker), and the
    pid namespace of this process (:func:`~featurestore.core.storage.process.pid_space`; None for
    an id naming another process, which this one cannot vouch for)."""

    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    pid_space: str | None = None

    def __post_init__(self) -> None:
        if self.pid_space is None and self.pid == os.getpid() and self.host == socket.gethostname():
            object.__setattr__(self, "pid_space", pid_space())

    @property
    def name(self) -> str:
        return f"{self.host}/{self.pid}/{self.nonce}"


@dataclass
class Claim:
    """A unit this worker holds: the token of the record it last wrote."""

    unit: str
    token: str
    record: dict[str, Any]


def probe(storage: Storage, split_key: str) -> None:
    """Refuse a backend that does not enforce create-if-absent: the same probe object created
    twice must fail the second time (some S3-compatible servers ignore If-None-Match). The probe
    objects lie with the claims, and go with them at commit."""
    key = f"{claims_prefix(split_key)}/_probe-{uuid.uuid4().hex}"
    if storage.put_if_absent(key, b"1") is None:
        raise ConditionalWritesUnsupported(f"{storage.url}: a new probe object {key!r} was reported as existing")
    if storage.put_if_absent(key, b"2") is not None:
        raise ConditionalWritesUnsupported(
            f"{storage.url}: the server accepted a second create of {key!r} (it ignores If-None-Match), so "
            "claims could race: run --worker against a server that enforces conditional writes "
            "(AWS S3, GCS, Azure, SeaweedFS, MinIO; docs/EXTRACT.md) or use torchrun")
    # A replace with a stale token must fail too: else a worker frozen past its lease renews a
    # slide another worker took over, and the slide is encoded twice.
    _, token = storage.read_versioned(key)
    fresh = storage.replace_if(key, b"3", token)
    if fresh is not None and storage.replace_if(key, b"4", token) is not None:
        raise ConditionalWritesUnsupported(
            f"{storage.url}: the server accepted a replace of {key!r} with a stale version (it ignores "
            "If-Match), so a worker past its lease could keep a slide another took over: run --worker against a "
            "server that enforces conditional writes (AWS S3, GCS, Azure, SeaweedFS, MinIO) or use torchrun")


def special_key(split_key: str, unit: str) -> str:
    """The claim object of a step of the run (``_create``, ``_commit``), named apart from every bag id."""
    return f"{claims_prefix(split_key)}/_{unit}.lock"


def _key(prefix: str, unit: str) -> str:
    """A unit's claim object: its id percent-encoded, named apart from the run's own objects (a
    leading ``_``, kept by quote(), is encoded: ``_junk`` read as a special object was never seen
    as claimed); an id too long for a file name once encoded (a few dozen CJK characters) is named
    by its hash, ``%%`` + hex, which no encoded id can be. The record holds the id either way."""
    name = quote(unit, safe="")
    if name.startswith("_"):
        name = "%5F" + name[1:]
    if len(name.encode()) > MAX_NAME:
        name = "%%" + hashlib.sha256(unit.encode()).hexdigest()
    return f"{prefix}/{name}{SUFFIX}"


def read_records(storage: Storage, split_key: str) -> dict[str, dict[str, Any]]:
    """Every unit's claim record (unit -> record), e.g. for ``featurestore status``."""
    prefix = claims_prefix(split_key)
    names = [n for n in storage.listdir(prefix) if n.endswith(SUFFIX) and not n.startswith("_")]
    out: dict[str, dict[str, Any]] = {}
    # All at once: a split of 10,000 slides has as many records, a round trip each on an object store.
    for name, raw in zip(names, storage.read_present([f"{prefix}/{name}" for name in names])):
        if raw is None:  # deleted meanwhile: the split was committed
            continue
        try:
            record = json.loads(bytes(raw))  # an object store hands back a buffer, not bytes
        except ValueError:
            continue
        unit = record.get("unit") if isinstance(record, dict) else None
        out[unit if isinstance(unit, str) else unquote(name[: -len(SUFFIX)])] = record
    return out


def expired(record: dict[str, Any], now: float | None = None) -> bool:
    """A claim nobody holds any more: released, or working with its lease run out."""
    if record.get("state") == RELEASED:
        return True
    if record.get("state") != WORKING:
        return False
    return (now or time.time()) - float(record.get("renewed", 0)) > float(record.get("lease", 0)) or gone(record)


def gone(record: dict[str, Any]) -> bool:
    """Whether the record's worker ran in this pid namespace and its process no longer exists
    (SIGKILLed, OOM-killed): its claim is free now, not when its lease runs out. A pid reused
    since by another process reads as alive: then the lease decides, as for a worker elsewhere."""
    pid, space = record.get("pid"), record.get("pid_space")
    return space is not None and space == pid_space() and isinstance(pid, int) and not pid_alive(pid)


class ClaimBoard:
    """One worker's view of a split's claims (module doc)."""

    def __init__(self, storage: Storage, split_key: str, *, lease: float, max_attempts: int,
                 worker: WorkerId | None = None) -> None:
        self.storage = storage
        self.split_key = split_key
        self.prefix = claims_prefix(split_key)
        self.lease = float(lease)
        self.max_attempts = int(max_attempts)
        self.worker = worker or WorkerId()

    def _record(self, unit: str, state: str, attempts: int, errors: list[str], **extra: Any) -> dict[str, Any]:
        now = time.time()
        w = self.worker
        return {"unit": unit, "state": state, "worker": w.name, "host": w.host, "pid": w.pid,
                "pid_space": w.pid_space, "started": w.started, "claimed": now, "renewed": now, "lease": self.lease,
                "attempts": attempts, "errors": errors, **extra}

    def claim(self, unit: str, *, special: bool = False) -> tuple[Claim | None, dict[str, Any] | None]:
        """Try to take ``unit``: (the claim, None) when this worker now holds it, else (None, the
        record that stands: done, failed, or held by a live worker). ``special``: a step of the
        run rather than a slide (``_create``, ``_commit``), named apart from every bag id."""
        key = self._name(unit, special)
        record = self._record(unit, WORKING, 1, [], **({"special": True} if special else {}))
        token = self.storage.put_if_absent(key, json.dumps(record).encode())
        if token is not None:
            return Claim(unit, token, record), None
        try:
            raw, seen = self.storage.read_versioned(key)
            current = json.loads(raw)
        except FileNotFoundError:  # deleted by a commit meanwhile: the split is done
            return None, {"state": DONE}
        mine = current.get("worker") == self.worker.name and current.get("state") == WORKING
        if mine:  # this worker's own claim, left by an attempt the storage cut short: go on with it
            again = {**current, "renewed": time.time()}
            token = self.storage.replace_if(key, json.dumps(again).encode(), seen)
            return (Claim(unit, token, again), None) if token is not None else (None, {"state": WORKING})
        # A step of the run (_commit, _create) is never failed for good: a split whose committer
        # died as often as max_attempts (once, for `featurestore commit`) could not be committed.
        # One recorded failed by an older version is taken over like an expired one.
        if not expired(current) and not (special and current.get("state") == FAILED):
            return None, current
        # The attempts made so far: a working record counts its own (its worker vanished mid-unit),
        # a released one those before it (fail() keeps the count, release() takes its own back).
        attempts = int(current.get("attempts", 0))
        errors = list(current.get("errors", []))
        if current.get("state") == WORKING:  # its worker vanished mid-unit: that was an attempt too
            errors.append(f"{current.get('worker')}: " + (f"its process {current.get('pid')} is gone" if gone(current)
                                                          else f"lease of {current.get('lease')} s ran out"))
        if attempts >= self.max_attempts and not special:
            failed = self._record(unit, FAILED, attempts, errors)
            self.storage.replace_if(key, json.dumps(failed).encode(), seen)
            return None, failed
        record = self._record(unit, WORKING, attempts + 1, errors, taken_from=current.get("worker"),
                              **({"special": True} if special else {}))
        token = self.storage.replace_if(key, json.dumps(record).encode(), seen)
        if token is None:  # another taker won
            return None, {"state": WORKING}
        return Claim(unit, token, record), None

    def _name(self, unit: str, special: bool) -> str:
        return special_key(self.split_key, unit) if special else _key(self.prefix, unit)

    def renew(self, claim: Claim) -> bool:
        """Extend the lease; False when the claim is no longer this worker's."""
        record = {**claim.record, "renewed": time.time()}
        key = self._name(claim.unit, claim.record.get("special", False))
        token = self.storage.replace_if(key, json.dumps(record).encode(), claim.token)
        if token is None:
            return False
        claim.token, claim.record = token, record
        return True

    def finish(self, claim: Claim, **extra: Any) -> bool:
        """The unit's bag is complete on storage: mark it done (``extra``: e.g. why it was skipped)."""
        return self._end(claim, DONE, **extra)

    def fail(self, claim: Claim, error: str) -> str | None:
        """This attempt failed: released for another try, or ``failed`` after ``max_attempts``;
        the state written (None: the claim was no longer this worker's)."""
        errors = [*claim.record.get("errors", []), f"{self.worker.name}: {error}"]
        state = FAILED if int(claim.record.get("attempts", 1)) >= self.max_attempts else RELEASED
        return state if self._end(claim, state, errors=errors) else None

    def release(self, claim: Claim, why: str) -> bool:
        """Give the unit back unfinished, at once and not counted as an attempt (its worker was
        stopped: SIGTERM, Ctrl-C; nothing is wrong with the unit). False: no longer this worker's."""
        attempts = max(0, int(claim.record.get("attempts", 1)) - 1)  # the next claim counts it again
        return self._end(claim, RELEASED, attempts=attempts, released=f"{self.worker.name}: {why}")

    def withdraw(self, claim: Claim) -> None:
        """Remove the claim's record: taken on a split committed meanwhile (a commit removes every
        claim), it must not stay behind there."""
        self.storage.delete_tree(self._name(claim.unit, claim.record.get("special", False)))

    def _end(self, claim: Claim, state: str, **extra: Any) -> bool:
        record = {**claim.record, "state": state, "renewed": time.time(), **extra}
        key = self._name(claim.unit, claim.record.get("special", False))
        token = self.storage.replace_if(key, json.dumps(record).encode(), claim.token)
        if token is not None:
            claim.token, claim.record = token, record
        return token is not None
