"""A SeaweedFS server a test can stop and start again on the same ports and directory: an outage
of the object store that workers must wait out (tests/test_workers_interrupted.py,
tests/test_workers_outage.py)."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@contextlib.contextmanager
def restartable_seaweed(tmp_path: Path) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A SeaweedFS server (the test skipped where it cannot run) and ``restart()``: the stopped
    server started again on the same ports and directory, ready when it returns; stopped after."""
    pytest.importorskip("obstore")
    from featurestore.testing import stop_process
    from featurestore.testing.seaweedfs import SeaweedUnavailable, _ready, seaweed_server

    try:
        context = seaweed_server(str(tmp_path / "weed"))
        server = context.__enter__()
    except SeaweedUnavailable as exc:
        pytest.skip(f"SeaweedFS cannot run here: {exc}")
    again: list[subprocess.Popen[bytes]] = []

    def restart() -> None:
        with open(tmp_path / "weed-again.log", "wb") as log:
            again.append(subprocess.Popen(server.process.args, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL))
        deadline = time.time() + 60
        while not _ready(server.endpoint) and time.time() < deadline:
            time.sleep(0.2)

    try:
        yield server, restart
    finally:
        for process in again:
            stop_process(process, grace=5)
        context.__exit__(None, None, None)
