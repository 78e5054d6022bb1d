"""What ``--worker`` runs record and report (helpers: tests/test_workers.py): a slide that fails
k attempts is recorded failed and left out; ``featurestore status`` and the split's web page show
a split being written (slides done, claimed, failed, left; the time to finish), also one a plain
run left."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from test_bags_import import trident_dir
from test_extract import cli_env, run_cli
from test_workers import NAME, _import_cmd

from featurestore.core import claims
from featurestore.core.storage import LocalStorage


def test_failing_slide_recorded_failed_after_k_attempts(tmp_path: Path) -> None:
    source = tmp_path / "src"
    data = trident_dir(source, {"a": 30, "b": 30, "c": 30})
    # A file whose header reads but whose rows do not: garbage in one gzip chunk fails its inflate.
    bad = source / "b.h5"
    with h5py.File(bad, "w") as f:
        f.create_dataset("features", data=data["b"][0], chunks=(1, 16), compression="gzip")
        f["coords"] = data["b"][1]
    with h5py.File(bad, "r") as f:
        info = f["features"].id.get_chunk_info(15)
    raw = bytearray(bad.read_bytes())
    raw[info.byte_offset : info.byte_offset + info.size] = b"\xff" * info.size
    bad.write_bytes(bytes(raw))
    store = tmp_path / "store"
    proc = run_cli(*_import_cmd(source, str(store), None, "--worker", "--max-attempts", "2")[3:], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("slide 'b' failed") == 2, proc.stdout
    # The file's fix under --worker: re-create it (not a plain run's --resume, which --worker refuses).
    failed = [line for line in proc.stdout.splitlines() if "slide 'b' failed" in line]
    assert all("damaged file; re-create it)" in line and "--resume" not in line for line in failed), failed
    import featurestore

    meta = featurestore.open_store(str(store)).split_info(*NAME)
    assert meta.complete and [f["id"] for f in meta.extra["failed"]] == ["b"]
    assert meta.extra["failed"][0]["attempts"] == 2
    assert featurestore.open_store(str(store)).open_bags(*NAME).ids == ["a", "c"]
    np.testing.assert_equal(len(meta.extra["failed"][0]["errors"]), 2)
    # A late worker (an array task, a requeue) and a plain re-run find the split complete: its
    # failed slide is left out on purpose, not missing (they were refused as "two runs at once")
    for extra in (("--worker",), ()):
        again = run_cli(*_import_cmd(source, str(store), None, *extra)[3:], timeout=240)
        assert again.returncode == 0 and "lacks" not in again.stderr, again.stdout + again.stderr


def test_status_and_web_page_show_a_split_being_written(tmp_path: Path) -> None:
    """Two slides done by a worker that ran with --no-commit, one held by a worker that died (its
    lease not yet out), one failed: `featurestore status` and the split's web page say so."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from server import Settings, create_app

    source = tmp_path / "src"
    trident_dir(source, {"a": 5, "b": 6, "c": 7, "d": 8})
    store = tmp_path / "store"
    key = "/".join(NAME)
    storage = LocalStorage(str(store))
    # A worker elsewhere holds "c" (live lease), and "d" failed its attempts: the worker below does a and b.
    board = claims.ClaimBoard(storage, key, lease=600, max_attempts=1, worker=claims.WorkerId(host="node7", pid=42))
    held, _ = board.claim("c")
    failed, _ = board.claim("d")
    assert held is not None and failed is not None and board.fail(failed, "corrupt") == claims.FAILED
    proc = subprocess.Popen(_import_cmd(source, str(store), None, "--worker", "--no-commit"), env=cli_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    done = lambda: sum(r.get("state") == claims.DONE for r in claims.read_records(storage, key).values())  # noqa: E731
    while time.time() < deadline and done() < 2:
        time.sleep(0.1)
    proc.kill()  # it would wait for "c" to be done
    proc.wait()
    status = run_cli("status", str(store), *NAME)
    assert status.returncode == 0, status.stderr
    assert "slides done 2, claimed 1, failed 1, left 1 (of 4)" in status.stdout, status.stdout
    assert "claimed 'c' by node7 pid 42" in status.stdout and "failed: d" in status.stdout
    refused = run_cli("commit", str(store), *NAME)
    assert refused.returncode != 0 and "still claimed by live workers" in refused.stderr
    with TestClient(create_app(str(store), Settings())) as client:
        page = client.get("/ui/splits/" + key)
    assert page.status_code == 200
    assert "slides done 2, claimed 1, failed 1, left 1" in page.text and "node7" in page.text


def test_the_time_to_finish_counts_from_the_runs_first_claim(tmp_path: Path) -> None:
    """Three workers started together finish their first slides within milliseconds: the pace
    between the first and last slide done said 0 s to finish with 21 of 24 left."""
    from featurestore.core.claim_status import progress

    storage = LocalStorage(str(tmp_path))
    for i in range(3):
        board = claims.ClaimBoard(storage, "s", lease=120, max_attempts=3, worker=claims.WorkerId(pid=i + 1))
        held, _ = board.claim(f"slide{i}")
        assert held is not None and board.finish(held)
    start = min(r["claimed"] for r in claims.read_records(storage, "s").values())
    eta = progress(storage, "s", 24, now=start + 30.0)["eta_seconds"]  # 3 done in 30 s: 21 left take 210 s
    assert eta is not None and abs(eta - 210.0) < 1.0, eta


def test_status_of_a_split_a_plain_run_left_counts_what_is_on_storage(tmp_path: Path) -> None:
    """An interrupted plain import said "slides done 0 ... left 24; 0 worker(s) seen" with all 24
    bags on storage (status read claims only); a dense split got slides and workers too."""
    from featurestore import open_store

    store = open_store(str(tmp_path), mode="a")
    bags = store.create_bag_split("d", "e", "b", dim=4)
    for i in range(3):
        bags.add_bag(f"s{i}", np.ones((2, 4), np.float32))
    bags.close()
    dense = store.create_split("d", "e", "x", num_samples=8, sample_shape=(4,), dtype="float16", chunk_rows=2)
    dense.write(0, np.zeros((4, 4), np.float32))
    dense.close()
    got = run_cli("status", str(tmp_path), "d", "e", "b", env=cli_env())
    assert got.returncode == 0 and "writing; 3 bag(s) complete on storage; no --worker claims" in got.stdout, got
    got = run_cli("status", str(tmp_path), "d", "e", "x", env=cli_env())
    assert got.returncode == 0 and "writing; 2 of 4 chunks on storage (2 samples each)" in got.stdout, got
