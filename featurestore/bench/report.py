"""What a bench's result becomes: what ``featurestore bench NAME`` prints (:func:`finish`), and
``featurestore bench all``, which runs every benchmark and writes ``report.md`` and ``report.json``.

Each bench runs in this process through its own ``run(args)``, with the defaults of its own parser
(so ``bench all`` never drifts from ``bench NAME``) or the small sizes of ``--quick``. A bench that
raises (or whose own check fails) is recorded as failed in both reports, the others still run, and
the command exits 1 at the end: a failure is never silently dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from featurestore import __version__
from featurestore.bench import bench_module, gate
from featurestore.bench.gate import number
from featurestore.bench.reading import FIGURE_BENCHES as BENCH_NAMES
from featurestore.bench.reading import Figures, Panels, Reading, read_result
from featurestore.core.swallowed_stops import redelivered
from featurestore.errors import InvalidOption, Stopped

# Small sizes for CI and a first look: each bench finishes in seconds, the figures are noisy.
QUICK_FLAGS: dict[str, list[str]] = {
    "read": ["--shapes", "256x384", "--gib", "0.03", "--batches", "10", "--repeats", "1"],
    "write": ["--shapes", "256x384", "--mb", "8", "--repeats", "1"],
    "http": ["--num-samples", "192", "--batches", "6", "--repeats", "1", "--items", "30",
             "--load-seconds", "2", "--clients", "4"],
    "loader": ["--shape", "64x384", "--num-samples", "64", "--repeats", "1", "--skip-cgroup"],
    "extract": ["--n", "64", "--image-size", "64", "--repeats", "1"],
    "s3": ["--num-samples", "128", "--slow-batches", "2", "--repeats", "1", "--bags", "6",
           "--bag-median", "300", "--bag-dim", "256"],
    "cold": ["--shapes", "64x384", "--batch-sizes", "16", "--limit-mib", "512", "--store-ratio", "0.1",
             "--cuda", "off", "--repeats", "1"],
    "bags": ["--gib", "0.005", "--dim", "256", "--median", "100", "--max", "1000", "--min", "10"],
    "bag_loader": ["--bags", "6", "--patches", "100", "--dim", "256", "--repeats", "1"],
    "web": ["--splits", "5", "--dim", "16", "--tokens", "16", "--samples", "2", "--repeats", "2"],
}


def figure_lines(name: str, bench: str, figures: Figures, *, variants: bool = False,
                 runs: set[str] | None = None) -> list[str]:
    """Every figure with its spread and its targets in ``targets.json``: those of this entry (``name``:
    the bench or its variant), or with ``variants`` (a run of ``featurestore bench NAME``, whose flags
    may be any variant's) every target of the bench, each named, or only those of ``runs`` (the
    entries measured with this run's identity flags: :meth:`gate.Targets.runs_matching`)."""
    loaded = gate.load_targets()
    every = loaded.targets
    targets = [t for t in every if (t.bench == bench and (runs is None or t.run in runs) if variants else t.run == name)]
    lines = []
    if variants and runs is not None and (other := [t.id for t in every if t.bench == bench and t.run not in runs]):
        lines.append(f"- targets not checked: {', '.join(other)} (measured with other "
                     f"{', '.join(loaded.identity[bench])} than this run's)")
    for fig, f in figures.items():
        found = [t for t in targets if fig == t.figure or fig.startswith(t.figure + "[")]
        # a variant's figure that only the bench's own targets name: their unit
        units = [t.unit for t in found or every if t.bench == bench and (fig == t.figure or fig.startswith(t.figure + "["))]
        unit = units[0] if units else "x"
        spread = f" (repeats {number(f['spread'][0], unit)} - {number(f['spread'][1], unit)})" if f["spread"] else ""
        lines.append(f"- {name}.{fig}: {number(f['value'], unit)}{spread}" + "".join(
            f"; target {t.id} {t.text()}: {'ok' if t.met(f['value']) else 'MISSED'} ({t.what})" for t in found))
    return lines


def print_result(bench: str, result: dict[str, Any], reading: Reading | None = None, run: str | None = None,
                 runs: set[str] | None = None) -> None:
    """What ``featurestore bench NAME`` prints at its end: rows (as report.md's tables), figures, notes;
    ``run``: the entry of ``bench all`` it is (the bench or one of its variants), whose targets alone
    are checked, under its name."""
    reading = reading or read_result(bench, result)
    for title, bars in reading.rows.items():
        print(f"[{bench}] {title}; {bars[0][0]} / method:")
        for name, rate in bars:
            print(f"  {name:<40} {rate:9.3f}  {bars[0][1] / rate if rate else float('nan'):6.2f}x")
    lines = figure_lines(run, bench, reading.figures) if run else figure_lines(bench, bench, reading.figures,
                                                                               variants=True, runs=runs)
    for line in lines + reading.notes:
        print(line)
    if reading.error:
        print(f"(could not read all of {bench}'s result: {reading.error})")


def finish(bench: str, result: dict[str, Any], json_out: str | None,
           failed: Callable[[dict[str, Any]], str | None] | None = None, runs: set[str] | None = None) -> int:
    """The end of ``featurestore bench NAME``: print (the targets of ``runs`` alone, where given), write
    ``--json``; 1 when ``failed(result)`` says why."""
    print_result(bench, result, runs=runs)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(_jsonable(result), f, indent=2)
    why = failed(result) if failed else None
    if why:
        print(f"featurestore: error: bench {bench} failed: {why}")
    return 1 if why else 0


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "all", help="run every bench; write report.md and report.json",
        description=f"Run the {', '.join(BENCH_NAMES)} benches with their default arguments (or small ones with "
        "--quick) and write report.md and report.json into --out. A failed bench is reported with its error and "
        "makes the exit status 1. With --check, run the benches the speed targets need (docs/BENCHMARKS.md), print "
        "one table of figure / target / measured / spread / ok and exit 1 when a target is missed.")
    parser.add_argument("--out", default="bench-out", help="output directory (default ./bench-out)")
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds per bench, noisy figures")
    parser.add_argument("--benches", default=None,
                        help=f"comma-separated subset of {','.join(BENCH_NAMES)} (default: all; with --check, "
                        "the benches and variants the selected targets need)")
    parser.add_argument("--check", action="store_true",
                        help="check the figures against the speed targets; exit 1 on a miss (docs/BENCHMARKS.md)")
    gate.add_target_flags(parser)
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    # SIGTERM (a job's time limit, `kill`) as Ctrl-C: the benches' scratch directories and child
    # servers go, and what finished is reported (run()). Only while the benches run: a process
    # that calls main() and goes on (a test session) keeps its own SIGTERM, and so do the
    # processes it forks later (a pool worker that raised KeyboardInterrupt on terminate() instead
    # of dying could leave its parent waiting in join()).
    with stop_on_sigterm():
        return _bench_all(args)


