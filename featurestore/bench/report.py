"""``featurestore bench all``: run every benchmark and write ``report.md``, ``report.json`` and plots.

Each bench (``read``, ``write``, ``http``, ``loader``, ``extract``, ``s3``, ``cold``) is run in this process through its own
``run(args)``, with the defaults of its own parser (so ``bench all`` never drifts from ``bench
NAME``), or with the small sizes of ``--quick``. A bench that raises (or whose own check fails) is
recorded as failed with its error in both reports, the others still run, and the command exits 1
at the end: a failure is never silently dropped. Plots (matplotlib, Agg backend: no display):
``throughput.png``, GB/s (img/s for extraction) of featurestore against each bench's baselines;
``rss.png``, anonymous RSS over time during one loader epoch over N and 4N samples (sampled by the
loader bench's subprocesses) against the same split held as a float32 tensor in RAM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from featurestore import __version__

BENCH_NAMES = ("read", "write", "http", "loader", "extract", "s3", "cold")

# Small sizes for CI and a first look: each bench finishes in seconds, the figures are noisy.
QUICK_FLAGS: dict[str, list[str]] = {
    "read": ["--shapes", "256x384", "--gib", "0.03", "--batches", "10", "--repeats", "1", "--skip-rss"],
    "write": ["--shapes", "256x384", "--mb", "8", "--repeats", "1"],
    "http": ["--num-samples", "192", "--batches", "6", "--repeats", "1", "--items", "30",
             "--load-seconds", "2", "--clients", "4"],
    "loader": ["--shape", "64x384", "--num-samples", "64", "--repeats", "1", "--skip-cgroup"],
    "extract": ["--n", "64", "--image-size", "64", "--repeats", "1"],
    "s3": ["--num-samples", "128", "--batches", "4", "--slow-batches", "2", "--repeats", "1"],
    "cold": ["--shapes", "64x384", "--batch-sizes", "16", "--limit-mib", "512", "--store-ratio", "0.1",
             "--no-variants", "--cuda", "off"],
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "all", help="run every bench; write report.md, report.json and PNG plots",
        description="Run the read, write, http, loader, extract, s3 and cold benches with their default arguments "
        "(or small ones with --quick) and write report.md, report.json, throughput.png and rss.png "
        "into --out. A failed bench is reported with its error and makes the exit status 1.")
    parser.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds per bench, noisy figures")
    parser.add_argument("--benches", default=",".join(BENCH_NAMES),
                        help=f"comma-separated subset of {','.join(BENCH_NAMES)} (default: all)")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    report = run(args)
    failed = [name for name, entry in report["benches"].items() if entry["status"] != "ok"]
    print(f"\n[bench all] wrote {', '.join(report['files'])} into {os.path.abspath(args.out)}")
    if failed:
        print(f"featurestore: error: bench(es) failed: {', '.join(failed)} (see report.md)", file=sys.stderr)
        return 1
    return 0


def parse_benches(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in BENCH_NAMES]
    if unknown or not names:
        raise ValueError(f"--benches takes a comma-separated subset of {','.join(BENCH_NAMES)}, "
                         f"but got: {text!r}")
    return list(dict.fromkeys(names))  # drop duplicates, keep the order given


def bench_args(name: str, extra: Sequence[str] = ()) -> argparse.Namespace:
    """The bench's own parser, parsed from ``extra`` flags only: its defaults, not a copy of them."""
    import importlib

    module = importlib.import_module(f"featurestore.bench.{name}")
    parser = argparse.ArgumentParser(prog="featurestore bench")
    module.register(parser.add_subparsers(dest="bench"))
    return parser.parse_args([name, *extra])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benches named in ``args.benches``; write the reports into ``args.out``; return the
    report dict (also what ``report.json`` holds)."""
    import importlib

    names = parse_benches(getattr(args, "benches", ",".join(BENCH_NAMES)))
    quick = bool(getattr(args, "quick", False))
    os.makedirs(args.out, exist_ok=True)
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "featurestore bench all" + (" --quick" if quick else "")
        + ("" if set(names) == set(BENCH_NAMES) else f" --benches {','.join(names)}"),
        "quick": quick, "machine": machine_info(), "benches": {}, "files": [],
    }
    for name in names:
        print(f"\n[bench all] === {name} ===", flush=True)
        entry: dict[str, Any] = {"status": "failed"}
        started = time.perf_counter()
        try:
            bench = bench_args(name, QUICK_FLAGS[name] if quick else [])
            entry["args"] = {k: v for k, v in vars(bench).items() if k not in ("func", "bench")}
            module = importlib.import_module(f"featurestore.bench.{name}")
            result = module.run(bench)
            entry["result"] = result
            verdict = _verdict(module, result)
            if verdict:
                entry.update(error=verdict, traceback=verdict)
                print(f"[bench all] {name} FAILED: {verdict}", file=sys.stderr, flush=True)
            else:
                entry["status"] = "ok"
        except Exception as error:  # recorded, reported, and turned into exit status 1 at the end
            entry["error"] = f"{type(error).__name__}: {error}"
            entry["traceback"] = traceback.format_exc()
            print(f"[bench all] {name} FAILED: {entry['error']}", file=sys.stderr, flush=True)
        entry["seconds"] = time.perf_counter() - started
        report["benches"][name] = entry
    report["files"] = write_report(report, args.out)
    return report


def _verdict(module: Any, result: dict[str, Any]) -> str | None:
    """The bench's own exit status, as ``featurestore bench NAME`` would give it (e.g. the http
    load test saw errors or wrong payloads): None when it passed. Its summary printer also prints
    the figures the loader bench shows outside ``run``."""
    printer = getattr(module, "_print_and_save", None)
    status = printer(result, None) if printer is not None else 0
    if not status:
        return None
    load = result.get("load") or {}
    detail = f": load test {load.get('errors')} errors, {load.get('mismatches')} mismatches" if load else ""
    return f"the bench reported failure (exit status {status}){detail}"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"featurestore": __version__, "platform": platform.platform(),
                            "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    try:
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def write_report(report: dict[str, Any], out: str) -> list[str]:
    """Write the plots, ``report.md`` and ``report.json`` into ``out``; return the file names."""
    files = plot_throughput(report, os.path.join(out, "throughput.png"))
    files += plot_rss(report, os.path.join(out, "rss.png"))
    report["files"] = [*files, "report.md", "report.json"]
    with open(os.path.join(out, "report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(report))
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as f:
        json.dump(_jsonable(report), f, indent=2)
        f.write("\n")
    return report["files"]


def _jsonable(value: Any) -> Any:
    """Tuples, numpy scalars and non-finite floats (JSON has no inf/NaN) made JSON-safe."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def throughput_rows(report: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    """Per panel title: ``(method, rate)`` pairs, featurestore first. Rates: GB/s (img/s for extract)."""
    panels: dict[str, list[tuple[str, float]]] = {}
    for name, rows in (("read", _read_rows), ("write", _write_rows), ("http", _http_rows),
                       ("loader", _loader_rows), ("extract", _extract_rows), ("s3", _s3_rows), ("cold", _cold_rows)):
        panels.update(_guarded(report, name, rows, {}))
    return panels


def _guarded(report: dict[str, Any], name: str, fn: Any, default: Any) -> Any:
    """``fn(result of bench name)``; a result whose keys changed under the report is noted in
    ``render_errors`` (shown in report.md) instead of taking the other benches' figures down."""
    result = report["benches"].get(name, {}).get("result")
    if not result:
        return default
    try:
        return fn(result)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as error:
        report.setdefault("render_errors", {})[f"{name}: {fn.__name__}"] = f"{type(error).__name__}: {error}"
        return default


