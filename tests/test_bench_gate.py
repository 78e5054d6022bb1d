"""The speed gate (``bench all --check``, ``bench check REPORT.json``): the check logic on synthetic
reports (exit codes, the table, directions, spread, missing figures), the shipped targets file,
and that every target names a figure its bench really emits (real benches at their quick size).
No timing is asserted: the figures' values are whatever this machine gives."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from featurestore.bench import gate, reading, report
from featurestore.cli import main


def _targets(tmp_path: Path, *targets: dict[str, Any], variants: dict[str, Any] | None = None) -> str:
    path = tmp_path / "targets.json"
    path.write_text(json.dumps({"variants": variants or {}, "targets": list(targets)}))
    return str(path)


def _target(id: str, bench: str, figure: str, op: str, threshold: float, unit: str = "x") -> dict[str, Any]:
    return {"id": id, "bench": bench, "figure": figure, "op": op, "threshold": threshold, "unit": unit,
            "cache": "warm", "what": id}


def _report(tmp_path: Path, benches: dict[str, Any]) -> str:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"command": "featurestore bench all", "benches": benches}))
    return str(path)


def _entry(**figs: Any) -> dict[str, Any]:
    return {"status": "ok", "result": {"any": 1}, "figures": {
        name: (value if isinstance(value, dict) else reading.figure(value)) for name, value in figs.items()}}


def _check(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["bench", "check", *argv])
    out = capsys.readouterr()
    return status, out.out, out.err


TWO = (_target("ld", "loader", "loader_vs_reader", ">=", 0.95), _target("st", "loader", "stall_percent", "<", 5.0, "%"))


def test_all_met_exits_0_with_table_and_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    targets = _targets(tmp_path, *TWO)
    rep = _report(tmp_path, {"loader": _entry(loader_vs_reader=reading.figure(1.02, [0.97, 1.1, 1.02]),
                                              stall_percent=1.5)})
    status, out, err = _check(capsys, rep, "--targets", targets)
    assert status == 0, out + err
    header = out.splitlines()[0].split()
    assert header == ["id", "figure", "cache", "target", "measured", "spread", "ok"]
    line = next(ln for ln in out.splitlines() if ln.startswith("ld "))
    assert "loader.loader_vs_reader" in line and ">= 0.95x" in line and "1.02x" in line
    assert "0.97x - 1.1x" in line and line.rstrip().endswith("ok")  # the spread of the per-repeat pairs
    stall = next(ln for ln in out.splitlines() if ln.startswith("st "))
    assert "< 5%" in stall and "1.5%" in stall and " - " in stall.split("1.5%")[1]  # no spread: "-"
    assert "all 2 target(s) met" in out and err == ""


def test_a_miss_exits_1_and_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = _report(tmp_path, {"loader": _entry(loader_vs_reader=0.8, stall_percent=1.0)})
    status, out, err = _check(capsys, rep, "--targets", _targets(tmp_path, *TWO))
    assert status == 1
    assert "MISSED" in next(ln for ln in out.splitlines() if ln.startswith("ld "))
    assert err.strip() == "featurestore: error: 1 of 2 target(s) missed: ld"


@pytest.mark.parametrize(("op", "value", "met"), [
    (">=", 1.0, True), (">=", 0.99, False), (">", 1.0, False), (">", 1.01, True),
    ("<=", 1.0, True), ("<=", 1.01, False), ("<", 1.0, False), ("<", 0.99, True)])
def test_direction(tmp_path: Path, capsys: pytest.CaptureFixture[str], op: str, value: float, met: bool) -> None:
    targets = _targets(tmp_path, _target("t", "extract", "vs_encode_only", op, 1.0))
    rep = _report(tmp_path, {"extract": _entry(vs_encode_only=value)})
    status, out, _ = _check(capsys, rep, "--targets", targets)
    assert status == (0 if met else 1)
    assert ("MISSED" in out) is not met


def test_not_measured_is_a_miss_unless_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    targets = _targets(tmp_path, _target("s3r", "s3", "read_vs_ceiling", ">=", 0.5),
                       _target("cg", "loader", "cgroup_epoch", ">=", 1.0, ""),
                       _target("bf", "bags", "TRIDENT h5 cold", ">=", 1.5),
                       _target("ok", "loader", "loader_vs_reader", ">=", 0.95))
    # s3 not run (no SeaweedFS), the loader's cgroup part skipped, bags failed before a result.
    rep = _report(tmp_path, {"loader": _entry(loader_vs_reader=1.0),
                             "bags": {"status": "failed", "error": "RuntimeError: disk full"}})
    status, out, err = _check(capsys, rep, "--targets", targets)
    assert status == 1
    rows = {ln.split()[0]: ln for ln in out.splitlines()[2:] if ln.strip() and not ln.startswith("[")}
    assert "not measured: bench not run" in rows["s3r"]
    assert "not measured: not in the bench's result" in rows["cg"]
    assert "not measured: bench failed (RuntimeError: disk full)" in rows["bf"]
    assert rows["ok"].rstrip().endswith("ok")
    assert "3 of 4 target(s) missed: s3r, cg, bf" in err
    status, out, err = _check(capsys, rep, "--targets", targets, "--allow-missing")
    assert status == 0, err
    assert out.count("not measured (allowed)") == 3


def test_per_shape_figure_checks_every_shape_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    targets = _targets(tmp_path, _target("w16", "write", "float16_vs_tofile", ">=", 0.7),
                       _target("w16big", "write", "float16_vs_tofile[1024x3072]", ">=", 0.7))
    rep = _report(tmp_path, {"write": _entry(**{"float16_vs_tofile[256x384]": 1.3,
                                                "float16_vs_tofile[1024x3072]": 0.6})})
    status, out, err = _check(capsys, rep, "--targets", targets)
    assert status == 1 and "missed: w16, w16big" in err
    assert "write.float16_vs_tofile[256x384]" in out and out.count("write.float16_vs_tofile[1024x3072]") == 2


def test_only_selects_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = _report(tmp_path, {"loader": _entry(loader_vs_reader=0.5, stall_percent=1.0)})
    targets = _targets(tmp_path, *TWO)
    status, out, _ = _check(capsys, rep, "--targets", targets, "--only", "st")
    assert status == 0 and "loader_vs_reader" not in out
    status, _, err = _check(capsys, rep, "--targets", targets, "--only", "st,nope")
    assert status == 1 and err.count("\n") == 1 and "unknown target id(s) nope" in err and "ld, st" in err
    status, _, err = _check(capsys, rep, "--targets", targets, "--only", "")  # was: every target
    assert status == 1 and "unknown target id(s) (none given)" in err


def test_unreadable_result_is_not_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # An older report whose result lacks a key the figures read: that target is not measured, named.
    rep = _report(tmp_path, {"write": {"status": "ok", "result": {"shapes": [{"sample_shape": [8, 8]}]}}})
    status, out, _ = _check(capsys, rep, "--targets", _targets(tmp_path, _target("a", "write", "float16_vs_tofile",
                                                                                  ">=", 0.7)))
    assert status == 1 and "not measured: figures unreadable: KeyError: 'repeats_s'" in out


def test_report_without_figures_is_read_from_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A report.json from before the figures were stored: the gate reads the bench's result.
    result = {"shapes": [{"sample_shape": [256, 384], "writer_float16_ratio": 0.75, "writer_float32_ratio": 0.4,
                          "repeats_s": {"tofile": [1.0, 1.2], "float16": [1.25, 1.8], "float32": [2.5, 3.0]}}]}
    rep = _report(tmp_path, {"write": {"status": "ok", "result": result}})
    targets = _targets(tmp_path, _target("a", "write", "float16_vs_tofile", ">=", 0.7),
                       _target("b", "write", "float32_vs_tofile", ">=", 0.5))
    status, out, err = _check(capsys, rep, "--targets", targets)
    assert status == 1 and err.strip().endswith("missed: b")
    assert "0.667x - 0.8x" in next(ln for ln in out.splitlines() if ln.startswith("a "))


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "cannot read it as JSON"),
    (json.dumps({"targets": [{"id": "x"}]}), "target 'x' lacks bench, figure, op"),
    (json.dumps({"targets": [_target("x", "loader", "f", "==", 1)]}), "has op '=='"),
    (json.dumps({"targets": [_target("x", "gpu", "f", ">=", 1)]}), "names bench 'gpu'"),
    (json.dumps({"targets": [_target("x", "loader", "f", ">=", 1)] * 2}), "target 'x' repeats an id"),
    (json.dumps({"targets": [{**_target("x", "extract", "f", ">=", 1), "variant": "v"}]}), "names variant 'v'"),
    (json.dumps({"targets": [_target("x", "loader", "f", ">=", "0.9")]}), "has threshold '0.9' (a finite number)"),
    ('{"targets": [' + json.dumps(_target("x", "loader", "f", ">=", 1))[:-1].replace('"threshold": 1', '"threshold": NaN')
     + "}]}", "has threshold nan (a finite number)"),
    (json.dumps({"targets": [{**_target("x", "loader", "f", ">=", 1), "unit": "GB/s"}]}), "has unit 'GB/s'"),
    (json.dumps({"targets": [{**_target("x", "loader", "f", ">=", 1), "cache": "lukewarm"}]}), "cache 'lukewarm'"),
    (json.dumps({"targets": {"a": _target("x", "loader", "f", ">=", 1)}}), "a 'targets' list"),
    (json.dumps({"variants": {"z": {"bench": "extract", "args": []}},
                 "targets": [{**_target("x", "loader", "f", ">=", 1), "variant": "z"}]}), "not a variant of bench 'loader'"),
    (json.dumps([1]), "not a targets file"),
    (json.dumps({"targets": []}), "no targets in it")])
def test_bad_targets_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                      message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    status, _, err = _check(capsys, _report(tmp_path, {}), "--targets", str(path))
    assert status == 1 and err.count("\n") == 1 and message in err and str(path) in err


def test_bad_report_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    status, _, err = _check(capsys, str(missing))
    assert status == 1 and err.count("\n") == 1 and "nope.json: cannot read it" in err
    (tmp_path / "list.json").write_text("[]")
    status, _, err = _check(capsys, str(tmp_path / "list.json"))
    assert status == 1 and "not a bench all report.json" in err


def test_int8_figures_reach_the_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """cold's and bag-loader's int8-beside-float16 results give named figures (the ratio's spread
    from its per-repeat pairs) that the shipped targets check."""
    pair = {"reference": "float16", "split_bytes": {"float16": 100, "int8": 51}, "bytes_ratio": 0.51}
    cold = {"shapes": [{"sample_shape": [1024, 3072], "dtype": "float16", "rows": {
        "FeatureLoader": {"gb_per_s": 1.0}, "pread reference": {"gb_per_s": 1.0}, "np.memmap gather": {"gb_per_s": 0.1}},
        "int8": {**pair, "cpu": {"ratio_median": 1.4, "ratio_per_repeat": [1.2, 1.4, 1.6]}}}]}
    bags = {"int8": {**pair, "bytes_ratio": 0.6, "warm": {"ratio_median": 1.1, "ratio_per_repeat": [1.1]},
                     "cold": {"ratio_median": 1.5, "ratio_per_repeat": [1.5]}}}
    found = reading.bench_figures("cold", cold)
    assert found["int8_vs_float16[1024x3072]"] == {"value": 1.4, "spread": [1.2, 1.6], "repeats": 3}
    assert found["int8_bytes_vs_float16[1024x3072]"]["value"] == 0.51
    assert set(reading.bench_figures("bag_loader", bags)) == {
        "int8_bytes_vs_float16", "int8_vs_float16_warm", "int8_vs_float16_cold"}
    rep = _report(tmp_path, {"cold": {"status": "ok", "result": cold}, "bag_loader": {"status": "ok", "result": bags}})
    status, out, err = _check(capsys, rep, "--only", "cold-int8-vs-float16,cold-int8-bytes,"
                              "bag-loader-int8-vs-float16-warm,bag-loader-int8-bytes")
    assert status == 1 and err.strip().endswith("missed: bag-loader-int8-bytes")  # 0.6 > 0.52
    line = next(ln for ln in out.splitlines() if ln.startswith("cold-int8-vs-float16 "))
    assert "cold.int8_vs_float16[1024x3072]" in line and "1.4x" in line and "1.2x - 1.6x" in line


def test_target_flags_need_check(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "all", "--only", "loader-stall"]) == 1
    assert "go with --check" in capsys.readouterr().err


def test_shipped_targets_file(capsys: pytest.CaptureFixture[str]) -> None:
    from featurestore.bench.reading import Reading
    from featurestore.bench.report import print_result

    targets = gate.load_targets()
    ids = [t.id for t in targets.targets]
    assert len(ids) == len(set(ids)) >= 40
    # What a bench prints against its figures is the targets file's, not a copy of it.
    result = {"shapes": [{"sample_shape": [8, 8], "writer_float16_ratio": 0.75, "writer_float32_ratio": 0.4,
                          "writer_float16_gb_per_s": 1.0, "writer_float32_gb_per_s": 1.0, "tofile_gb_per_s": 1.0,
                          "repeats_s": {"tofile": [1.0], "float16": [1.3], "float32": [2.5]}}]}
    print_result("write", result)
    printed = capsys.readouterr().out
    assert "- write.float16_vs_tofile[8x8]: 0.75x; target write-float16-vs-tofile >= 0.7x: ok" in printed
    assert "- write.float32_vs_tofile[8x8]: 0.4x; target write-float32-vs-tofile >= 0.5x: MISSED" in printed
    # In bench all, a variant's run is checked against its own targets only, under its own name (an
    # extract-zero run once printed the vit targets of its vs_encode_only figure as MISSED).
    reading = Reading()
    reading.fig("vs_encode_only", 3.27)
    reading.fig("vs_tofile", 0.65)
    print_result("extract", {}, reading, run="extract-zero")
    printed = capsys.readouterr().out
    assert "- extract-zero.vs_tofile: 0.65x; target extract-zero-vs-tofile >= 0.6x: ok" in printed
    assert "- extract-zero.vs_encode_only: 3.27x\n" in printed and "extract-vit-vs-encode-only" not in printed
    # Every variant's flags (full and quick) are its bench's own, parsed by its parser.
    for variant in targets.variants.values():
        for flags in (variant["args"], variant["quick"]):
            report.bench_args(variant["bench"], flags)


# Parts --quick skips (their figure is then absent, by design): the cgroup epoch writes a split
# of 2.2x a 512 MiB limit, too much for a quick run.
# int8 vs float16 cold is judged at the seed shape [1024x3072], which --quick does not write.
SKIPPED_AT_QUICK = {"loader-cgroup-epoch": lambda result: "skipped" in result["cgroup"],
                    "cold-int8-vs-float16": lambda result: [1024, 3072] not in [s["sample_shape"] for s in result["shapes"]]}


def _assert_emitted(data: dict[str, Any], targets: list[gate.Target]) -> None:
    """Each target's figure is among its entry's stored figures (a per-shape one: for some shape)."""
    absent = []
    for t in targets:
        entry = data["benches"][t.run]
        assert entry["status"] == "ok", (t.run, entry.get("error"))
        names = entry["figures"]
        if not (t.figure in names or any(k.startswith(t.figure + "[") for k in names)):
            skipped = SKIPPED_AT_QUICK.get(t.id)
            if not (skipped and skipped(entry["result"])):
                absent.append((t.id, sorted(names)))
        for name, fig in names.items():
            assert isinstance(fig["value"], float) and fig["repeats"] >= 0, (t.run, name)
    assert not absent, absent


def _run_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str], benches: set[str],
              extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[gate.Target]]:
    selected = [t for t in gate.load_targets().targets if t.run in benches]
    out = tmp_path / "out"
    status = main(["bench", "all", "--quick", "--check", "--out", str(out), "--only",
                   ",".join(t.id for t in selected), *extra])
    captured = capsys.readouterr()
    assert status in (0, 1), captured.err[-3000:]  # met or missed: the figures are this machine's
    assert "bench(es) failed" not in captured.err, captured.out[-3000:] + captured.err[-3000:]
    data = json.loads((out / "report.json").read_text())
    assert set(data["benches"]) == benches
    _assert_emitted(data, selected)
    # The table is printed and stored: one row per target and shape, in report.json and report.md.
    assert data["gate"][0] == ["id", "figure", "cache", "target", "measured", "spread", "ok"]
    assert {row[0] for row in data["gate"][1:]} == {t.id for t in selected}
    assert "## Targets" in (out / "report.md").read_text()
    missed = {row[0] for row in data["gate"][1:] if row[-1] != "ok"}  # missed, or skipped at this size
    assert (status == 1) is bool(missed), (status, missed)
    return data, selected


# One test per group of benches, not one for all: the groups run on separate xdist workers
# (scripts/test.sh), and a failure names its bench.
@pytest.mark.parametrize("benches", [("loader", "write", "read"), ("extract", "extract-zero"), ("bags", "web"),
                                     ("bag_loader",)], ids="+".join)
def test_fast_benches_emit_every_target_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               benches: tuple[str, ...]) -> None:
    """loader, write, read, extract (and its zero-encoder variant), bags, web, bag_loader at --quick size."""
    pytest.importorskip("torch")
    pytest.importorskip("h5py")
    data, _ = _run_gate(tmp_path, capsys, set(benches))
    if "extract-zero" in benches:
        assert data["benches"]["extract-zero"]["args"]["encoder"] == "zero"  # the variant's flags reached the bench
    if "read" in benches:  # the limits of a read that maps nothing in (a raw file, the store's files), beside it
        figures = data["benches"]["read"]["figures"]
        assert figures["vs_pread_limit[256x384]"]["value"] > 0 and figures["vs_chunk_pread_limit[256x384]"]["value"] > 0


@pytest.mark.parametrize("benches", [("http", "cold"), ("extract-vit", "extract-wsi", "extract-wsi-vit")],
                         ids="+".join)
def test_http_cold_and_encoder_variants_emit_every_target_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  benches: tuple[str, ...]) -> None:
    """http, cold, and the extract variants with a real encoder or slides (builtin:vit-s14, --wsi)."""
    pytest.importorskip("torch")
    pytest.importorskip("openslide")
    _run_gate(tmp_path, capsys, set(benches))


def test_s3_bench_emits_every_target_figure(tmp_path: Path, seaweed: Any) -> None:
    """``bench s3`` at --quick size on the session's SeaweedFS (as tests/test_bench_report.py runs it)."""
    from conftest import SEAWEED_BUCKET

    from featurestore.bench import s3
    from featurestore.testing.seaweedfs import ACCESS_KEY, SECRET_KEY

    flags = [*report.QUICK_FLAGS["s3"], "--endpoint", seaweed.endpoint, "--key", ACCESS_KEY, "--secret", SECRET_KEY,
             "--bucket", SEAWEED_BUCKET]
    found = reading.bench_figures("s3", s3.run(report.bench_args("s3", flags)))
    for t in gate.load_targets().targets:
        if t.bench == "s3":
            assert t.figure in found, (t.id, sorted(found))
            assert found[t.figure]["repeats"] == 1  # each ratio's runs are kept per repeat (one at --quick)


