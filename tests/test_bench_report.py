"""``featurestore bench all``: real bench results go into report.md and report.json; a
failing bench is reported (and makes the exit status 1), never dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from featurestore.bench import report  # noqa: E402
from featurestore.cli import main  # noqa: E402


def test_quick_report_from_real_benches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # loader + extract, in this process: 9 s on 2 quiet cores, up to ~100 s when other jobs load
    # them (the loader's two RSS subprocesses importing torch are most of it). read and http run through the same code path (bench_args +
    # run); their quick flags are checked against their own parsers below.
    import signal

    out = tmp_path / "out"
    before = signal.getsignal(signal.SIGTERM)
    status = main(["bench", "all", "--quick", "--benches", "loader,extract", "--out", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.out[-3000:] + captured.err[-3000:]
    # SIGTERM is the benches' only while they run: this process (and what it forks) gets its own back
    assert signal.getsignal(signal.SIGTERM) is before
    assert "[bench all] wrote" in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]

    data = json.loads((out / "report.json").read_text())
    assert data["quick"] is True and data["machine"]["cpu_count"] >= 1
    assert list(data["benches"]) == ["loader", "extract"]
    for entry in data["benches"].values():
        assert entry["status"] == "ok" and entry["seconds"] > 0
    loader = data["benches"]["loader"]
    assert loader["args"]["num_samples"] == 64 and loader["args"]["shape"] == "64x384"  # the --quick size reached the bench's own args
    assert loader["result"]["throughput"]["loader_gbps"] > 0
    assert data["benches"]["extract"]["result"]["extract_img_s"] > 0

    md = (out / "report.md").read_text()
    assert "| loader | ok |" in md and "| extract | ok |" in md
    assert "loader (CPU consumer), GB/s" in md and "extract, images/s" in md
    rss = loader["result"]["rss"]  # the 4N samples as a float32 cache: what the loader's memory replaces
    cache = rss["4N"]["num_samples"] * 64 * 384 * 4 / 2**20
    assert f"samples as an in-RAM float32 cache: {cache:.1f} MiB" in md


def test_failed_bench_is_reported_and_exits_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    import featurestore.bench.extract as extract_bench

    def broken(args: object) -> dict[str, object]:
        raise RuntimeError("encoder fell over")

    monkeypatch.setattr(extract_bench, "run", broken)
    out = tmp_path / "out"
    assert main(["bench", "all", "--quick", "--benches", "extract", "--out", str(out)]) == 1
    assert "extract" in capsys.readouterr().err
    data = json.loads((out / "report.json").read_text())
    entry = data["benches"]["extract"]
    assert entry["status"] == "failed"
    assert entry["error"] == "RuntimeError: encoder fell over" and "Traceback" in entry["traceback"]
    md = (out / "report.md").read_text()
    assert "**FAILED**: RuntimeError: encoder fell over" in md and "## Failures" in md


@pytest.mark.parametrize("name", report.BENCH_NAMES)
def test_args_come_from_each_bench_parser(name: str) -> None:
    from featurestore.bench import bench_module

    full = report.bench_args(name)
    quick = report.bench_args(name, report.QUICK_FLAGS[name])
    assert callable(getattr(bench_module(name), "run"))
    assert full.workdir is None and quick.workdir is None
    assert vars(full) != vars(quick)  # --quick changes sizes, and only through real flags


def test_bench_selection() -> None:
    from featurestore.errors import InvalidOption

    assert report.parse_benches("extract, read,extract") == ["extract", "read"]
    assert report.parse_benches("bag-loader,bag_loader") == ["bag_loader"]  # the verb's spelling too
    with pytest.raises(InvalidOption, match=r"subset of read,write,http,loader,extract.*\(gpu unknown"):
        report.parse_benches("read,gpu")


def test_the_recorded_command_is_the_one_typed(tmp_path: Path) -> None:
    """report.json's command: what was typed, so that it runs the report again."""
    argv = ["bench", "all", "--quick", "--benches", "web", "--out", str(tmp_path / "out dir")]
    assert main(argv) == 0
    data = json.loads((tmp_path / "out dir" / "report.json").read_text())
    assert data["command"] == f"featurestore bench all --quick --benches web --out '{tmp_path}/out dir'"


