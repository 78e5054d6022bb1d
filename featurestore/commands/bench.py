"""``featurestore bench``: throughput and memory against baselines, one sub-command per module of
``featurestore/bench/`` (docs/BENCHMARKS.md)."""

from __future__ import annotations

from typing import Any

from featurestore.bench import bench_module
from featurestore.commands.parsers import add_debug

BENCHES = ("read", "write", "http", "loader", "bag_loader", "extract", "cold", "s3", "bags", "web", "report", "gate")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="throughput and memory vs baselines (read, write, http, loader, bag-loader, extract, cold, s3, bags, web, all, check)",
        description="Benchmarks that print figures measured side by side in one run.",
    )
    benches = parser.add_subparsers(dest="bench", metavar="BENCH")
    benches.required = True
    for name in BENCHES:
        module = bench_module(name)
        module.register(benches)
    for sub in (parser, *benches.choices.values()):  # --debug after the bench's name too, as after every verb
        add_debug(sub)
