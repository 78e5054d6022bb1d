"""``--worker``: independent processes share a bag split's slides by claims (featurestore.core.claims).

The run is :func:`featurestore.extract.dist_run.run_split`'s, with a :class:`ClaimShare` in the
place of torchrun's fixed partition. Every worker is rank 0 of its own one-process run:

1. **open**: probe that the storage enforces create-if-absent (else one line, never a race), then
   create the split or attach to it (``resume``): the first creator holds a ``_create`` claim so
   two workers starting together do not both create it; a different cache key is refused by the
   writer as for any resume;
2. **work**: walk the pending slides; claim one (``put_if_absent``), encode it, add its bag through
   a writer session of its own and close it (the bag is complete on storage), mark the claim
   done; a thread renews the lease every third of it. The bag is only added while the claim
   still renews: a worker stopped past its lease (SIGSTOP, a paused VM) whose slide was taken
   over adds nothing. A slide that raises is released for another attempt, and after
   ``max_attempts`` recorded as failed. Slides held by live workers are revisited until every
   slide is done or failed. SIGTERM or SIGINT (a preemption, a pod's end) gives the slide held
   back at once, uncounted (featurestore.extract.worker_stop);
3. **commit**: the worker that wins the ``_commit`` claim commits, listing the failed slides in
   the split's metadata; the others return. ``--no-commit`` leaves it to
   ``featurestore commit``.
"""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from featurestore.core import claims
from featurestore.errors import (CacheKeyMismatch, FeatureStoreError, InvalidOption, ReadOnlyStore, ShapeMismatch,
                                 SplitSettingsMismatch, StorageAccessDenied, StorageFull, StorageUnavailable, Stopped,
                                 StoreUnreachable)
from featurestore.extract.worker_stop import StopOnSignal

__all__ = ["ClaimLost", "ClaimShare", "WorkerOptions", "commit_extra"]


@dataclass
class WorkerOptions:
    lease_seconds: float = 120.0
    max_attempts: int = 3
    commit: bool = True

    def check(self) -> None:
        if not self.lease_seconds >= 1:
            raise InvalidOption(f"--lease-seconds must be at least 1, but got: {self.lease_seconds}")
        if self.max_attempts < 1:
            raise InvalidOption(f"--max-attempts must be a positive integer, but got: {self.max_attempts}")


class ClaimLost(FeatureStoreError, RuntimeError):
    """This worker's claim on a slide was taken over (its lease ran out): its bag is not added."""


class _Renewer:
    """Renews a claim every third of its lease on a thread, until stopped or the claim is lost."""

    def __init__(self, board: claims.ClaimBoard, claim: claims.Claim) -> None:
        self.board, self.claim = board, claim
        self.lock = threading.Lock()  # one conditional write of this claim at a time
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="featurestore-lease", daemon=True)

    def __enter__(self) -> _Renewer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def renew(self) -> bool:
        with self.lock:
            if not self.lost:
                try:
                    self.lost = not self.board.renew(self.claim)
                except Exception:  # noqa: BLE001 - a server away for a moment: the next renew retries
                    return False
            return not self.lost

    def _run(self) -> None:
        while not self._stop.wait(self.board.lease / 3) and not self.lost:
            self.renew()


