"""The speed gate: a report's figures against ``targets.json``, one table, a non-zero exit on a miss
(``bench all --check``, ``bench check REPORT.json``). The file's fields and what "not measured"
means: docs/BENCHMARKS.md, "The gate" and "The targets file".
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from featurestore.bench.reading import FIGURE_BENCHES as BENCH_NAMES
from featurestore.bench.reading import read_result
from featurestore.errors import InvalidOption

DEFAULT_TARGETS = os.path.join(os.path.dirname(__file__), "targets.json")
OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}
UNITS = ("x", "%", "ms", "MiB", "")
CACHES = ("warm", "cold", "disk", "none")
SKIPPED = "not in the bench's result (that part skipped?)"
FIELDS = ("id", "bench", "figure", "op", "threshold", "unit", "cache", "what")


@dataclass(frozen=True)
class Target:
    id: str
    bench: str
    figure: str
    op: str
    threshold: float
    unit: str
    cache: str
    what: str
    variant: str | None = None

    @property
    def run(self) -> str:
        """The report entry that measures it: the bench itself, or its variant's entry."""
        return self.variant or self.bench

    def text(self) -> str:
        return f"{self.op} {number(self.threshold, self.unit)}"

    def met(self, value: float | None) -> bool:
        return value is not None and OPS[self.op](value, self.threshold)


@dataclass
class Targets:
    targets: list[Target]
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # per bench, the flags that say what a run measures (an encoder, a sample shape), not how much of it
    identity: dict[str, list[str]] = field(default_factory=dict)

    def runs_matching(self, bench: str, parser: argparse.ArgumentParser, args: argparse.Namespace) -> set[str] | None:
        """The entries (the bench's default run, its variants) whose targets a lone ``featurestore bench
        NAME`` run with ``args`` measures: those with the same values of the bench's identity flags
        (a GPU run of a timm encoder is not judged by the CPU ``builtin:vit-s14`` target). None: all."""
        flags = self.identity.get(bench)
        if not flags:
            return None
        dests = [action.dest for action in parser._actions if set(action.option_strings) & set(flags)]
        runs = {bench: [], **{name: v["args"] for name, v in self.variants.items() if v["bench"] == bench}}
        return {name for name, argv in runs.items()
                if all(getattr(parser.parse_args(argv), d) == getattr(args, d) for d in dests)}

    def select(self, only: str | None) -> list[Target]:
        if only is None:
            return list(self.targets)
        ids = [part.strip() for part in only.split(",") if part.strip()]
        known = {t.id: t for t in self.targets}
        unknown = [i for i in ids if i not in known]
        if unknown or not ids:
            raise InvalidOption(f"--only {only!r}: unknown target id(s) {', '.join(unknown) or '(none given)'}; "
                                f"the targets file names: {', '.join(known)}")
        return [known[i] for i in dict.fromkeys(ids)]


def load_targets(path: str | None = None) -> Targets:
    """Parse and check the targets file (default: the one shipped in the package)."""
    path = path or DEFAULT_TARGETS
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as error:
        raise InvalidOption(f"--targets {path}: cannot read it as JSON ({error}); give a targets file like "
                            f"{DEFAULT_TARGETS}") from None
    if not isinstance(data, dict) or not isinstance(data.get("variants", {}), dict) \
            or not isinstance(data.get("targets", []), list):
        raise InvalidOption(f"--targets {path}: not a targets file (an object with a 'targets' list and a "
                            "'variants' object)")
    variants = data.get("variants", {})
    for name, variant in variants.items():
        if name in BENCH_NAMES or variant.get("bench") not in BENCH_NAMES or not isinstance(variant.get("args"), list):
            raise InvalidOption(f"--targets {path}: variant {name!r} needs a name other than a bench's, a bench of "
                                f"{','.join(BENCH_NAMES)} and an args list")
    identity = data.get("identity", {})
    if not isinstance(identity, dict) or any(b not in BENCH_NAMES or not isinstance(f, list) or
                                             not all(isinstance(x, str) and x.startswith("--") for x in f)
                                             for b, f in identity.items()):
        raise InvalidOption(f"--targets {path}: 'identity' needs an object of a bench of {','.join(BENCH_NAMES)} "
                            "to a list of its flags (\"--encoder\")")
    targets: list[Target] = []
    for raw in data.get("targets", []):
        problem = _problem(raw, {t.id for t in targets}, variants)
        if problem:
            name = raw.get("id", raw) if isinstance(raw, dict) else raw
            raise InvalidOption(f"--targets {path}: target {name!r} {problem}")
        targets.append(Target(**{k: raw[k] for k in FIELDS}, variant=raw.get("variant")))
    if not targets:
        raise InvalidOption(f"--targets {path}: no targets in it (a 'targets' list of objects with "
                            f"{', '.join(FIELDS)})")
    return Targets(targets, variants, identity)