def _bench_all(args: argparse.Namespace) -> int:
    if not args.check and (args.only or args.targets or args.allow_missing):
        raise InvalidOption("--targets, --only and --allow-missing go with --check: add --check, or drop them")
    rows: list[Any] = []
    runs = None
    if args.check:
        targets = gate.load_targets(args.targets)
        selected = targets.select(args.only)
        runs = gate.runs_needed(selected, targets.variants, bool(args.quick))
        if args.benches is not None:  # the benches asked for, plus the variants of the targets checked
            runs = {**{n: (n, None) for n in parse_benches(args.benches)},
                    **{k: v for k, v in runs.items() if k not in BENCH_NAMES}}

        def check(report: dict[str, Any]) -> None:
            rows.extend(gate.check(report, selected, allow_missing=args.allow_missing))
            report["gate"] = gate.table(rows)

    report = run(args, runs=runs, before_write=check if args.check else None)
    failed = [name for name, entry in report["benches"].items() if entry["status"] != "ok"]
    print(f"\n[bench all] wrote {', '.join(report['files'])} into {os.path.abspath(args.out)}")
    status = gate.verdict(rows) if args.check else 0
    if failed:
        print(f"featurestore: error: bench(es) failed: {', '.join(failed)} (see report.md)", file=sys.stderr)
        return 1
    return status


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises :class:`~featurestore.errors.Stopped` (a KeyboardInterrupt) in the main
    thread while this lasts, again if Python swallowed it (:mod:`featurestore.core.swallowed_stops`)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with redelivered():
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def parse_benches(text: str) -> list[str]:
    names = [part.strip().replace("-", "_") for part in text.split(",") if part.strip()]  # bag-loader: the verb
    unknown = [n for n in names if n not in BENCH_NAMES]
    if unknown or not names:
        raise InvalidOption(f"--benches takes a comma-separated subset of {','.join(BENCH_NAMES)}, but got: {text!r}"
                            + (f" ({', '.join(unknown)} unknown; a target's variant runs through --check)"
                               if unknown else ""))
    return list(dict.fromkeys(names))  # drop duplicates, keep the order given