def _bench_parser(name: str) -> argparse.ArgumentParser:
    from featurestore.bench import bench_module

    top = argparse.ArgumentParser(prog="featurestore bench")
    bench_module(name).register(top.add_subparsers(dest="bench"))
    return next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[name.replace("_", "-")]


@pytest.mark.parametrize("flags, runs", [
    ([], {"extract"}),
    (["--encoder", "zero", "--n", "128", "--repeats", "2"], {"extract-zero"}),  # sizes do not matter
    (["--encoder", "builtin:vit-s14", "--n", "512"], {"extract-vit"}),
    (["--wsi"], {"extract-wsi"}),
    (["--wsi", "--encoder", "builtin:vit-s14", "--slides", "1"], {"extract-wsi-vit"}),
    (["--device", "cuda", "--encoder", "timm:vit_small_patch14_dinov2,pretrained=false"], set()),
])
def test_a_lone_run_is_judged_by_the_targets_of_its_identity(flags: list[str], runs: set[str]) -> None:
    parser = _bench_parser("extract")
    assert gate.load_targets().runs_matching("extract", parser, parser.parse_args(flags)) == runs


def test_a_lone_run_prints_only_the_targets_it_measured(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from featurestore.bench import bench_module

    module = bench_module("extract")
    monkeypatch.setattr(module, "run", lambda args: {"stub": True})  # the printing, not the bench, is tested

    def figures(bench: str, result: dict[str, Any]) -> reading.Reading:
        out = reading.Reading()
        out.fig("vs_encode_only", 1.1)
        out.fig("vs_tofile", 0.17)
        return out
    monkeypatch.setattr(report, "read_result", figures)
    # A GPU run of a timm encoder (an H200 run printed the CPU vit and zero-encoder targets as MISSED).
    assert main(["bench", "extract", "--device", "cuda", "--encoder", "timm:vit_small_patch14_dinov2"]) == 0
    printed = capsys.readouterr().out
    assert "- extract.vs_encode_only: 1.1x\n" in printed and "- extract.vs_tofile: 0.17x\n" in printed
    assert "MISSED" not in printed and "targets not checked: extract-zero-vs-tofile, extract-vit-vs-encode-only" in printed
    assert "(measured with other --encoder, --wsi than this run's)" in printed
    # The zero-cost encoder's run is judged by its own target, under the bench's name.
    assert main(["bench", "extract", "--encoder", "zero", "--n", "64"]) == 0
    printed = capsys.readouterr().out
    assert "- extract.vs_tofile: 0.17x; target extract-zero-vs-tofile >= 0.6x: MISSED" in printed
    assert "extract-vit-vs-encode-only" in printed.split("targets not checked:")[1]
    # A bench without identity flags is judged by all of its targets, as before.
    assert gate.load_targets().runs_matching("cold", _bench_parser("cold"), _bench_parser("cold").parse_args([])) is None
