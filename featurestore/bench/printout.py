"""What ``featurestore bench NAME`` prints at its end: a result's rows, its figures against their
targets (featurestore/bench/targets.json) and its notes; and the ``--json`` it writes.

Apart from :mod:`featurestore.bench.reading` (which reads a result) and
:mod:`featurestore.bench.gate` (which reads the targets and checks a report), since it needs both.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from featurestore.bench.gate import load_targets, number
from featurestore.bench.reading import Figures, read_result


def figure_lines(name: str, bench: str, figures: Figures, *, variants: bool = False) -> list[str]:
    """Every figure with its spread and its targets in ``targets.json``: those of this entry (``name``:
    the bench or its variant), or with ``variants`` (a run of ``featurestore bench NAME``, whose flags
    may be any variant's) every target of the bench, each named."""
    targets = [t for t in load_targets().targets if (t.bench == bench if variants else t.run == name)]
    lines = []
    for fig, f in figures.items():
        found = [t for t in targets if fig == t.figure or fig.startswith(t.figure + "[")]
        unit = found[0].unit if found else "x"
        spread = f" (repeats {number(f['spread'][0], unit)} - {number(f['spread'][1], unit)})" if f["spread"] else ""
        lines.append(f"- {name}.{fig}: {number(f['value'], unit)}{spread}" + "".join(
            f"; target {t.id} {t.text()}: {'ok' if t.met(f['value']) else 'MISSED'} ({t.what})" for t in found))
    return lines


def print_result(bench: str, result: dict[str, Any]) -> None:
    """What ``featurestore bench NAME`` prints at its end: rows (as report.md's tables), figures, notes."""
    reading = read_result(bench, result)
    for title, bars in reading.rows.items():
        print(f"[{bench}] {title}; {bars[0][0]} / method:")
        for name, rate in bars:
            print(f"  {name:<40} {rate:9.3f}  {bars[0][1] / rate if rate else float('nan'):6.2f}x")
    for line in figure_lines(bench, bench, reading.figures, variants=True) + reading.notes:
        print(line)
    if reading.error:
        print(f"(could not read all of {bench}'s result: {reading.error})")


def finish(bench: str, result: dict[str, Any], json_out: str | None,
           failed: Callable[[dict[str, Any]], str | None] | None = None) -> int:
    """The end of ``featurestore bench NAME``: print, write ``--json``; 1 when ``failed(result)`` says why."""
    print_result(bench, result)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2, default=lambda v: v.item() if hasattr(v, "item") else str(v))
    why = failed(result) if failed else None
    if why:
        print(f"featurestore: error: bench {bench} failed: {why}")
    return 1 if why else 0


__all__ = ["figure_lines", "finish", "print_result"]
