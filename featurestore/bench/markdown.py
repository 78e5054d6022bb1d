"""``report.md`` of ``featurestore bench all``: the summary table and each bench's details."""

from __future__ import annotations

from typing import Any

from featurestore.bench.summary import _guarded, rss_series, throughput_rows


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
    if report.get("gate"):  # bench all --check: the figures against the speed targets
        header, *rows = report["gate"]
        lines += ["", "## Targets (docs/BENCHMARKS.md)", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
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
                     ("cold", _cold_details), ("bags", _bags_details)):
        lines += _guarded(report, name, fn, [])
    return ["", "## Other figures", "", *lines] if lines else []


def _read_details(read: dict[str, Any]) -> list[str]:
    return [f"- read [{'x'.join(map(str, shape['sample_shape']))}] (warm): featurestore / np.memmap paired per "
            f"repeat, median {shape['median_paired_vs_memmap']:.2f}x (target >= 1.0x); first pass with crc32c "
            f"checks {shape['verify']['ratio']:.2f}x the unchecked one" for shape in read["shapes"]]


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


def _bags_details(bags: dict[str, Any]) -> list[str]:
    parts = []
    for name, value in bags["ratios"].items():
        target = bags["targets"].get(name)
        parts.append(f"{name} {value:.2f}x" + (f" (target >= {target}x)" if target is not None else ""))
    note = ("" if "import vs h5 read" in bags["ratios"] else "; import not measured")
    return [f"- bags: {bags['slides']} slides (median {bags['median_patches']}, max {bags['max_patches']} patches, "
            f"dim {bags['dim']}, featurestore {bags['sizes']['store'] / 2**30:.2f} GiB), featurestore / baseline "
            "pass time (CLAM .pt reads float32 features only: twice the bytes): " + "; ".join(parts) + note]


def _extract_details(extract: dict[str, Any]) -> list[str]:
    return [f"- extract wall time / encode-only {extract['ratio']:.3f} (target <= {extract.get('target_ratio', 1.1)}); "
            f"write only {extract['write_only_mb_s']:.0f} MB/s"
            + (f"; extract / numpy tofile of the same bytes {extract['extract_vs_tofile']:.2f}x"
               if "extract_vs_tofile" in extract else "")]


def _s3_details(s3: dict[str, Any]) -> list[str]:
    targets = s3.get("targets", {})
    parts = []
    for name, value in s3["ratios"].items():
        target = targets.get(name)
        parts.append(f"{name} {value:.2f}x" + (f" (target >= {target}x)" if target is not None else ""))
    return [f"- s3 ({s3['cache']}): " + "; ".join(parts)]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
