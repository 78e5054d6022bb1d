"""``featurestore embed`` as a process (helpers: tests/test_embed.py): a run SIGKILLed mid-way and
resumed is byte-identical to one uninterrupted, and two torchrun ranks write what one process does."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _core_helpers import comparable_chunk_file
from _dist_helpers import torchrun_cli
from test_embed import cli, cli_env, make_bags

import featurestore


def twin_stores(tmp_path: Path, names: tuple[str, str], bags: dict[str, tuple[int, Any, str]]) -> list[str]:
    """The same bags in two stores under tmp_path, and the `embed` arguments of the recorder encoder
    that each test runs on both (one store as the reference, the other as the run under test)."""
    for name in names:
        make_bags(tmp_path / name, bags=bags)
    return ["--dataset", "ds", "--encoder", "uni", "--split", "train", "--slide-encoder",
            "python:_embed_encoders:recorder", "--encoder-name", "rec", "--device", "cpu"]


def embed_midway(store: Path, args: list[str], rows: int) -> subprocess.Popen[str]:
    """``featurestore embed STORE ARGS`` (its encoder slowed to 0.3 s a slide) once it has written
    ``rows`` of its 10 rows' chunks, still running (for a test to stop it there)."""
    chunks = store / "ds" / "rec" / "train" / "features" / "c"
    process = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "embed", str(store), *args],
                               env=cli_env(FS_EMBED_SLEEP="0.3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if sum((chunks / str(i) / "0").is_file() for i in range(10)) >= rows:
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before it could be stopped"
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process


def test_sigkill_then_resume_is_byte_identical(tmp_path: Path) -> None:
    args = twin_stores(tmp_path, ("reference", "store"), {f"s-{i:02d}": (3 + i, i % 2, f"p{i // 2}") for i in range(10)})
    assert cli("embed", str(tmp_path / "reference"), *args).returncode == 0
    chunks = tmp_path / "store" / "ds" / "rec" / "train" / "features" / "c"
    process = embed_midway(tmp_path / "store", args, 3)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    kept = sum((chunks / str(i) / "0").is_file() for i in range(10))
    assert 3 <= kept < 10
    assert featurestore.open_store(str(tmp_path / "store")).split_status("ds", "rec", "train") == "writing"
    log = tmp_path / "calls.log"
    resumed = cli("embed", str(tmp_path / "store"), *args, "--resume", env=cli_env(FS_EMBED_LOG=str(log)))
    assert resumed.returncode == 0, resumed.stderr
    assert len(log.read_text().splitlines()) == 1 + 10 - kept  # the output-size call, then only missing rows

    def files(root: Path) -> dict[str, bytes]:
        split = root / "ds" / "rec" / "train"
        return {str(p.relative_to(split)): comparable_chunk_file(str(p.relative_to(split)), p.read_bytes())
                for p in sorted(split.rglob("*")) if p.is_file() and p.name != "zarr.json" and not p.name.endswith(".tmp")}

    assert files(tmp_path / "store") == files(tmp_path / "reference")
    assert cli("verify", str(tmp_path / "store")).returncode == 0


def test_torchrun_two_ranks_equal_one_process(tmp_path: Path) -> None:
    args = twin_stores(tmp_path, ("single", "multi"), {f"s-{i:02d}": (2 + i, i % 2, f"p{i // 3}") for i in range(7)})
    assert cli("embed", str(tmp_path / "single"), *args).returncode == 0
    log = tmp_path / "calls.log"
    process = torchrun_cli("embed", str(tmp_path / "multi"), *args, env=cli_env(FS_EMBED_LOG=str(log)))
    stdout = process.stdout
    assert process.returncode == 0, process.stderr[-3000:]
    assert stdout.count("ds/rec/train: 7 rows (7 computed by this run)") == 1  # rank 0 reports
    assert len(log.read_text().splitlines()) == 7 + 2  # every row once, plus one size probe per rank
    for root in ("single", "multi"):
        assert featurestore.open_store(str(tmp_path / root)).split_status("ds", "rec", "train") == "complete"
    for chunk in range(7):
        rel = Path("ds", "rec", "train", "features", "c", str(chunk), "0")
        assert (tmp_path / "single" / rel).read_bytes() == (tmp_path / "multi" / rel).read_bytes()
