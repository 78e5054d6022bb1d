"""``featurestore bench cold`` at tiny size: it runs every method cold, in a memory cgroup where
one can be made, and its figures reach ``bench all``'s report (speed is judged by the bench's
printed figures on a real run, never here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featurestore.bench import gate, report
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
    # Cold means cold: no map of the readers' or of np.memmap's kept pages past an eviction.
    assert {name: row["cached_after_evict"] for name, row in shape["rows"].items()} == dict.fromkeys(shape["rows"], 0)
    markdown = (out / "report.md").read_text()
    assert "cold [64x384] float16 (page cache cold)" in markdown and "parallel-pread reference" in markdown
    assert any(title.startswith("cold [") for title in report.throughput_rows(data))
    # int8 beside float16 by default: the same samples, float32 out, loader epochs interleaved in the same child.
    int8 = shape["int8"]
    assert set(shape["rows"]) >= {"FeatureLoader -> float32", "FeatureLoader [int8]"}
    assert int8["split_bytes"]["int8"] > 0 and int8["split_bytes"]["float16"] > 0
    assert len(int8["cpu"]["ratio_per_repeat"]) == shape["repeats"] and int8["cpu"]["samples_per_s"]["int8"] > 0
    figures = entry["figures"]
    assert figures["int8_vs_float16[64x384]"]["value"] == int8["cpu"]["ratio_median"]
    assert figures["int8_bytes_vs_float16[64x384]"]["value"] == int8["bytes_ratio"]
    # The gate reads them: the bytes target (every shape) is measured at this size.
    rows = gate.check(data, gate.load_targets().select("cold-int8-bytes"))
    assert [(r.figure, r.measured) for r in rows] == [("cold.int8_bytes_vs_float16[64x384]", int8["bytes_ratio"])]
    assert "int8 features + scales" in markdown and "int8 / float16" in markdown


def test_int8_needs_float16_beside_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cold", "--dtype", "int8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype 'int8'" in err and "--dtype float16,int8" in err