class _Guarded:
    """A writer session that adds a bag only while this worker still holds the slide's claim."""

    def __init__(self, writer: Any, renewer: _Renewer) -> None:
        self._writer, self._renewer = writer, renewer

    def add_bag(self, bag_id: str, *args: Any, **kwargs: Any) -> None:
        if not self._renewer.renew():
            raise ClaimLost(f"bag {bag_id!r}: this worker's claim was taken over (its lease ran out): not added")
        self._writer.add_bag(bag_id, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def commit_extra(storage: Any, split_key: str) -> dict[str, Any]:
    """What the claims tell a commit: ``failed`` (the slides recorded as failed, with their
    errors; only when there are some) and ``skipped`` (every worker's skipped slides, by id)."""
    records = claims.read_records(storage, split_key)
    failed = [{"id": unit, "attempts": r.get("attempts"), "errors": r.get("errors", [])}
              for unit, r in sorted(records.items()) if r.get("state") == claims.FAILED]
    skipped = [r["skipped"] for _, r in sorted(records.items()) if r.get("state") == claims.DONE and r.get("skipped")]
    return {"skipped": skipped, **({"failed": failed} if failed else {})}


_SETTINGS = (CacheKeyMismatch, ShapeMismatch, SplitSettingsMismatch)
_OVERWRITE_ADVICE = re.compile(r"[.;:]\s*(?:[Uu]se overwrite=True|run with the split's own).*$", re.S)
_RETRY = object()
_OUTAGES = (StorageUnavailable, StoreUnreachable)
# The store refuses every write (full, read-only, access denied): no slide's fault, so none is
# failed for it; the worker gives its slide back and stops with the store's error.
_STORE_REFUSES = (StorageFull, StorageAccessDenied, ReadOnlyStore)


def idle_wait(idle: int, lease: float) -> float:
    """Seconds before a worker whose slides left are all held by others looks again, after
    ``idle`` passes in a row that took none: 2 s, growing by half each pass up to a third of the
    lease (its worst wait for a slide given back; one whose worker died frees at lease end), with
    jitter. A fixed 2 s had every idle worker ask for every held slide's claim every 2 s: at the
    end of a run of W workers, some W * W * 3 requests each time."""
    return min(2.0 * 1.5 ** max(0, idle - 1), max(lease / 3, 0.05)) * random.uniform(0.75, 1.0)


def _store_refused(error: FeatureStoreError, uid: str) -> FeatureStoreError:
    """The store's error, its fix as a worker's: the slide went back, and workers go on from the
    bags done once the store takes writes again (a resume is what every worker does)."""
    what = str(error).split(": free space")[0].splitlines()[0]
    fix = "free space" if isinstance(error, StorageFull) else "make the store writable for this worker"
    out = type(error)(f"{what}: slide {uid!r} given back (not counted as an attempt); {fix}, then start workers "
                      "again: they go on from the bags already done")
    out.__cause__ = error
    return out


class _Outage:
    """How long the storage has been away: a worker waits out an outage (a server restart, a
    network cut) for ``patience`` seconds, then gives up with the storage's error."""

    def __init__(self, lease: float) -> None:
        self.patience = max(300.0, 3 * lease)
        self.since: float | None = None

    def wait(self, error: BaseException, pause: float) -> None:
        now = time.time()
        self.since = self.since or now
        if now - self.since > self.patience:
            raise error
        print(f"featurestore worker: storage unavailable ({str(error).splitlines()[0]}); retrying", flush=True)
        time.sleep(pause)

    def over(self) -> None:
        self.since = None


class ClaimShare:
    """The hooks :func:`~featurestore.extract.dist_run.run_split` calls in ``--worker`` mode."""

    def __init__(self, options: WorkerOptions) -> None:
        options.check()
        self.options = options
        self.board: claims.ClaimBoard | None = None
        self.committed = False
        self.cohort: set[str] = set()  # every slide of the run (bag ids)

    def prepare(self, job: Any) -> None:
        """Load the job, then open its store, waiting out an outage there as the rest of the run
        does: a worker (an array task, a spot instance) may start while the object store restarts."""
        job.load()
        outage = _Outage(self.options.lease_seconds)
        while True:
            try:
                return job.connect()
            except _OUTAGES as error:
                outage.wait(error, min(5.0, self.options.lease_seconds / 3))

    def select(self, units: Any) -> list[Any]:  # the UnitShare protocol: every unit is claimable
        return [unit for _, unit in units]

    def _board(self, job: Any) -> claims.ClaimBoard:
        if self.board is None:
            store = job.store
            self.board = claims.ClaimBoard(store.storage, job.split_key(), lease=self.options.lease_seconds,
                                           max_attempts=self.options.max_attempts)
        return self.board

    def open(self, job: Any) -> Any:
        job.opts.resume = True
        if job.opts.overwrite:
            raise InvalidOption("--worker resumes the split it shares with other workers: leave out --overwrite")
        board = self._board(job)
        outage = _Outage(board.lease)
        while True:
            try:
                return self._open(job, board)
            except _OUTAGES as error:
                outage.wait(error, min(5.0, board.lease / 3))

    def _open(self, job: Any, board: claims.ClaimBoard) -> Any:
        try:
            return self._open_shared(job, board)
        except _SETTINGS as error:  # the writer's fix is --overwrite, which --worker refuses
            what = _OVERWRITE_ADVICE.sub("", str(error))
            raise type(error)(f"{what}: every worker of a split runs with the same options; start this worker "
                              "with the split's own (the other workers' command line), or give it another "
                              "--split") from None

    def _open_shared(self, job: Any, board: claims.ClaimBoard) -> Any:
        claims.probe(job.store.storage, job.split_key())
        deadline = None
        while True:
            if job.split_exists():
                return job.open()
            claim, _ = board.claim("_create", special=True)
            if claim is not None:
                writer = job.open()
                board.finish(claim)
                return writer
            deadline = deadline or time.monotonic() + 2 * board.lease  # a wait: the clock a step cannot move
            if time.monotonic() > deadline:
                raise FeatureStoreError(f"split {job.key}: another worker claimed its creation "
                                        f"{2 * board.lease:.0f} s ago and it still does not exist")
            time.sleep(min(1.0, board.lease / 3))

    def work(self, job: Any, writer: Any) -> Any:
        board = self._board(job)
        pending = [unit for _, unit in job.units(writer)]
        self.cohort = set(writer.done_ids) | {job.unit_id(unit) for unit in pending}
        # One line per slide on stdout: a SLURM or pod log shows what each worker did, and when.
        me = f"featurestore worker {board.worker.host}/{board.worker.pid}"
        print(f"{me}: split {job.key}, {len(self.cohort)} slides, {len(writer.done_ids)} done before, "
              f"{len(pending)} to share", flush=True)
        parts: list[Any] = []
        outage = _Outage(board.lease)
        claim: claims.Claim | None = None  # the slide held, for a stop to give back
        with StopOnSignal() as stop:
            try:
                idle = 0  # passes in a row that took no slide
                while pending:
                    waiting: list[Any] = []
                    taken = len(parts)
                    for unit in pending:
                        try:
                            with stop.deferred():  # a claim is taken whole, or not at all
                                claim, standing = board.claim(job.unit_id(unit))
                            if claim is None:
                                if standing is not None and standing.get("state") == claims.WORKING:
                                    waiting.append(unit)
                                continue
                            # Committed meanwhile (by the last worker)? Its claims went with the
                            # segments, so this one was taken afresh and would redo a slide of a
                            # complete split. Asked of a claim taken, not of every slide visited: a
                            # pass over slides other workers hold reads no split document.
                            if job.split_complete():
                                board.withdraw(claim)
                                claim = None
                                return job.merge(parts)
                            started = time.monotonic()
                            part = self._one(job, writer, board, claim, unit, stop)
                            uid, claim = claim.unit, None  # ended: done, failed, released or lost
                            outage.over()
                            if part is not None and part is not _RETRY:
                                skipped = job.unit_record(part).get("skipped")  # a slide without tissue, say
                                what = f"skipped: {skipped.get('reason')}" if isinstance(skipped, dict) else "done"
                                print(f"{me}: slide {uid!r} {what} ({time.monotonic() - started:.1f} s; "
                                      f"{len(parts) + 1} by this worker)", flush=True)
                        except _OUTAGES as error:
                            # The server is away: not the slide's fault. The claim, if taken, is
                            # this worker's to take again (ClaimBoard.claim).
                            outage.wait(error, min(5.0, board.lease / 3))
                            waiting.append(unit)
                            continue
                        if part is _RETRY:
                            waiting.append(unit)  # released after a failed attempt: any worker may try again
                        elif part is not None:
                            parts.append(part)
                    pending = waiting
                    idle = 0 if len(parts) > taken else idle + 1
                    if pending:
                        time.sleep(idle_wait(idle, board.lease))
            except KeyboardInterrupt as stopped:  # SIGTERM or SIGINT (Stopped), or a Ctrl-C
                _give_back(board, claim, me, stopped)
                raise
        return job.merge(parts)

    def _one(self, job: Any, writer: Any, board: claims.ClaimBoard, claim: claims.Claim, unit: Any,
             stop: StopOnSignal) -> Any:
        """Encode and add one claimed slide; its progress (None: lost, failed or already complete)."""
        uid = claim.unit
        if claim.record.get("taken_from"):  # its worker may have died after the bag was complete
            fresh = job.attach()
            fresh.close()
            if uid in fresh.done_ids:
                board.finish(claim)
                return None
        session = writer.session()
        with _Renewer(board, claim) as renewer:
            guarded = _Guarded(session, renewer)
            try:
                part = job.work(guarded, [unit])
                job.close(session, 1)
            except ClaimLost:
                session.abandon()
                return None
            except _OUTAGES:
                raise
            except _STORE_REFUSES as error:
                session.abandon()
                with renewer.lock, stop.deferred(), contextlib.suppress(Exception):
                    board.release(claim, f"the store refused a write ({type(error).__name__})")
                raise _store_refused(error, uid) from None
            except Exception as error:  # noqa: BLE001 - one slide's failure is recorded, not fatal
                if stop.received is not None:  # the stop's doing (a DataLoader worker killed by the same SIGTERM)
                    raise Stopped(stop.received) from error
                session.abandon()  # its partial segment goes: nothing of it is, or will be, done
                # A damaged file's own fix, not a plain run's (--resume, which --worker refuses).
                line = f"{type(error).__name__}: {getattr(error, 'worker_text', error)}".splitlines()[0]
                with renewer.lock, stop.deferred():  # one conditional write of the claim at a time
                    state = board.fail(claim, line)
                print(f"featurestore worker: slide {uid!r} failed ({line}); "
                      f"{'recorded as failed' if state == claims.FAILED else 'released for another attempt'}",
                      flush=True)
                return _RETRY if state == claims.RELEASED else None
            with renewer.lock, stop.deferred():
                if renewer.lost or not board.finish(claim, **job.unit_record(part)):
                    return None
        return part

    def commit(self, job: Any, writer: Any, progress: list[Any]) -> dict[str, Any]:
        if not self.options.commit:
            writer.close()
            return {}
        board = self._board(job)
        outage = _Outage(board.lease)
        while True:  # a commit cut short is redone whole: it writes the same bytes again
            try:
                return self._commit(job, writer, board, progress)
            except _OUTAGES as error:
                outage.wait(error, min(5.0, board.lease / 3))

    def _commit(self, job: Any, writer: Any, board: claims.ClaimBoard, progress: list[Any]) -> dict[str, Any]:
        claim, _ = board.claim("_commit", special=True)
        # Another worker commits, or did: its commit removed the claims (the _commit one too) only
        # after marking the split complete, so a claim won then finds the split complete.
        if claim is None or job.split_complete():
            writer.close()
            return {}
        try:
            return self._commit_held(job, writer, board, claim, progress)
        except BaseException:
            # Given back at once: a worker started next (or `featurestore commit`) commits, rather
            # than waiting out this claim's lease.
            with contextlib.suppress(Exception):
                board.release(claim, "its commit failed")
            raise

    def _commit_held(self, job: Any, writer: Any, board: claims.ClaimBoard, claim: claims.Claim,
                     progress: list[Any]) -> dict[str, Any]:
        with _Renewer(board, claim):
            extra = commit_extra(job.store.storage, job.split_key())
            # Every slide's bag must be found complete (or the slide failed) before the commit lays
            # out what it finds: a store that lists too little (a server just restarted) would
            # otherwise give a split short of bags.
            fresh = job.attach()
            fresh.close()
            # Failed and skipped slides (a file that is not a slide, no tissue) have no bag by design.
            ended = {f["id"] for f in extra.get("failed", [])} | {s.get("id") for s in extra.get("skipped", [])}
            missing = sorted(self.cohort - fresh.done_ids - ended)
            if missing:
                raise StorageUnavailable(f"split {job.key}: the bags of {len(missing)} done slide(s) are not found "
                                         f"on the store (first: {missing[0]!r}): it lists too little")
            metadata = job.commit(_WithExtra(writer, extra), progress)
        self.committed = True
        return metadata


def _give_back(board: claims.ClaimBoard, claim: claims.Claim | None, me: str, stopped: KeyboardInterrupt) -> None:
    """A stopped worker's slide, if it holds one, given back uncounted (ClaimBoard.release)."""
    name = stopped.name if isinstance(stopped, Stopped) else "SIGINT"
    held = claim is not None and claim.record.get("state") == claims.WORKING
    given = False
    if held:
        assert claim is not None
        with contextlib.suppress(Exception):  # a storage away: the lease runs out instead
            given = board.release(claim, f"stopped by {name}")
    what = (f"; slide {claim.unit!r} given back for another worker (not counted as an attempt)" if given
            else f"; slide {claim.unit!r} left to its lease" if held else "")  # type: ignore[union-attr]
    print(f"{me}: stopped by {name}{what}", flush=True)
    stopped.reported = True  # type: ignore[attr-defined]  # the command line prints no second line


class _WithExtra:
    """A writer whose commit adds ``extra`` (the failed slides) to the split's metadata."""

    def __init__(self, writer: Any, extra: dict[str, Any]) -> None:
        self._writer, self._extra = writer, extra

    def commit(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``extra`` as the job gives it, its ``skipped`` (one worker's) replaced by every worker's."""
        extra = dict(extra or {})
        if "skipped" in extra:
            extra["skipped"] = self._extra["skipped"]
        if "failed" in self._extra:
            extra["failed"] = self._extra["failed"]
        return self._writer.commit(extra=extra)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)