def bench_args(name: str, extra: Sequence[str] = ()) -> argparse.Namespace:
    """The bench's own parser, parsed from ``extra`` flags only: its defaults, not a copy of them."""
    module = bench_module(name)
    parser = argparse.ArgumentParser(prog="featurestore bench")
    module.register(parser.add_subparsers(dest="bench"))
    return parser.parse_args([name.replace("_", "-"), *extra])  # bag_loader's verb is bag-loader


def run(args: argparse.Namespace, runs: dict[str, tuple[str, list[str] | None]] | None = None,
        before_write: Any = None) -> dict[str, Any]:
    """Run the benches named in ``args.benches`` (or ``runs``: per report entry, the bench and its
    flags, None for its own defaults or --quick's); call ``before_write(report)``; write the
    reports into ``args.out``; return the report dict (also what ``report.json`` holds)."""
    if runs is None:
        runs = {n: (n, None) for n in parse_benches(getattr(args, "benches", None) or ",".join(BENCH_NAMES))}
    quick = bool(getattr(args, "quick", False))
    os.makedirs(args.out, exist_ok=True)
    report: dict[str, Any] = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # What was typed (main() keeps it), so the report says how to run it again.
        "command": shlex.join(["featurestore", *getattr(args, "argv", ["bench", "all"])]),
        "quick": quick, "machine": machine_info(), "benches": {}, "files": [],
    }
    for key, (name, flags) in runs.items():
        print(f"\n[bench all] === {key} ===", flush=True)
        entry: dict[str, Any] = {"status": "failed", "bench": name}
        started = time.perf_counter()
        try:
            bench = bench_args(name, flags if flags is not None else QUICK_FLAGS[name] if quick else [])
            if flags is not None:
                entry["flags"] = flags
            entry["args"] = {k: v for k, v in vars(bench).items() if k not in ("func", "bench")}
            module = bench_module(name)
            entry["result"] = result = module.run(bench)
            reading = read_result(name, result)  # the gate's figures; a result whose keys changed is noted
            entry["figures"] = reading.figures
            if reading.error:
                entry["figures_error"] = f"figures unreadable: {reading.error}"
            print_result(name, result, reading, run=key)  # as featurestore bench NAME prints it
            if why := getattr(module, "failed", lambda _: None)(result):  # e.g. http's load test errors
                raise RuntimeError(f"the bench reported failure: {why}")
            entry["status"] = "ok"
        except Exception as error:  # recorded, reported, and turned into exit status 1 at the end
            entry["error"] = f"{type(error).__name__}: {error}"
            entry["traceback"] = traceback.format_exc()
            print(f"[bench all] {name} FAILED: {entry['error']}", file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the benches already done are still reported
            entry["error"] = "interrupted"
            entry["seconds"] = time.perf_counter() - started
            report["benches"][key] = entry
            report["interrupted"] = True
            report["files"] = write_report(report, args.out)
            print(f"[bench all] interrupted during {key}: wrote what finished before it into "
                  f"{os.path.abspath(args.out)}", file=sys.stderr, flush=True)
            raise
        entry["seconds"] = time.perf_counter() - started
        report["benches"][key] = entry
    if before_write is not None:
        before_write(report)
    report["files"] = write_report(report, args.out)
    return report


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"featurestore": __version__, "platform": platform.platform(),
                            "python": platform.python_version(),
                            "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine()}
    with contextlib.suppress(OSError):
        info["load_average"] = [round(v, 2) for v in os.getloadavg()]
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["torch"] = None
    return info


def _readings(report: dict[str, Any]) -> dict[str, tuple[str, Reading]]:
    """Per report entry: its bench and the one reading of its result; a result whose keys changed
    is noted in ``render_errors``."""
    readings = {}
    for name, entry in report["benches"].items():
        bench = entry.get("bench", name)
        readings[name] = bench, read_result(bench, entry.get("result"))
        if readings[name][1].error:
            report.setdefault("render_errors", {})[name] = readings[name][1].error
    return readings


def throughput_rows(report: dict[str, Any], readings: dict[str, tuple[str, Reading]] | None = None) -> Panels:
    """Per panel title: ``(method, rate)`` pairs, featurestore first, of every entry in the report (a
    variant's panels titled with its entry's name)."""
    return {(title if name == bench else f"{name}: {title}"): bars for name, (bench, reading) in
            (readings or _readings(report)).items() for title, bars in reading.rows.items()}


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown section holding one table (cells flattened to one line, ``|`` escaped)."""
    return ["", f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(" ".join(str(c).split()).replace("|", "\\|") for c in row) + " |" for row in rows)]


def render_markdown(report: dict[str, Any]) -> str:
    """``report.md``: status, the gate's table, each entry's rows, figures and notes, memory, failures."""
    m = report["machine"]
    readings = _readings(report)
    lines = ["# featurestore benchmark report", "", f"- command: `{report['command']}`",
             f"- created: {report['created']}",
             f"- machine: {m.get('cpu_count')} CPUs, {m.get('platform')}, Python {m.get('python')}, torch "
             f"{m.get('torch')}, CUDA {m.get('cuda') or 'none'}, load average {m.get('load_average')}",
             "- ratios are taken side by side in one run (repeats interleaved; best or median, as each bench reports), "
             "because a shared machine is noisy; absolute GB/s move from run to run."]
    lines += _table("Status", ("bench", "status", "seconds"), [
        (name, "ok" if entry["status"] == "ok" else f"**FAILED**: {entry.get('error', '')}",
         f"{entry.get('seconds', 0):.1f}")
        for name, entry in report["benches"].items()])
    if report.get("gate"):  # bench all --check: figures against the targets
        lines += _table("Targets (docs/BENCHMARKS.md)", report["gate"][0], report["gate"][1:])
    for title, bars in throughput_rows(report, readings).items():  # featurestore's rate (first row) over each method's
        lines += _table(title, ("method", "rate", f"{bars[0][0]} ÷ method"),
                        [(name, f"{rate:.3g}", f"{bars[0][1] / rate:.2f}x" if rate else "") for name, rate in bars])
    other = [line for name, (bench, reading) in readings.items() for line in figure_lines(
        name, bench, reading.figures, variants="bench" not in report["benches"][name]) + reading.notes]
    lines += ["", "## Other figures", "", *other] if other else []
    if report.get("render_errors"):
        lines += ["", "## Report notes", "", "Results the report could not read all of:", "",
                  *(f"- {where}: {error}" for where, error in report["render_errors"].items())]
    failed = {n: e for n, e in report["benches"].items() if e["status"] != "ok"}
    lines += ["", "## Failures", ""] if failed else []
    for name, entry in failed.items():
        lines += [f"### {name}", "", "```", entry.get("traceback", entry.get("error", "")).rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: str) -> list[str]:
    """Write ``report.md`` and ``report.json`` into ``out``; return the file names."""
    report["files"] = ["report.md", "report.json"]
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
