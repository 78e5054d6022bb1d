"""``featurestore bench bag-loader`` at tiny size: every epoch figure is produced (warm, cold in
fresh processes, padded) and printed; speed is judged by the bench's printed figures on a real run,
never here. (The RSS subprocesses are left out: two more interpreters with torch, ~15 s here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featurestore.cli import main


def test_tiny_bag_loader_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    status = main(["bench", "bag-loader", "--bags", "6", "--patches", "40", "--dim", "16", "--workers", "2",
                   "--repeats", "1", "--batch-size", "4", "--max-patches", "32", "--workdir", str(tmp_path / "work"),
                   "--skip-rss", "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    data = json.loads(out.read_text())
    for mode in ("warm", "cold"):
        figures = data[mode]
        assert {"reader_s", "loader_s", "loader_f32_s", "clam_s"} <= set(figures)
        assert figures["loader_vs_reader"] > 0 and figures["loader_vs_clam"] > 0
    assert data["padded"]["batches"] == 2 and data["padded"]["padded_vs_reader"] > 0
    assert "CLAM torch.load .pt" in printed and "padded, batch 4" in printed