def _problem(raw: Any, seen: set[str], variants: dict[str, Any]) -> str:
    """What is wrong with one target of the file ('' when nothing)."""
    if not isinstance(raw, dict):
        return f"is not an object with {', '.join(FIELDS)}"
    missing = [k for k in FIELDS if k not in raw]
    if missing:
        return f"lacks {', '.join(missing)}"
    if raw["op"] not in OPS:
        return f"has op {raw['op']!r} (use one of {' '.join(OPS)})"
    if isinstance(raw["threshold"], bool) or not isinstance(raw["threshold"], (int, float)) \
            or not math.isfinite(raw["threshold"]):
        return f"has threshold {raw['threshold']!r} (a finite number)"
    if raw["unit"] not in UNITS or raw["cache"] not in CACHES:
        return (f"has unit {raw['unit']!r} and cache {raw['cache']!r} (units: {', '.join(map(repr, UNITS))}; "
                f"caches: {', '.join(CACHES)})")
    if raw["bench"] not in BENCH_NAMES:
        return f"names bench {raw['bench']!r} (not one of {','.join(BENCH_NAMES)})"
    variant = raw.get("variant")
    if variant is not None and variants.get(variant, {}).get("bench") != raw["bench"]:
        return f"names variant {variant!r}, not a variant of bench {raw['bench']!r} in its variants"
    return "repeats an id" if raw["id"] in seen else ""


def runs_needed(targets: list[Target], variants: dict[str, dict[str, Any]],
                quick: bool) -> dict[str, tuple[str, list[str] | None]]:
    """Per report entry the targets need: ``(bench, flags)``; flags None: the bench's own (or --quick's)."""
    runs: dict[str, tuple[str, list[str] | None]] = {b: (b, None) for b in BENCH_NAMES
                                                      if any(t.bench == b and not t.variant for t in targets)}
    for t in targets:
        if t.variant:
            v = variants[t.variant]
            runs[t.variant] = (v["bench"], list(v.get("quick", v["args"]) if quick else v["args"]))
    return runs


@dataclass
class Row:
    target: Target
    figure: str
    measured: float | None = None
    spread: list[float] | None = None
    status: str = "not measured"
    fails: bool = True  # False when met, or not measured under --allow-missing


def check(report: dict[str, Any], targets: list[Target], *, allow_missing: bool = False) -> list[Row]:
    """One row per target and measured shape; ``status``: ok, MISSED, or 'not measured: why'."""
    rows = []
    absent = "not measured (allowed): " if allow_missing else "not measured: "
    for t in targets:
        entry, found, why = report.get("benches", {}).get(t.run), {}, "bench not run"
        if entry is not None and not entry.get("result"):
            why = f"bench failed ({entry.get('error', '?')})"
        elif entry is not None and "figures" not in entry:  # a report from before the figures were stored
            reading = read_result(entry.get("bench", t.bench), entry["result"])
            found, why = reading.figures, f"figures unreadable: {reading.error}" if reading.error else SKIPPED
        elif entry is not None:
            found, why = entry["figures"], entry.get("figures_error") or SKIPPED
        # A per-shape figure (a target naming ``name`` alone): every shape the run measured.
        names = [t.figure] if t.figure in found else sorted(
            k for k in found if "[" not in t.figure and k.startswith(t.figure + "["))
        if not names:
            rows.append(Row(t, f"{t.run}.{t.figure}", status=absent + why, fails=not allow_missing))
        for name in names:
            value, spread = found[name]["value"], found[name].get("spread")
            met = t.met(value)
            rows.append(Row(t, f"{t.run}.{name}", value, spread, "ok" if met else "MISSED", fails=not met))
    return rows


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    text = f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return f"{text}{unit}" if unit in ("x", "%") else f"{text} {unit}".rstrip()


def table(rows: list[Row]) -> list[list[str]]:
    """Header and one line per row: target id, figure, cache, target, measured, spread, ok."""
    lines = [["id", "figure", "cache", "target", "measured", "spread", "ok"]]
    for r in rows:
        spread = "-" if not r.spread else f"{number(r.spread[0], r.target.unit)} - {number(r.spread[1], r.target.unit)}"
        lines.append([r.target.id, r.figure, r.target.cache, r.target.text(), number(r.measured, r.target.unit),
                      spread, r.status])
    return lines


def verdict(rows: list[Row]) -> int:
    """Print the table and the verdict; 0 when every target is met, else 1 naming the misses (missed,
    or not measured without --allow-missing)."""
    cells = table(rows)
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    print("\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]]))
    misses, targets = list(dict.fromkeys(r.target.id for r in rows if r.fails)), len({r.target.id for r in rows})
    if misses:
        print(f"featurestore: error: {len(misses)} of {targets} target(s) missed: {', '.join(misses)}", file=sys.stderr)
        return 1
    print(f"[bench gate] all {targets} target(s) met")
    return 0


def add_target_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", default=None,
                        help=f"targets file (default: the shipped {os.path.basename(DEFAULT_TARGETS)})")
    parser.add_argument("--only", default=None, help="comma-separated target ids to check (default: every target)")
    parser.add_argument("--allow-missing", action="store_true",
                        help="a target whose figure was not measured (bench skipped or not run) does not fail")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check", help="check an existing bench all report.json against the speed targets (no bench is run)",
        description="Print one table (id / figure / cache / target / measured / spread / ok) of a "
        "report.json from `featurestore bench all` against the targets file; exit 1 when a target is missed "
        "or not measured (unless --allow-missing).")
    parser.add_argument("report", help="report.json written by featurestore bench all")
    add_target_flags(parser)
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    targets = load_targets(args.targets)
    try:
        with open(args.report, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as error:
        raise InvalidOption(f"{args.report}: cannot read it as a bench all report.json ({error})") from None
    if not isinstance(report, dict) or not isinstance(report.get("benches"), dict):
        raise InvalidOption(f"{args.report}: not a bench all report.json (no 'benches' object)")
    return verdict(check(report, targets.select(args.only), allow_missing=args.allow_missing))
