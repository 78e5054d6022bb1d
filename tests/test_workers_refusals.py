"""What ``--worker`` runs refuse or give back, so that a split never looks complete with slides
missing: a store that takes no writes (the slide goes back, uncounted), a commit of an unfinished
cohort, a failed commit (its claim goes back), a worker listing another cohort than the split's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_bags_import import trident_dir
from test_extract import cli_env, run_cli
from test_workers import NAME, _import_cmd, _wsi_cmd

from featurestore import open_store
from featurestore.core import claim_status, claims
from featurestore.core.storage import LocalStorage
from featurestore.errors import StorageFull
from featurestore.extract.workers_share import ClaimShare, WorkerOptions

KEY = "/".join(NAME)

# ``python -c`` in place of ``-m featurestore.cli``: with $FS_FULL set, every chunk put of a
# writer session (under segments/, the claims apart) fails as a full disk does.
_FULL_DISK = """
import errno, os, sys
from featurestore.core.storage import LocalStorage
write = LocalStorage.write_sealed
def full(self, key, payload):
    if os.environ.get("FS_FULL") and "/segments/" in key and "/.claims/" not in key:
        raise OSError(errno.ENOSPC, "No space left on device")
    return write(self, key, payload)
LocalStorage.write_sealed = full
from featurestore.cli import main
sys.exit(main())
"""


def _segments(store: Path) -> list[str]:
    folder = store.joinpath(*NAME, "segments")
    return sorted(p.name for p in folder.iterdir() if p.name != ".claims") if folder.exists() else []


def test_a_full_store_gives_the_slide_back_uncounted_and_stops(tmp_path: Path) -> None:
    """A full disk is no slide's fault: before, each slide was failed three times in seconds and
    recorded ``failed`` for good, leaving a segment per attempt on the full disk."""
    source, store = tmp_path / "src", tmp_path / "store"
    trident_dir(source, {"a": 5, "b": 6, "c": 7})
    cmd = _import_cmd(source, str(store), None, "--worker", "--max-attempts", "3")
    full = subprocess.run([cmd[0], "-c", _FULL_DISK, *cmd[3:]], env={**cli_env(), "FS_FULL": "1"},
                          capture_output=True, text=True, timeout=240)
    assert full.returncode == 1, full.stdout + full.stderr
    line = full.stderr.strip().splitlines()[-1]
    assert "no space left" in line and "given back (not counted as an attempt)" in line and "free space" in line, line
    records = claims.read_records(LocalStorage(str(store)), KEY)
    assert [r["state"] for r in records.values()] == [claims.RELEASED], records
    assert next(iter(records.values()))["attempts"] == 0
    assert _segments(store) == []  # the attempt's partial segment went with it
    done = run_cli(*cmd[3:], timeout=240)  # space freed: the next worker does every slide
    assert done.returncode == 0, done.stdout + done.stderr
    meta = open_store(str(store)).split_metadata(*NAME)
    assert meta["status"] == "complete" and meta["bags"]["count"] == 3 and "failed" not in meta


def test_commit_refuses_an_unfinished_cohort_and_a_second_commit_is_a_no_op(tmp_path: Path) -> None:
    """`featurestore commit` committed whatever bags were done as the complete split (a stopped
    worker's slide given back, another never started): now it names what is left."""
    source, store = tmp_path / "src", tmp_path / "store"
    trident_dir(source, {"a": 5, "b": 6, "c": 7, "d": 8})
    storage = LocalStorage(str(store))
    elsewhere = claims.ClaimBoard(storage, KEY, lease=600, max_attempts=3, worker=claims.WorkerId(host="node7", pid=42))
    held = {unit: elsewhere.claim(unit)[0] for unit in ("c", "d")}  # live elsewhere: the worker below does a, b
    proc = subprocess.Popen(_import_cmd(source, str(store), None, "--worker", "--no-commit"), env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and sum(r.get("state") == claims.DONE
                                         for r in claims.read_records(storage, KEY).values()) < 2:
        time.sleep(0.1)
    proc.kill()  # it would wait for c and d
    proc.wait()
    claim = held["c"]
    assert claim is not None and elsewhere.release(claim, "stopped by SIGTERM")  # c given back; d still held
    refused = run_cli("commit", str(store), *NAME)
    assert refused.returncode == 1 and "still claimed by live workers" in refused.stderr, refused.stderr
    claim = held["d"]
    assert claim is not None and elsewhere.release(claim, "stopped by SIGTERM")
    refused = run_cli("commit", str(store), *NAME)
    assert refused.returncode == 1, refused.stdout
    assert ("2 of 4 slides are not done yet (2 given back by stopped workers, e.g. 'c'): start --worker processes"
            in refused.stderr), refused.stderr
    assert open_store(str(store)).split_info(*NAME).status == "writing"
    finish = run_cli(*_import_cmd(source, str(store), None, "--worker")[3:], timeout=240)
    assert finish.returncode == 0, finish.stdout + finish.stderr
    again = run_cli("commit", str(store), *NAME)  # a pipeline's commit step after the last worker committed
    assert again.returncode == 0 and "is already complete (4 bags): nothing to commit" in again.stdout, again.stderr
    typo = run_cli("commit", str(tmp_path / "no-store"), *NAME)
    assert typo.returncode == 1 and not (tmp_path / "no-store").exists()  # never made at a mistyped path


def test_a_failed_commit_gives_its_claim_back_and_status_shows_the_committer(tmp_path: Path) -> None:
    """A worker whose commit fails (a full disk, an outage past its patience) used to keep the
    `_commit` claim for its lease, and the workers after it exited without committing; status
    showed nothing of it."""
    storage = LocalStorage(str(tmp_path))

    class Job:  # what ClaimShare.commit asks of a job, its commit failing
        key = KEY
        store = SimpleNamespace(storage=storage)

        def split_key(self) -> str:
            return KEY

        def split_complete(self) -> bool:
            return False

        def attach(self) -> Any:
            return SimpleNamespace(close=lambda: None, done_ids=set())

        def commit(self, writer: Any, progress: list[Any]) -> dict[str, Any]:
            assert claim_status.progress(storage, KEY, None)["committing"]["expired"] is False
            raise StorageFull("no space left on the device of store X while writing the index")

    share = ClaimShare(WorkerOptions(lease_seconds=600))
    with pytest.raises(StorageFull):
        share.commit(Job(), SimpleNamespace(), [])
    record = json.loads(storage.read(claims.special_key(KEY, "_commit")))
    assert record["state"] == claims.RELEASED and claim_status.progress(storage, KEY, None)["committing"] is None
    other = claims.ClaimBoard(storage, KEY, lease=600, max_attempts=1, worker=claims.WorkerId(host="node7", pid=42))
    assert other.claim("_commit", special=True)[0] is not None  # the next committer takes it at once
    assert claim_status.progress(storage, KEY, None)["committing"]["host"] == "node7"


def test_a_worker_listing_another_cohort_is_refused(tmp_path: Path) -> None:
    """Two workers with two slide lists on one split raced at the commit, and a complete split
    re-run with a new slide reported it complete: a split is one cohort."""
    pytest.importorskip("openslide")
    from featurestore.demo.slides import write_cohort

    cohort, store = tmp_path / "cohort", tmp_path / "store"
    write_cohort(cohort, 2, width=768, height=512, mpp=0.5)
    env = cli_env(FSW_CALLS=str(tmp_path / "calls.txt"))
    first = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker", "--no-commit")[3:], env=env, timeout=240)
    assert first.returncode == 0, first.stdout + first.stderr
    shutil.copy(cohort / "slide-001.tiff", cohort / "slide-002.tiff")
    more = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker")[3:], env=env, timeout=240)
    assert more.returncode == 1, more.stdout + more.stderr
    assert ("was started on 2 slides and this run lists 3 (other slide ids): every run of a split, each --worker "
            "too, takes the same slide list" in more.stderr), more.stderr
    assert "`featurestore rm` this split, then start the workers" in more.stderr and "overwrite" not in more.stderr
    (cohort / "slide-002.tiff").unlink()
    (cohort / "slide-001.tiff").unlink()  # fewer slides: one of the split's bags is not listed
    fewer = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker")[3:], env=env, timeout=240)
    assert fewer.returncode == 1 and "its bag 'slide-001' is not in this list" in fewer.stderr, fewer.stderr
    assert open_store(str(store)).split_info(*NAME).status == "writing"


def test_the_committing_worker_reports_every_workers_skipped_slides(tmp_path: Path) -> None:
    """The worker that commits exits 3 for a slide another worker skipped, and names it (it printed
    its own count, 0, and exited 0)."""
    pytest.importorskip("openslide")
    from featurestore.demo.slides import write_cohort

    cohort, store = tmp_path / "cohort", tmp_path / "store"
    write_cohort(cohort, 2, width=768, height=512, mpp=0.5)
    (cohort / "junk.svs").write_text("not a slide")
    env = cli_env(FSW_CALLS=str(tmp_path / "calls.txt"))
    first = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker", "--no-commit")[3:], env=env, timeout=240)
    assert first.returncode == 0, first.stdout + first.stderr
    last = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker")[3:], env=env, timeout=240)
    assert last.returncode == 3, last.stdout + last.stderr
    assert "skipped slide junk: " in last.stderr and "0 bags of 3 slides" in last.stdout, last.stdout + last.stderr
    assert ", 1 skipped; split: 2 bags" in last.stdout, last.stdout
    info = run_cli("info", str(store), *NAME, env=env)
    assert "skipped slides: 1: junk" in info.stdout, info.stdout


def test_a_worker_with_other_options_is_told_the_workers_fix(tmp_path: Path) -> None:
    """A worker started with another option than the split's: refused, with a worker's fix (the
    writer's own, --overwrite, is refused with --worker and would redo the split under the others)."""
    source, store = tmp_path / "src", tmp_path / "store"
    trident_dir(source, {"a": 5, "b": 6})
    first = run_cli(*_import_cmd(source, str(store), None, "--worker", "--no-commit", "--dtype", "float16")[3:])
    assert first.returncode == 0, first.stderr
    other = run_cli(*_import_cmd(source, str(store), None, "--worker", "--dtype", "float32")[3:])
    assert other.returncode == 1 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert "every worker of a split runs with the same options" in other.stderr, other.stderr
    assert "overwrite" not in other.stderr, other.stderr


def test_a_worker_import_of_a_source_that_does_not_exist_says_so(tmp_path: Path) -> None:
    # It said the path "is not a directory of per-slide files: import it without --worker".
    done = run_cli(*_import_cmd(tmp_path / "nowhere", str(tmp_path / "store"), None, "--worker")[3:])
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"source '{tmp_path / 'nowhere'}' does not exist: give the directory of per-slide" in done.stderr, done.stderr
    assert not (tmp_path / "store").exists()


def test_a_local_store_that_cannot_be_written_is_told_a_local_fix(tmp_path: Path) -> None:
    """A local path's failure names the path's fix, not an S3 endpoint's and credentials'."""
    source = tmp_path / "src"
    trident_dir(source, {"a": 5})
    (tmp_path / "afile").write_text("")
    done = run_cli(*_import_cmd(source, str(tmp_path / "afile" / "store"), None, "--worker")[3:])
    assert done.returncode == 1 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "is, or is under, a file: a store is a directory" in done.stderr, done.stderr
    if not os.path.isdir("/sys/kernel"):
        return
    sysfs = run_cli(*_import_cmd(source, "/sys/featurestore-test-store", None, "--worker")[3:])  # not writable
    assert sysfs.returncode == 1 and len(sysfs.stderr.strip().splitlines()) == 1, sysfs.stderr
    assert "that this user may write there" in sysfs.stderr, sysfs.stderr
    for text in (done.stderr, sysfs.stderr):
        assert "credentials" not in text and "--storage-options" not in text, text


def test_a_vanished_worker_counts_one_attempt(tmp_path: Path) -> None:
    """A worker that dies mid-slide has made one attempt: the taker's is the second (it was counted
    twice, so with --max-attempts 2 one SIGKILL failed the slide)."""
    storage = LocalStorage(str(tmp_path))
    boards = [claims.ClaimBoard(storage, "s", lease=0.2, max_attempts=2, worker=claims.WorkerId(pid=p))
              for p in (1, 2, 3)]
    first, _ = boards[0].claim("x")
    assert first is not None and first.record["attempts"] == 1
    time.sleep(0.3)  # its worker vanished: the lease runs out
    second, _ = boards[1].claim("x")
    assert second is not None and second.record["attempts"] == 2, second.record if second else None
    time.sleep(0.3)  # the second attempt's worker vanished too: two of two attempts made
    third, standing = boards[2].claim("x")
    assert third is None and standing is not None and standing["state"] == claims.FAILED
    assert standing["attempts"] == 2 and len(standing["errors"]) == 2, standing


class _PassJob:
    """What ClaimShare.work asks of a job, for a pass over slides ``a``, ``b``, ``c``: counts how
    often the split's document is read (``split_complete``), which ``complete`` answers."""

    key = KEY

    def __init__(self, storage: LocalStorage, complete: bool = False) -> None:
        self.store = SimpleNamespace(storage=storage)
        self.complete, self.asked, self.encoded = complete, 0, []

    def split_key(self) -> str:
        return KEY

    def units(self, writer: Any) -> list[tuple[int, str]]:
        return list(enumerate("abc"))

    def unit_id(self, unit: str) -> str:
        return unit

    def split_complete(self) -> bool:
        self.asked += 1
        return self.complete

    def merge(self, parts: list[Any]) -> dict[str, Any]:
        return {"parts": parts}


def test_a_pass_over_slides_others_hold_reads_no_split_document(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker asked whether the split was committed before every slide it visited: on an object
    store a GET per slide, beside the claim's own requests, at every pass over slides the other
    workers hold. It asks only of a claim it took."""
    import threading

    from featurestore.extract import workers_share

    storage = LocalStorage(str(tmp_path))
    other = claims.ClaimBoard(storage, KEY, lease=600, max_attempts=3, worker=claims.WorkerId(host="node7", pid=42))
    held = [other.claim(u)[0] for u in "abc"]
    monkeypatch.setattr(workers_share, "idle_wait", lambda idle, lease: 0.05)
    job = _PassJob(storage)
    ends = threading.Timer(0.5, lambda: [other.finish(claim) for claim in held])  # the other worker is done
    ends.start()
    try:
        got = ClaimShare(WorkerOptions(lease_seconds=600)).work(job, SimpleNamespace(done_ids=set()))
    finally:
        ends.cancel()
    assert got == {"parts": []} and job.asked == 0, job.asked


def test_a_claim_taken_on_a_split_committed_meanwhile_is_withdrawn(tmp_path: Path) -> None:
    """The last worker's commit removes every claim; a worker still passing over the slides then
    takes a claim afresh, finds the split complete, removes that claim and stops: no slide is
    redone, and no claim is left in the complete split."""
    storage = LocalStorage(str(tmp_path))
    job = _PassJob(storage, complete=True)
    share = ClaimShare(WorkerOptions(lease_seconds=600))
    share._one = lambda *a: pytest.fail("a slide of a complete split was worked on")  # type: ignore[method-assign]
    assert share.work(job, SimpleNamespace(done_ids=set())) == {"parts": []}
    assert job.asked == 1 and claims.read_records(storage, KEY) == {}