def test_json_is_strict() -> None:
    # JSON has no inf/NaN: a division by a zero time must not produce an unreadable report.
    import numpy as np

    cleaned = report._jsonable({"a": float("inf"), "b": (np.float32(1.5), np.int64(2)), 3: float("nan")})
    assert cleaned == {"a": None, "b": [1.5, 2], "3": None}
    json.dumps(cleaned, allow_nan=False)


def test_changed_result_keys_are_noted_not_fatal(tmp_path: Path) -> None:
    # One bench's result lacks a key the report reads: its figures are left out with a note, the
    # other bench's figures and every file are still written.
    good = {"extract_img_s": 40.0, "encode_only_img_s": 50.0, "ratio": 1.25, "write_only_mb_s": 90.0,
            "extract_vs_tofile": 1.0, "repeats": {"extract_s": [1.0], "encode_only_s": [0.8], "tofile_s": [1.0]}}
    data = {"created": "now", "command": "featurestore bench all", "quick": True, "files": [],
            "machine": report.machine_info(),
            "benches": {"http": {"status": "ok", "seconds": 1.0, "result": {"gb_per_s_renamed": {}}},
                        "extract": {"status": "ok", "seconds": 1.0, "result": good}}}
    files = report.write_report(data, str(tmp_path))
    assert files == ["report.md", "report.json"]
    md = (tmp_path / "report.md").read_text()
    assert "| extract | 40 | 1.00x |" in md and "| encode only | 50 | 0.80x |" in md
    assert "## Report notes" in md and "- http: KeyError: 'gb_per_s'" in md


def test_s3_bench_runs_and_reports(tmp_path: Path, seaweed: object, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench s3`` end to end at --quick size, on the session's SeaweedFS (through --endpoint,
    so no second server starts): every figure is measured and lands in the report."""
    from conftest import SEAWEED_BUCKET

    from featurestore.testing.seaweedfs import ACCESS_KEY, SECRET_KEY

    flags = [*report.QUICK_FLAGS["s3"], "--endpoint", seaweed.endpoint, "--key", ACCESS_KEY,  # type: ignore[attr-defined]
             "--secret", SECRET_KEY, "--bucket", SEAWEED_BUCKET]
    from featurestore.bench import s3

    out = s3.run(report.bench_args("s3", flags))
    assert all(v > 0 for v in out["gb_per_s"].values()), out["gb_per_s"]
    from featurestore.bench import gate

    assert set(out["ratios"]) >= {t.figure for t in gate.load_targets().targets if t.bench == "s3"}
    assert set(s3.BAG_FIGURES) <= set(out["gb_per_s"]) and "bags_cache_epoch1_vs_ceiling" in out["ratios"]
    # Reads without a cache are first epochs (array, client, FeatureDataset made in the timing), against
    # bare get_ranges on a new client; half a cache's downloads are kept per epoch.
    assert {s3.FS_EPOCH, s3.BARE_EPOCH, s3.LOADER, s3.ZARR} <= set(out["gb_per_s"])
    assert set(out["downloaded_per_epoch_vs_split"]) == {s3.HALF1, s3.HALF2}
    assert all(len(out["runs"][a]) == len(out["runs"][b]) == 1 for a, b in out["pairs"].values())
    rows = report.throughput_rows({"benches": {"s3": {"result": out}}})
    assert any(title.startswith("S3 (SeaweedFS") for title in rows)
    from featurestore.bench.report import finish

    assert finish("s3", out, None) == 0
    assert "read_vs_ceiling" in capsys.readouterr().out


def test_a_stopped_bench_all_reports_what_finished_and_leaves_no_scratch(tmp_path: Path) -> None:
    """SIGTERM (a job's time limit) during the second bench: the first one's figures are in
    report.json, the second is marked interrupted, and no scratch directory is left (before, the
    report was lost and a bench's temp directory stayed)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out, scratch = tmp_path / "out", tmp_path / "scratch"
    scratch.mkdir()
    env = {**os.environ, "FEATURESTORE_BENCH_DIR": str(scratch)}
    proc = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "bench", "all", "--quick", "--benches",
                             "web,bags", "--out", str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen = ""
    deadline = time.time() + 300
    while "=== bags ===" not in seen and time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen += line
    time.sleep(1.0)  # inside bags: its cohort is being written
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, seen + rest
    data = json.loads((out / "report.json").read_text())
    assert data["interrupted"] is True and data["benches"]["web"]["status"] == "ok", seen + rest
    assert data["benches"]["bags"]["error"] == "interrupted", seen + rest
    assert list(scratch.iterdir()) == [], list(scratch.iterdir())

