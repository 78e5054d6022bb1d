"""``featurestore bench cold`` at tiny size: it runs every method cold, in a memory cgroup where
one can be made, and its figures reach ``bench all``'s report (speed is judged by the bench's
printed figures on a real run, never here)."""

from __future__ import annotations

import json
from pathlib import Path

from featurestore.bench import report
from featurestore.cli import main


def test_quick_cold_bench_in_the_report(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    status = main(["bench", "all", "--quick", "--benches", "cold", "--out", str(out)])
    data = json.loads((out / "report.json").read_text())
    entry = data["benches"]["cold"]
    assert status == 0, entry.get("traceback")
    shape = entry["result"]["shapes"][0]
    assert shape["returncode"] == 0 and shape["same_bytes"] is True
    assert set(shape["rows"]) >= {"device limit", "pread reference", "np.memmap gather", "FeatureArray.read",
                                  "FeatureLoader"}
    assert all(row["gb_per_s"] > 0 for row in shape["rows"].values())
    markdown = (out / "report.md").read_text()
    assert "cold [64x384] float16 (page cache cold)" in markdown and "parallel-pread reference" in markdown
    assert any(title.startswith("cold [") for title in report.throughput_rows(data))
