"""``featurestore bench bag-loader`` at tiny size: every epoch figure is produced (warm, cold in
fresh processes, padded) and printed; speed is judged by the bench's printed figures on a real run,
never here. (The RSS subprocesses are left out: two more interpreters with torch, ~15 s here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featurestore.bench import gate, reading
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
    # int8 beside float16 (the default --dtype): bags/s of float32 epochs, interleaved, warm and cold.
    int8 = data["int8"]
    assert int8["split_bytes"]["int8"] > 0 and int8["split_bytes"]["float16"] > 0
    for mode in ("warm", "cold"):
        assert len(int8[mode]["ratio_per_repeat"]) == 1 and int8[mode]["bags_per_s"]["int8"] > 0
        assert set(int8[mode]["times_s"]) == {"float16", "int8"}
    assert "by_dtype" not in data  # int8 is not a column of its own: it is measured beside float16
    found = reading.bench_figures("bag_loader", data)
    assert found["int8_vs_float16_warm"]["value"] == int8["warm"]["ratio_median"]
    assert found["int8_vs_float16_cold"]["value"] == int8["cold"]["ratio_median"]
    assert found["int8_bytes_vs_float16"]["value"] == int8["bytes_ratio"]
    rows = gate.check({"benches": {"bag_loader": {"result": data}}},
                      gate.load_targets().select("bag-loader-int8-vs-float16-warm,bag-loader-int8-bytes"))
    assert [r.measured for r in rows] == [int8["warm"]["ratio_median"], int8["bytes_ratio"]]
    assert "- bag_loader.int8_vs_float16_warm: " in printed and "target bag-loader-int8-vs-float16-warm" in printed
    assert "warm, float32 out: int8 " in printed and "bags/s" in printed


def test_int8_needs_float16_beside_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "bag-loader", "--dtype", "int8"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dtype 'int8'" in err and "--dtype float16,int8" in err
