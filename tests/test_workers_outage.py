"""A ``--worker`` started while the object store is down waits the outage out, as it does mid-run
(tests/test_workers_interrupted.py), and finishes: array tasks and spot instances start whenever
they are scheduled, not when the store is up."""

from __future__ import annotations

import time
from pathlib import Path

from _seaweed_restart import restartable_seaweed
from test_extract import cli_env
from test_workers import NAME, _assert_same_split, _import_cmd, _source_and_reference, _start, _storage, _wait

from featurestore.core.storage import LocalStorage


def test_a_worker_started_during_an_outage_waits_for_the_store(tmp_path: Path) -> None:
    from featurestore.testing import stop_process

    source = _source_and_reference(tmp_path, {f"s{i:02d}": 20 + i for i in range(4)})
    with restartable_seaweed(tmp_path) as (server, restart):
        server.create_bucket("fsw-late")
        url, options = "s3://fsw-late/store", dict(server.storage_options)
        stop_process(server.process, grace=5)
        log = tmp_path / "worker.log"
        worker = _start(_import_cmd(source, url, options, "--worker", "--lease-seconds", "6"), cli_env(), log)
        deadline = time.time() + 180
        while "storage unavailable" not in log.read_text() and worker.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert worker.poll() is None and "storage unavailable" in log.read_text(), log.read_text()
        restart()
        out = _wait(worker, log, 300)
        assert "imported ds/enc/train: 4 bags" in out, out
        _assert_same_split(_storage(url, options), LocalStorage(str(tmp_path / "single")), "/".join(NAME))
