"""``--worker`` slide extraction (``extract --images wsi:...``) on a synthetic cohort, with an
encoder that logs every patch it encodes (tests/test_workers.py): workers SIGKILLed mid-slide or
SIGSTOPped past their lease encode no patch twice but the killed one's and add no second copy;
another encoder spec is refused; each worker logs the slides it did and why one was skipped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_extract import cli_env, run_cli
from test_workers import (CALLS, NAME, _assert_same_split, _bag_ids_in_segments, _calls, _start, _storage, _wait,
                          _wsi_cmd)

from featurestore.core.storage import LocalStorage


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("openslide")
    from featurestore.demo.slides import write_cohort

    root = tmp_path_factory.mktemp("fsw-cohort")
    write_cohort(root, 5, width=768, height=512, mpp=0.5)
    return root


def test_extract_workers_killed_mid_slide_and_late(tmp_path: Path, cohort: Path, seaweed: Any,
                                                   seaweed_url: str) -> None:
    options = dict(seaweed.storage_options)
    calls = tmp_path / "calls.txt"
    env = cli_env(**{CALLS: str(calls), "FSW_SLEEP": "1.5"})
    single = run_cli(*_wsi_cmd(cohort, str(tmp_path / "single"), None)[3:],
                     env=cli_env(**{CALLS: str(tmp_path / "single-calls.txt")}), timeout=300)
    assert single.returncode == 0, single.stdout + single.stderr
    patches = [d for _, ds in _calls(tmp_path / "single-calls.txt") for d in ds]
    assert len(patches) > 5
    cmd = _wsi_cmd(cohort, seaweed_url, options, "--worker", "--lease-seconds", "4")
    w1 = _start(cmd, env, tmp_path / "w1.log")
    w2 = _start(cmd, env, tmp_path / "w2.log")
    deadline = time.time() + 180
    while time.time() < deadline and not any(p == w1.pid for p, _ in _calls(calls)):
        time.sleep(0.05)
    w1.send_signal(signal.SIGKILL)  # mid-slide: its encoder call has begun and sleeps
    w1.wait()
    w3 = _start(cmd, env, tmp_path / "w3.log")
    outs = [_wait(w2, tmp_path / "w2.log", 300), _wait(w3, tmp_path / "w3.log", 300)]
    assert sum("extracted ds/enc/train" in o for o in outs) == 1, outs  # exactly one commit
    storage = _storage(seaweed_url, options)
    key = "/".join(NAME)
    _assert_same_split(storage, LocalStorage(str(tmp_path / "single")), key)
    made = _calls(calls)
    encoded = Counter(d for _, ds in made for d in ds)
    killed = [Counter(ds) for p, ds in made if p == w1.pid]
    assert len(killed) == 1  # (killed inside its first slide)
    # Every patch of the cohort encoded once (patches may repeat in a synthetic slide: counted as
    # many times as one process encodes them), but the killed worker's in-flight slide twice.
    assert not Counter(patches) - encoded
    assert not (encoded - Counter(patches)) - killed[0]


def test_sigstop_past_lease_adds_no_second_copy(tmp_path: Path, cohort: Path, seaweed: Any, seaweed_url: str) -> None:
    options = dict(seaweed.storage_options)
    calls = tmp_path / "calls.txt"
    env = cli_env(**{CALLS: str(calls), "FSW_SLEEP": "1"})
    cmd = _wsi_cmd(cohort, seaweed_url, options, "--worker", "--lease-seconds", "3", "--no-commit")
    w1 = _start(cmd, env, tmp_path / "w1.log")
    deadline = time.time() + 180
    while time.time() < deadline and not _calls(calls):
        assert w1.poll() is None, "the worker ended before its first encoder call"
        time.sleep(0.02)
    assert _calls(calls), "the worker made no encoder call within 180 s"
    w1.send_signal(signal.SIGSTOP)  # inside its first slide's encoder call
    time.sleep(4.5)  # past the lease
    w2 = _start(cmd, env, tmp_path / "w2.log")
    _wait(w2, tmp_path / "w2.log", 300)  # it takes the stopped worker's slide over and does them all
    w1.send_signal(signal.SIGCONT)
    _wait(w1, tmp_path / "w1.log", 120)
    storage = _storage(seaweed_url, options)
    key = "/".join(NAME)
    ids = _bag_ids_in_segments(storage, key)
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 5, ids
    status = subprocess.run([sys.executable, "-m", "featurestore.cli", "status", seaweed_url, *NAME,
                             "--storage-options", json.dumps(options)], env=env, capture_output=True, text=True)
    assert "slides done 5, claimed 0, failed 0, left 0 (of 5)" in status.stdout, status.stdout + status.stderr
    commit = subprocess.run([sys.executable, "-m", "featurestore.cli", "commit", seaweed_url, *NAME,
                             "--storage-options", json.dumps(options)], env=env, capture_output=True, text=True)
    assert commit.returncode == 0 and "committed ds/enc/train: 5 bags" in commit.stdout, commit.stderr


def test_other_encoder_spec_refused_in_one_line(tmp_path: Path, cohort: Path) -> None:
    store = tmp_path / "store"
    env = cli_env(**{CALLS: str(tmp_path / "calls.txt")})
    first = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker", "--no-commit", "--limit", "1")[3:], env=env,
                    timeout=300)
    assert first.returncode == 0, first.stderr
    other = run_cli(*_wsi_cmd(cohort, str(store), None, "--worker", "--limit", "1",
                              encoder="python:test_workers:other_vit")[3:], env=env, timeout=300)
    assert other.returncode != 0
    lines = other.stderr.strip().splitlines()
    assert len(lines) == 1 and "cache key" in lines[0].lower(), other.stderr


def test_a_worker_logs_each_slide_it_did_and_why_one_was_skipped(tmp_path: Path) -> None:
    """One worker on a local store: its log has the attach line, a line per slide, and for a file
    that is not a slide, that it was skipped and why (the run then exits 3, as without --worker)."""
    pytest.importorskip("openslide")
    from featurestore.demo.slides import write_cohort

    cohort = tmp_path / "cohort"
    write_cohort(cohort, 2, width=768, height=512, mpp=0.5)
    (cohort / "junk.svs").write_text("not a slide")
    done = run_cli(*_wsi_cmd(cohort, str(tmp_path / "store"), None, "--worker")[3:],
                   env=cli_env(**{CALLS: str(tmp_path / "calls.txt")}), timeout=240)
    assert done.returncode == 3, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("featurestore worker ")]
    assert lines[0].endswith(f": split {'/'.join(NAME)}, 3 slides, 0 done before, 3 to share"), lines
    slides = {line.split(": slide ")[1].split(" ")[0]: line.split(": slide ")[1] for line in lines[1:]}
    assert sorted(slides) == ["'junk'", "'slide-000'", "'slide-001'"], lines
    assert slides["'junk'"].startswith("'junk' skipped: ") and "is not a slide OpenSlide can read" in slides["'junk'"]
    assert slides["'slide-000'"].startswith("'slide-000' done (")
    # The skipped slide has no bag by design: the worker commits (it used to wait for that bag,
    # retrying as if the store listed too little, until its patience ran out)
    assert "storage unavailable" not in done.stdout and "extracted ds/enc/train: 2 bags of 3 slides" in done.stdout
    from featurestore import open_store

    assert [s["id"] for s in open_store(str(tmp_path / "store")).split_metadata(*NAME)["skipped"]] == ["junk"]
    status = run_cli("status", str(tmp_path / "store"), *NAME, env=cli_env())
    assert status.stdout.strip() == f"split {'/'.join(NAME)}: complete, 2 bags, 1 skipped: junk", status.stdout
    # A worker started on the complete split: nothing to do, the slide it left out named, and a way
    # to redo it that --worker takes (it refuses --overwrite)
    again = run_cli(*_wsi_cmd(cohort, str(tmp_path / "store"), None, "--worker")[3:],
                    env=cli_env(**{CALLS: str(tmp_path / "calls.txt")}), timeout=240)
    assert again.returncode == 0 and "nothing to do; 1 slide(s) skipped or failed are not in it" in again.stdout, (
        again.stdout + again.stderr)
    assert "retry them: junk (to redo it: featurestore rm " in again.stdout and "--overwrite" not in again.stdout
    assert "quantization:" not in again.stdout  # this run measured nothing
    # Before a commit (--no-commit), status counts the skipped slide among the done ones, and says so
    held = run_cli(*_wsi_cmd(cohort, str(tmp_path / "held"), None, "--worker", "--no-commit")[3:],
                   env=cli_env(**{CALLS: str(tmp_path / "calls.txt")}), timeout=240)
    assert held.returncode == 0, held.stdout + held.stderr
    status = run_cli("status", str(tmp_path / "held"), *NAME, env=cli_env())
    assert "slides done 3 (1 skipped), claimed 0, failed 0, left 0 (of 3)" in status.stdout, status.stdout
    assert "every slide is done: commit it with `featurestore commit " in status.stdout, status.stdout
    assert "estimated time to finish" not in status.stdout, status.stdout
    from fastapi.testclient import TestClient  # and the split's web page

    from server import Settings, create_app

    with TestClient(create_app(str(tmp_path / "held"), Settings())) as client:
        assert "slides done 3 (1 skipped), claimed 0" in client.get("/ui/splits/" + "/".join(NAME)).text
    commit = run_cli("commit", str(tmp_path / "held"), *NAME, env=cli_env())
    assert commit.stdout.strip() == f"committed {'/'.join(NAME)}: 2 bags, 1 skipped: junk", commit.stderr
