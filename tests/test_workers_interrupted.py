"""``--worker`` runs interrupted for real (tests/test_workers.py has the claim primitive and the
helpers): imports whose worker is SIGKILLed holding a claim, or that meet a SeaweedFS restart
mid-run, or whose worker is stopped by SIGTERM/SIGINT (its slide given back, uncounted); and a
signal inside a claim write, deferred until the write is whole."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from _seaweed_restart import restartable_seaweed
from test_extract import cli_env, run_cli
from test_workers import (_SLOW_SLIDES, NAME, _assert_same_split, _import_cmd, _source_and_reference, _start,
                          _storage, _wait)

from featurestore.core import claims
from featurestore.core.storage import LocalStorage


def _kill_holding_a_claim(worker: subprocess.Popen[bytes], storage: Any, key: str, timeout: float = 120) -> str:
    """SIGKILL ``worker`` while it holds a slide's claim; return that slide. The worker is frozen
    (SIGSTOP) first and its claim read back while it cannot move: a claim seen a moment earlier
    may be finished by the time a kill lands. Fails when the run ends before such a moment."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert worker.poll() is None, "the worker ended before it could be killed holding a claim"
        records = claims.read_records(storage, key) if storage.size(f"{key}/zarr.json") else {}
        if any(r.get("pid") == worker.pid and r.get("state") == claims.WORKING for r in records.values()):
            worker.send_signal(signal.SIGSTOP)
            held = [unit for unit, r in claims.read_records(storage, key).items()
                    if r.get("pid") == worker.pid and r.get("state") == claims.WORKING]
            if held:
                worker.send_signal(signal.SIGKILL)
                worker.wait()
                return held[0]
            worker.send_signal(signal.SIGCONT)  # it finished that slide meanwhile: look again
        time.sleep(0.02)
    raise AssertionError(f"the worker held no claim within {timeout} s")


def test_import_workers_killed_and_late_match_one_process(tmp_path: Path, seaweed: Any, seaweed_url: str) -> None:
    source = _source_and_reference(tmp_path, {f"s{i:02d}": 20 + 7 * i for i in range(24)})
    options = dict(seaweed.storage_options)
    env = cli_env()
    cmd = _import_cmd(source, seaweed_url, options, "--worker", "--lease-seconds", "3")
    w1 = _start(cmd, env, tmp_path / "w1.log")
    w2 = _start(cmd, env, tmp_path / "w2.log")
    storage = _storage(seaweed_url, options)
    key = "/".join(NAME)
    held = _kill_holding_a_claim(w1, storage, key)  # its slide's claim outlives it, for its lease
    w3 = _start(cmd, env, tmp_path / "w3.log")  # started late
    outs = [_wait(w2, tmp_path / "w2.log"), _wait(w3, tmp_path / "w3.log")]
    assert sum("imported ds/enc/train: 24 bags" in o for o in outs) == 1, outs  # exactly one commit
    _assert_same_split(storage, LocalStorage(str(tmp_path / "single")), key)
    # Each worker's log has a line per slide it did: together, every slide once (the killed
    # worker's slide by whoever took it over; only a bag it completed just before the kill is in
    # no log, its taker finding it complete).
    done = re.findall(r"featurestore worker \S+: slide '(s\d\d)' done \(",
                      (tmp_path / "w1.log").read_text() + "".join(outs))
    assert len(done) == len(set(done)) and set(done) >= {f"s{i:02d}" for i in range(24)} - {held}, done


