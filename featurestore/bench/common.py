"""Small helpers shared by the benchmarks (timing, page-cache warm-up, memory readings)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"256x384,1024x1536"`` -> [(256, 384), (1024, 1536)]."""
    shapes = []
    for part in text.split(","):
        try:
            shapes.append(tuple(int(v) for v in part.strip().lower().split("x")))
        except ValueError:
            raise ValueError(f"bad shape {part!r} in {text!r}: write shapes as TxD, e.g. 256x384,1024x1536") from None
    return shapes


class CpuClock:
    """CPU seconds (user + system) spent so far by this process and, if given, by another one
    (a server on the same machine, read from ``/proc``; None where that cannot be read). On a
    machine shared with other work a run's seconds swing with the load; its CPU seconds do not."""

    def __init__(self, other_pid: int | None = None) -> None:
        self.other_pid = other_pid

    def read(self) -> tuple[float, float | None]:
        return time.process_time(), (None if self.other_pid is None else process_cpu_seconds(self.other_pid))


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def timed_batches(fn: Callable[[np.ndarray], Any], n: int, batch_size: int, batches: int, *, seed: int) -> float:
    """Seconds for ``batches`` calls of ``fn`` on shuffled index batches (one warm-up call first)."""
    rng = np.random.default_rng(seed)
    orders = [rng.choice(n, size=batch_size, replace=False) for _ in range(batches + 1)]
    fn(orders[0])
    start = time.perf_counter()
    for order in orders[1:]:
        fn(order)
    return time.perf_counter() - start


def drop_into(path: str) -> None:
    """Read every file under ``path`` once, so later reads come from the page cache."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    buffer = bytearray(8 << 20)
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


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


def save_json(results: dict[str, Any], path: str | None) -> None:
    """Write a bench's results to ``path`` (its ``--json``), if one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)


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