def _read_rows(read: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {f"read [{'x'.join(map(str, shape['sample_shape']))}] float16, GB/s":
            [(m, r["gb_per_s"]) for m, r in shape["read"].items()] for shape in read["shapes"]}


def _write_rows(write: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {f"write [{'x'.join(map(str, shape['sample_shape']))}] float16 stored, to os.sync, GB/s": [
        ("writer, f16 input", shape["writer_float16_gb_per_s"]), ("writer, f32 input", shape["writer_float32_gb_per_s"]),
        ("numpy tofile", shape["tofile_gb_per_s"])] for shape in write["shapes"]}


def _http_rows(http: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {"http batches, GB/s": list(http["gb_per_s"].items())}


def _loader_rows(loader: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    t = loader["throughput"]
    return {"loader (CPU consumer), GB/s": [
        ("loader", t["loader_gbps"]), ("bare reader", t["reader_gbps"]),
        ("loader -> f32", t["loader_float32_gbps"]), ("reader + .float()", t["reader_float32_gbps"])]}


def _cold_rows(cold: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    panels = {}
    for shape in cold["shapes"]:
        if "rows" not in shape:
            continue
        rows = shape["rows"]
        first = [k for k in ("FeatureLoader", "FeatureArray.read") if k in rows]
        names = first + [k for k in rows if k not in first]
        panels[f"cold [{'x'.join(map(str, shape['sample_shape']))}] float16 (page cache cold), GB/s"] = [
            (name, rows[name]["gb_per_s"]) for name in names]
    return panels


def _extract_rows(extract: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    return {"extract, images/s": [("extract", extract["extract_img_s"]),
                                  ("encode only", extract["encode_only_img_s"])]}


def _s3_rows(s3: dict[str, Any]) -> dict[str, list[tuple[str, float]]]:
    rates = s3["gb_per_s"]
    reads = ["featurestore shuffled batches", "ceiling (whole chunks, 8 GETs)", "FeatureLoader epoch (uniform shuffle)",
             "zarr-python FsspecStore", "featurestore via fsspec (before)"]
    return {"S3 (SeaweedFS, loopback) reads, GB/s": [(name, rates[name]) for name in reads],
            "S3 (SeaweedFS, loopback) writes, GB/s": [(name, rates[name]) for name in
                                                      ("featurestore write", "plain concurrent put")]}


def _s3_details(s3: dict[str, Any]) -> list[str]:
    targets = s3.get("targets", {})
    parts = []
    for name, value in s3["ratios"].items():
        target = targets.get(name)
        parts.append(f"{name} {value:.2f}x" + (f" (target >= {target}x)" if target is not None else ""))
    return [f"- s3 ({s3['cache']}): " + "; ".join(parts)]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: works on a headless machine
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(report: dict[str, Any], path: str) -> list[str]:
    panels = throughput_rows(report)
    plt = _pyplot()
    count = max(1, len(panels))
    cols = min(2, count)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, bars) in zip(axes.flat, panels.items()):
        names, values = [b[0] for b in bars], [b[1] for b in bars]
        # featurestore's own path in one colour, the baselines in grey: the comparison at a glance.
        colours = ["tab:blue" if i == 0 or n.startswith("loader") else "tab:gray" for i, n in enumerate(names)]
        ax.barh(names[::-1], values[::-1], color=colours[::-1])
        for y, v in enumerate(values[::-1]):
            ax.text(v, y, f" {v:.3g}", va="center", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.margins(x=0.2)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if not panels:
        axes.flat[0].text(0.5, 0.5, "no throughput results (every bench failed or was skipped)",
                          ha="center", va="center")
    fig.suptitle(f"featurestore vs baselines, same run ({report['machine'].get('cpu_count')} CPUs; "
                 "best or median of interleaved repeats, as each bench reports)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [os.path.basename(path)]


def rss_series(report: dict[str, Any]) -> list[dict[str, Any]]:
    """From the loader bench: per run (N, 4N), time (s), anonymous RSS (MiB) and the float32 cache (MiB)."""
    series: list[dict[str, Any]] = _guarded(report, "loader", _rss_series, [])
    return series


def _rss_series(loader: dict[str, Any]) -> list[dict[str, Any]]:
    rss = loader.get("rss") or {}
    elements = math.prod(loader.get("sample_shape") or [0])
    series = []
    for label in ("N", "4N"):
        run = rss.get(label)
        if not run or not run.get("samples"):
            continue
        series.append({
            "label": f"{label} = {run['num_samples']} samples",
            "t": [s[0] for s in run["samples"]],
            "anon_mib": [s[1] / 2**20 for s in run["samples"]],
            "peak_anon_mib": run["peak_anon"] / 2**20,
            "baseline_mib": run["baseline_anon"] / 2**20,
            "cache_mib": run["num_samples"] * elements * 4 / 2**20,
        })
    return series


def plot_rss(report: dict[str, Any], path: str) -> list[str]:
    series = rss_series(report)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for colour, s in zip(("tab:blue", "tab:orange"), series):
        ax.plot(s["t"], s["anon_mib"], color=colour, label=f"loader anon RSS, {s['label']}")
        # The same process holding the split as a float32 tensor: its imports plus the cache.
        ax.axhline(s["baseline_mib"] + s["cache_mib"], color=colour, linestyle="--",
                   label=f"imports + float32 in-RAM cache, {s['label']} (+{s['cache_mib']:.0f} MiB)")
    if not series:
        ax.text(0.5, 0.5, "no RSS samples (loader bench failed, skipped, or run with --skip-rss)",
                ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("seconds into the epoch")
    ax.set_ylabel("MiB")
    ax.set_ylim(bottom=0)
    ax.set_title("RSS during one loader epoch vs the in-RAM cache it replaces")
    if series:
        ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [os.path.basename(path)]


def render_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [
        "# featurestore benchmark report", "",
        f"- command: `{report['command']}`",
        f"- created: {report['created']}",
        f"- machine: {m.get('cpu_count')} CPUs, {m.get('platform')}, Python {m.get('python')}, "
        f"torch {m.get('torch')}, CUDA {m.get('cuda') or 'none'}, load average {m.get('load_average')}",
        "- ratios are taken side by side in one run (repeats interleaved; best or median, as each "
        "bench reports), because a shared machine is noisy; absolute GB/s move from run to run.",
        "", "## Status", "", "| bench | status | seconds |", "|---|---|---|",
    ]
    for name, entry in report["benches"].items():
        status = "ok" if entry["status"] == "ok" else f"**FAILED**: {entry.get('error', '')}"
        lines.append(f"| {name} | {_cell(status)} | {entry.get('seconds', 0):.1f} |")
    for title, bars in throughput_rows(report).items():
        # How featurestore's path (first row) compares with each method: 0.8x = 80 % of its rate.
        first = bars[0][1] if bars else 0
        lines += ["", f"## {title}", "", f"| method | rate | {bars[0][0]} ÷ method |", "|---|---|---|"]
        lines += [f"| {name} | {rate:.3g} | {first / rate:.2f}x |" if rate else f"| {name} | {rate:.3g} | |"
                  for name, rate in bars]
    lines += _details(report)
    series = rss_series(report)
    if series:
        lines += ["", "## Memory: one loader epoch vs the in-RAM float32 cache", "",
                  "| run | anon RSS after imports (MiB) | peak during the epoch (MiB) | float32 cache (MiB) |",
                  "|---|---|---|---|"]
        lines += [f"| {s['label']} | {s['baseline_mib']:.1f} | {s['peak_anon_mib']:.1f} | {s['cache_mib']:.1f} |"
                  for s in series]
    lines += ["", "## Plots", "", "![throughput](throughput.png)", "", "![rss](rss.png)"]
    if report.get("render_errors"):
        lines += ["", "## Report notes", "", "Figures the report could not read from a bench's result:", ""]
        lines += [f"- {where}: {error}" for where, error in report["render_errors"].items()]
    failed = {n: e for n, e in report["benches"].items() if e["status"] != "ok"}
    if failed:
        lines += ["", "## Failures", ""]
        for name, entry in failed.items():
            lines += [f"### {name}", "", "```", entry.get("traceback", entry.get("error", "")).rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def _details(report: dict[str, Any]) -> list[str]:
    """The figures that are not bars: write speed, latency, stall, memory bound, cgroup, extraction ratio."""
    lines: list[str] = []
    for name, fn in (("read", _read_details), ("write", _write_details), ("http", _http_details),
                     ("loader", _loader_details), ("extract", _extract_details), ("s3", _s3_details),
                     ("cold", _cold_details)):
        lines += _guarded(report, name, fn, [])
    return ["", "## Other figures", "", *lines] if lines else []


def _read_details(read: dict[str, Any]) -> list[str]:
    return [f"- read [{'x'.join(map(str, shape['sample_shape']))}] (warm): featurestore / np.memmap paired per "
            f"repeat, median {shape['median_paired_vs_memmap']:.2f}x (target >= 1.0x); first pass with crc32c "
            f"checks {shape['verify']['ratio']:.2f}x the unchecked one" for shape in read["shapes"]] + [
            f"- write [{'x'.join(map(str, shape['sample_shape']))}]: featurestore "
            f"{shape['write']['featurestore_gb_per_s']:.2f} GB/s vs numpy tofile "
            f"{shape['write']['tofile_gb_per_s']:.2f} GB/s ({shape['write']['ratio']:.2f}x)" for shape in read["shapes"]]


def _write_details(write: dict[str, Any]) -> list[str]:
    targets = write.get("targets", {"float16": 0.7, "float32": 0.5})
    return [f"- write [{'x'.join(map(str, shape['sample_shape']))}] / numpy tofile (to os.sync): float16 input "
            f"{shape['writer_float16_ratio']:.2f}x (target >= {targets['float16']}x), float32 input "
            f"{shape['writer_float32_ratio']:.2f}x (target >= {targets['float32']}x)" for shape in write["shapes"]]


def _http_details(http: dict[str, Any]) -> list[str]:
    lat = http["item_latency_ms"]
    lines = [f"- http vs raw tcp {http['http_vs_raw_tcp']:.2f}x, vs raw tcp + gather "
             f"{http['http_vs_raw_tcp_gather']:.2f}x; single item p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms"]
    if http.get("load"):
        load = http["load"]
        lines.append(f"- http load test: {load['requests']} requests ({load['requests_per_s']:.0f}/s), "
                     f"errors {load['errors']}, payload mismatches {load['mismatches']}")
    return lines


def _loader_details(loader: dict[str, Any]) -> list[str]:
    s = loader["stall"]
    lines = [f"- loader stall: {100 * s['stall_fraction']:.2f}% of the epoch (target < 5%)"]
    cg = loader.get("cgroup") or {}
    if "skipped" in cg:
        lines.append(f"- cgroup epoch: skipped ({cg['skipped']})")
    elif cg:
        lines.append(f"- cgroup limit {cg['limit_bytes'] / 2**20:.0f} MiB, store {cg['store_bytes'] / 2**20:.0f} MiB: "
                     f"loader rc {cg['loader_returncode']}, RAM tensor killed: {cg['ram_killed']}")
    return lines


def _cold_details(cold: dict[str, Any]) -> list[str]:
    lines = []
    for shape in cold["shapes"]:
        label = "x".join(map(str, shape["sample_shape"]))
        if "rows" not in shape:
            lines.append(f"- cold [{label}]: child failed (rc {shape.get('returncode')})")
            continue
        rows = shape["rows"]
        loader, ref, mm = (rows[k]["gb_per_s"] for k in ("FeatureLoader", "pread reference", "np.memmap gather"))
        lines.append(f"- cold [{label}], {shape['chunk_rows']}-row chunks, store {shape['store_bytes'] / 2**30:.2f} GiB, "
                     f"memory cgroup {cold['limit_bytes'] >> 20} MiB ({shape['cgroup']}): loader {loader / ref:.2f}x the "
                     f"parallel-pread reference (target >= 0.85x), {loader / mm:.2f}x np.memmap (target >= 3x), "
                     f"{loader / rows['device limit']['gb_per_s']:.2f}x the device limit; loader peak RSS "
                     f"{rows['FeatureLoader']['peak_rss'] / 2**20:.0f} MiB; same bytes: {shape['same_bytes']}")
    return lines


def _extract_details(extract: dict[str, Any]) -> list[str]:
    return [f"- extract wall time / encode-only {extract['ratio']:.3f} (target <= {extract.get('target_ratio', 1.1)}); "
            f"write only {extract['write_only_mb_s']:.0f} MB/s"
            + (f"; extract / numpy tofile of the same bytes {extract['extract_vs_tofile']:.2f}x"
               if "extract_vs_tofile" in extract else "")]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


__all__ = ["BENCH_NAMES", "QUICK_FLAGS", "bench_args", "register", "run", "write_report"]
