"""SIGKILL a real ``featurestore extract`` mid-run, then ``--resume``: the bytes of one clean run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _core_helpers import comparable_chunk_file
from test_extract import cli_env, run_cli

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke
from featurestore.extract.dist import Coordinator
from featurestore.extract.run import ExtractOptions, extract

SPLIT = ("pannuke", "logged_tiny_vit", "fold1")


def _files(root: Path) -> dict[str, bytes]:
    """Every chunk file of the split (features, labels, statistics), by relative path."""
    split = root.joinpath(*SPLIT)
    # zarr.json holds timestamps; .tmp files are writes the SIGKILL cut short (never renamed).
    return {str(p.relative_to(split)): comparable_chunk_file(str(p.relative_to(split)), p.read_bytes())
            for p in sorted(split.rglob("*"))
            if p.is_file() and p.name != "zarr.json" and not p.name.endswith(".tmp")}


def test_sigkill_then_resume_is_byte_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    fold = make_synthetic_pannuke(tmp_path / "fold", 24, size=32, seed=7)
    # 4 samples of [4, 128] float16 per chunk, batches of 2: 6 chunks, 12 batches.
    chunk_mb = 4 * 4 * 128 * 2 / 2**20
    common = ["--images", f"pannuke:{fold}", "--encoder", "python:test_extract:logged_tiny_vit",
              "--dataset", SPLIT[0], "--split", SPLIT[2], "--batch-size", "2", "--num-workers", "1",
              "--chunk-mb", str(chunk_mb)]
    monkeypatch.delenv("FSX_SLEEP", raising=False)
    monkeypatch.delenv("FSX_LOG", raising=False)
    reference = tmp_path / "reference"
    extract(ExtractOptions(images=f"pannuke:{fold}", encoder="python:test_extract:logged_tiny_vit",
                           store=str(reference), dataset=SPLIT[0], split=SPLIT[2], batch_size=2,
                           chunk_mb=chunk_mb, num_workers=0, progress=False), Coordinator())

    store = tmp_path / "store"
    log = tmp_path / "encoded.log"
    env = cli_env(FSX_SLEEP="0.4", FSX_LOG=str(log))
    process = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "extract", *common, "--store", str(store)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    chunks = store.joinpath(*SPLIT, "features", "c")

    def written() -> int:  # chunk files renamed into place (their directory comes first)
        return sum((chunks / str(i) / "0" / "0").is_file() for i in range(6))

    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if written() >= 2:
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed: slow the encoder down"
        assert written() >= 2, "no chunks written within 120 s"
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.communicate()
    assert process.returncode == -signal.SIGKILL
    done_before = written()
    assert 2 <= done_before < 6
    opened = featurestore.open_store(str(store))
    assert opened.split_status(*SPLIT) == "writing"

    log.write_text("")
    resumed = run_cli("extract", *common, "--store", str(store), "--resume", env=cli_env(FSX_LOG=str(log)))
    assert resumed.returncode == 0, resumed.stderr
    encoded = sum(int(n) for n in log.read_text().split()) - 1  # minus the probe sample
    assert encoded == 24 - 4 * done_before  # only the samples of chunks not already valid
    assert featurestore.open_store(str(store)).split_status(*SPLIT) == "complete"
    ours, theirs = _files(store), _files(reference)
    # features, labels, stats, block seals per chunk; ids; the commit's chunk_seals table
    assert set(ours) == set(theirs) and len(ours) == 4 * 6 + 1 + 1
    for name in theirs:
        assert ours[name] == theirs[name], name
