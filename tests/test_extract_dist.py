"""``torchrun --nproc-per-node 2 featurestore extract`` on CPU (gloo) equals one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _dist_helpers import torchrun_cli
from test_extract import cli_env

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke
from featurestore.extract.dist import Coordinator
from featurestore.extract.run import ExtractOptions, extract

SPLIT = ("pannuke", "logged_tiny_vit", "fold1")


def test_torchrun_two_ranks_equal_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.delenv("FSX_LOG", raising=False)
    monkeypatch.delenv("FSX_SLEEP", raising=False)
    fold = make_synthetic_pannuke(tmp_path / "fold", 22, size=32, seed=11)
    chunk_mb = 3 * 4 * 128 * 2 / 2**20  # 3 samples per chunk: 8 chunks, the last one short
    single = tmp_path / "single"
    extract(ExtractOptions(images=f"pannuke:{fold}", encoder="python:test_extract:logged_tiny_vit",
                           store=str(single), dataset=SPLIT[0], split=SPLIT[2], batch_size=2,
                           chunk_mb=chunk_mb, num_workers=0, progress=False,
                           # torchrun starts each rank with OMP_NUM_THREADS=1; CPU float sums can
                           # round differently with another thread count, so match it.
                           threads=1), Coordinator())

    log = tmp_path / "encoded.log"
    process = torchrun_cli(
        "extract", "--images", f"pannuke:{fold}",
        "--encoder", "python:test_extract:logged_tiny_vit", "--store", str(tmp_path / "multi"),
        "--dataset", SPLIT[0], "--split", SPLIT[2], "--batch-size", "2", "--num-workers", "0",
        "--chunk-mb", str(chunk_mb), env=cli_env(FSX_LOG=str(log)))
    stdout = process.stdout
    assert process.returncode == 0, process.stderr[-3000:]
    # One report, from rank 0 only.
    assert stdout.count("quantization:") == 1 and stdout.count("extracted pannuke/") == 1
    # Every sample was encoded once over both ranks (plus one probe sample per rank).
    assert sum(int(n) for n in log.read_text().split()) == 22 + 2

    name = SPLIT
    a = featurestore.open_store(str(single)).open(*name)
    b = featurestore.open_store(str(tmp_path / "multi")).open(*name)
    idx = np.arange(22)
    assert np.array_equal(a.read_numpy(idx), b.read_numpy(idx))
    assert a.labels is not None and b.labels is not None
    assert np.array_equal(a.labels.read_numpy(idx), b.labels.read_numpy(idx))
    for field in ("quantization", "channel_stats", "cache_key", "encoder", "token_layout", "chunk_rows"):
        assert a.metadata[field] == b.metadata[field], field
    assert b.metadata["status"] == "complete"
    for chunk in range(8):  # the chunk files themselves, byte for byte
        rel = Path(*name, "features", "c", str(chunk), "0", "0")
        assert (single / rel).read_bytes() == (tmp_path / "multi" / rel).read_bytes()
