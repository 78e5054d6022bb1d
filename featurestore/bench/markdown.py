"""``report.md`` of ``featurestore bench all``: the summary table and each bench's details."""

from __future__ import annotations

from typing import Any

from featurestore.bench.summary import notes, rss_series, throughput_rows


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
    """The figures that are not bars: ratios against targets, latency, stall, memory, cgroup."""
    lines = notes(report)
    return ["", "## Other figures", "", *lines] if lines else []


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