def test_object_server_restarted_mid_run_workers_retry_and_finish(tmp_path: Path) -> None:
    """SeaweedFS stopped (SIGTERM) while two workers import, started again on the same ports and
    directory a few seconds later: the workers wait it out and the split is whole."""
    from featurestore.testing import stop_process

    source = _source_and_reference(tmp_path, {f"s{i:02d}": 20 + i for i in range(16)})
    with restartable_seaweed(tmp_path) as (server, restart):
        server.create_bucket("fsw-restart")
        url, options = "s3://fsw-restart/store", dict(server.storage_options)
        storage = _storage(url, options)
        key = "/".join(NAME)
        # two workers with short leases; the server goes while they are mid-run
        cmd = _import_cmd(source, url, options, "--worker", "--lease-seconds", "6", "--debug")
        # Each slide takes 0.5 s, as a real one takes seconds: a worker that started first cannot
        # import all 16 before the other has claimed one, however slow the machine starts either.
        cmd[1:3] = ["-c", _SLOW_SLIDES]
        workers = [_start(cmd, cli_env(), tmp_path / f"w{i}.log") for i in range(2)]
        # Stopped once a slide is done and both workers hold claims: both are mid-run (a worker
        # still starting meets the outage at its first open of the store: tests/test_workers_outage.py).
        deadline = time.time() + 120
        while time.time() < deadline:
            records = claims.read_records(storage, key) if storage.size(f"{key}/zarr.json") else {}
            if (any(r.get("state") == claims.DONE for r in records.values())
                    and {w.pid for w in workers} <= {r.get("pid") for r in records.values()}):
                break
            assert all(w.poll() is None for w in workers), "a worker ended before the server was stopped"
            time.sleep(0.05)
        else:
            raise AssertionError("the two workers were not both mid-run within 120 s")
        stop_process(server.process, grace=5)
        time.sleep(3)
        restart()
        outs = [_wait(w, tmp_path / f"w{i}.log", 300) for i, w in enumerate(workers)]
        assert sum("imported ds/enc/train: 16 bags" in o for o in outs) == 1, outs
        assert any("storage unavailable" in o for o in outs), outs  # the outage was met, and waited out
        _assert_same_split(storage, LocalStorage(str(tmp_path / "single")), key)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_worker_gives_its_slide_back_at_once_uncounted(tmp_path: Path, signum: int) -> None:
    """A spot instance reclaimed, a preempted job, a pod's end: SIGTERM (or Ctrl-C) mid-slide. The
    worker gives the slide back (not counted as an attempt) and exits 128 + the signal; the next
    worker takes it at once, not after the 600 s lease, and the split is the one-process import's."""
    source = _source_and_reference(tmp_path, {f"s{i}": 10 + i for i in range(4)})
    store, key = tmp_path / "store", "/".join(NAME)
    cmd = _import_cmd(source, str(store), None, "--worker", "--lease-seconds", "600")
    slow = [*cmd[:1], "-c", _SLOW_SLIDES, *cmd[3:]]
    worker = _start(slow, {**cli_env(), "FS_SLIDE_SECONDS": "60"}, tmp_path / "stopped.log")
    deadline = time.time() + 120
    while time.time() < deadline and not any(
            r.get("pid") == worker.pid and r.get("state") == claims.WORKING
            for r in claims.read_records(LocalStorage(str(store)), key).values()):
        assert worker.poll() is None, (tmp_path / "stopped.log").read_text()
        time.sleep(0.1)
    worker.send_signal(signum)
    assert worker.wait(timeout=30) == 128 + signum
    log = (tmp_path / "stopped.log").read_text()
    assert f"stopped by {signal.Signals(signum).name}; slide 's0' given back" in log, log
    assert log.count("stopped by") == 1, log  # one line: the command line adds none of its own
    record = claims.read_records(LocalStorage(str(store)), key)["s0"]
    assert record["state"] == claims.RELEASED and record["attempts"] == 0, record
    status = run_cli("status", str(store), *NAME, timeout=60)
    assert "given back by stopped workers, for the next worker: s0" in status.stdout, status.stdout
    done = subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "imported ds/enc/train: 4 bags" in done.stdout, done.stdout + done.stderr
    _assert_same_split(LocalStorage(str(store)), LocalStorage(str(tmp_path / "single")), key)


def test_a_signal_inside_a_claim_write_is_raised_when_the_write_is_over() -> None:
    """A claim record's write is never cut in two: a SIGTERM inside ``deferred()`` is noted and
    raised once the block ends, once; the previous handlers come back."""
    from featurestore.errors import Stopped
    from featurestore.extract.worker_stop import StopOnSignal

    before = signal.getsignal(signal.SIGTERM)
    steps: list[str] = []
    with pytest.raises(Stopped) as stopped:
        with StopOnSignal() as stop:
            with stop.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler has run by now: noted only
                steps.append("write whole")
            steps.append("not reached")
    assert steps == ["write whole"] and stopped.value.signum == signal.SIGTERM and stop.received == signal.SIGTERM
    stop.check()  # raised once: the clean-up after it runs undisturbed
    assert signal.getsignal(signal.SIGTERM) is before

