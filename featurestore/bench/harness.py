"""What every bench shares: methods timed side by side, cold runs, child processes, one printout.

* :class:`Method` and :func:`interleaved`: each repeat runs every method once, in turn (so a slow
  moment of a shared machine hits all of them alike); :class:`Times` keeps every repeat, and gives
  the median, the best and the per-repeat pairs of two methods (a figure's spread).
* :func:`evict` (``posix_fadvise(DONTNEED)``: cold) and :func:`warm` (read once: page-cached);
  a memory limit comes from :class:`featurestore.bench.cgroup.MemoryCgroup`.
* :func:`child`: ``featurestore.bench.MODULE:FUNCTION(config)`` in a fresh interpreter (optionally
  inside a cgroup), its JSON result back: the one protocol of every bench's subprocesses.
* :func:`print_rows`: one table of methods, their rates and ratios to a reference.
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.bench.cgroup import evict

__all__ = ["Method", "RssPeak", "Times", "child", "child_process", "evict", "gbps", "interleaved", "parse_shapes",
           "print_rows", "rss_anon_bytes", "save_json", "stop_process", "timed", "unmap", "verdicts", "warm"]


@dataclass
class Method:
    """One way of doing the measured work. ``run()`` is timed; it may return its own measurement
    (a child's seconds, a rate), which is kept instead of the elapsed seconds. ``setup`` and
    ``teardown`` run untimed around every call (an eviction, a fresh output directory)."""

    name: str
    run: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[], Any] | None = None

    def once(self) -> float:
        if self.setup:
            self.setup()
        start = time.perf_counter()
        value = self.run()
        elapsed = time.perf_counter() - start
        if self.teardown:
            self.teardown()
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else elapsed


class Times(dict[str, list[float]]):
    """Per method, its value in each repeat (seconds, unless its ``run`` returned a measurement)."""

    def median(self, name: str) -> float:
        return float(statistics.median(self[name]))

    def best(self, name: str) -> float:
        """The smallest value: the best time (for rates, use ``max(times[name])``)."""
        return float(min(self[name]))

    def medians(self) -> dict[str, float]:
        return {name: self.median(name) for name in self if self[name]}

    def pairs(self, numerator: str, denominator: str) -> list[float]:
        """``numerator[i] / denominator[i]`` per repeat, the two measured back to back."""
        return [a / b for a, b in zip(self[numerator], self[denominator]) if b]


def interleaved(methods: Sequence[Method], repeats: int, *, warmup: int = 0,
                order: Callable[[int, list[Method]], Iterable[Method]] | None = None) -> Times:
    """Run ``warmup`` untimed rounds, then ``repeats`` rounds of every method once, each round in
    ``order(round, methods)`` (default: as given)."""
    times = Times({m.name: [] for m in methods})
    for repeat in range(-warmup, max(1, repeats)):
        for method in (order(repeat, list(methods)) if order else methods):
            value = method.once()
            if repeat >= 0:
                times[method.name].append(value)
    return times


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def unmap() -> None:
    """Close this process's maps of chunk files: a page still mapped is not dropped by :func:`evict`."""
    from featurestore.core import chunk_maps

    chunk_maps.shared().clear()


def warm(*paths: str) -> None:
    """Read every file under ``paths`` once, so later reads come from the page cache."""
    buffer = bytearray(8 << 20)
    for path in paths:
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
        for name in files:
            with open(name, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass


# ---------------------------------------------------------------------- child processes
def child_process(function: str, config: Any, *, cgroup: Any = None) -> subprocess.CompletedProcess[str]:
    """Run ``featurestore.bench.MODULE:FUNCTION(config)`` in a fresh interpreter (inside ``cgroup``,
    a :class:`~featurestore.bench.cgroup.MemoryCgroup`, if given); its stdout's last line is the
    JSON of the return value. The completed process, whatever its exit status."""
    command = [sys.executable, "-m", "featurestore.bench.harness", function, json.dumps(config)]
    if cgroup is not None:
        return cgroup.run(command)  # type: ignore[no-any-return]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def child(function: str, config: Any, *, cgroup: Any = None) -> Any:
    """:func:`child_process`'s result; raises with the child's stderr when it failed."""
    done = child_process(function, config, cgroup=cgroup)
    if done.returncode != 0:
        raise RuntimeError(f"bench child {function} failed (exit status {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_main(function: str, config: str) -> None:
    module, name = function.split(":")
    result = getattr(importlib.import_module(f"featurestore.bench.{module}"), name)(json.loads(config))
    print(json.dumps(result))


# ---------------------------------------------------------------------- memory
def rss_anon_bytes() -> int:
    """This process's anonymous resident memory (RssAnon), the part a page cache cannot reclaim."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


class RssPeak:
    """Anonymous (and file-backed) RSS sampled every 5 ms on a thread while the block runs:
    ``baseline``, ``peak``, ``peak_file`` and ``samples`` ``(seconds, anon, file)``."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()

    def __enter__(self) -> RssPeak:
        self.baseline = rss_anon_bytes()
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, rss_anon_bytes(), _status_bytes("RssFile")))
            time.sleep(0.005)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self.t0
        self.peak = max([self.baseline, *(s[1] for s in self.samples)])
        self.peak_file = max((s[2] for s in self.samples), default=0)


# ---------------------------------------------------------------------- small helpers
def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"256x384,1024x1536"`` -> [(256, 384), (1024, 1536)]."""
    shapes = []
    for part in text.split(","):
        try:
            shapes.append(tuple(int(v) for v in part.strip().lower().split("x")))
        except ValueError:
            raise ValueError(f"bad shape {part!r} in {text!r}: write shapes as TxD, e.g. 256x384,1024x1536") from None
    return shapes


def save_json(results: dict[str, Any], path: str | None) -> None:
    """Write a bench's results to ``path`` (its ``--json``), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2, default=lambda v: v.item() if hasattr(v, "item") else str(v))


def stop_process(process: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM a server child, SIGKILL it after ``grace`` seconds if still running; reaped."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def print_rows(title: str, rates: dict[str, float], reference: str | None = None, unit: str = "GB/s",
               extra: dict[str, str] | None = None) -> None:
    """``title``, then one line per method: its rate, and its ratio to ``reference``'s."""
    print(title)
    base = rates.get(reference) if reference else None
    for name, rate in rates.items():
        ratio = f"  {rate / base:6.2f}x {reference}" if base else ""
        print(f"  {name:<36} {rate:9.3f} {unit}{ratio}{(extra or {}).get(name, '')}")


def verdicts(ratios: dict[str, float], targets: dict[str, float]) -> None:
    """One line per ratio, with its target (>=) where it has one."""
    for name, value in ratios.items():
        target = targets.get(name)
        verdict = "" if target is None else f"  (target >= {target}x: {'ok' if value >= target else 'MISSED'})"
        print(f"  {name:<40} {value:7.2f}x{verdict}")


def median_rates(nbytes: float, times: Times) -> dict[str, float]:
    return {name: gbps(nbytes, times.median(name)) for name in times if times[name]}


def paired_median(times: Times, numerator: str, denominator: str) -> float:
    return float(np.median(times.pairs(numerator, denominator)))


if __name__ == "__main__":
    _child_main(sys.argv[1], sys.argv[2])
