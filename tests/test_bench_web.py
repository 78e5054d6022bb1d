"""``featurestore bench web`` at tiny size: the catalog and picture timings come back, interleaved
on the harness, and print as its notes (speed is judged by a real run, never here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from featurestore.cli import main  # noqa: E402


def test_tiny_web_bench(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    status = main(["bench", "web", "--splits", "5", "--dim", "16", "--tokens", "16", "--samples", "2",
                   "--repeats", "2", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    data = json.loads(out.read_text())
    catalog, picture = data["catalog"], data["picture"]
    assert all(catalog[k] > 0 for k in ("first_view_ms", "warm_ms", "documents_evicted_ms", "split_page_warm_ms"))
    assert picture["computed_ms"] > 0 and picture["cached_ms"] > 0 and all(v > 0 for v in picture["parts_ms"].values())
    assert "- catalog page, 5 splits of 16 channels: warm" in printed and "- PCA picture of 16x16 float16" in printed


def test_bad_sizes_and_workdirs_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--samples 1 (only the untimed warm-up), --tokens not a square and a --workdir the bench cannot
    write in: one error line before any work (an IndexError and a PermissionError/FileExistsError
    traceback before; --tokens: a ValueError traceback, after the catalog was built)."""
    (tmp_path / "afile").write_text("")
    assert main(["bench", "web", "--samples", "1", "--splits", "2", "--dim", "8", "--tokens", "4"]) == 1
    assert "--samples 1: give 2 or more" in capsys.readouterr().err
    assert main(["bench", "web", "--samples", "2", "--splits", "2", "--dim", "8", "--tokens", "15"]) == 1
    assert "--tokens 15 is not a square" in capsys.readouterr().err
    assert main(["bench", "web", "--workdir", str(tmp_path / "afile")]) == 1
    assert "cannot write there (File exists)" in capsys.readouterr().err
