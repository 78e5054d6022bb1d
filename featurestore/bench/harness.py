"""What every bench shares (docs/BENCHMARKS.md, "The harness"): its parser (:func:`add_bench`), the
parsing of its list flags (:func:`parse_shapes`, :func:`parse_numbers`, :func:`parse_dtypes`) and
its work directory (:func:`scratch`); methods interleaved over repeats (:class:`Method`,
:func:`interleaved`, :class:`Times`: median, best, per-repeat pairs); warm runs (:func:`warm`;
eviction is :mod:`featurestore.testing.cgroup`'s); the one child-process protocol (:func:`child`),
and RSS over fresh children (:func:`rss_runs`; the sampling is :mod:`featurestore.testing.memory`'s);
timed writes to ``os.sync()`` (:func:`write_synced`, :func:`tofile_synced`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import featurestore
from featurestore.errors import InvalidOption
from featurestore.testing.cgroup import files_under

__all__ = ["Method", "Times", "add_bench", "child", "child_process", "child_result", "drain", "feature_bytes", "fresh",
           "gbps", "int8_figures", "interleaved", "number", "parse_dtypes", "parse_numbers", "parse_shapes", "rate",
           "rss_runs", "scratch", "size", "timed", "tofile_synced", "warm", "write_synced"]


def add_bench(subparsers: Any, verb: str, help: str, flags: dict[str, tuple[Any, ...]], *, repeats: int | None = None,
              keep: str = "median", description: str | None = None,
              workdir: str = "scratch directory (default: a temp dir, removed)") -> argparse.ArgumentParser:
    """The parser of ``featurestore bench VERB``: the bench's ``flags``, ``--repeats`` (when given a
    default), ``--workdir`` and ``--json``; the command ends in :func:`report.finish`. ``flags``:
    ``{"--name": (default, help[, other add_argument keywords])}``; a type as the default means none
    (None) of that type, ``False`` a switch; the default is appended to the help. ``description``:
    ``help``, or the first paragraph of it (a module's docstring)."""
    from featurestore.bench import bench_module
    from featurestore.bench.report import finish

    name = verb.replace("-", "_")
    # A module docstring's first paragraph, its reST ``literals`` as plain text for --help.
    about = (description or help).split("\n\n")[0].replace("``", "")
    parser = subparsers.add_parser(verb, help=help, description=about)
    for flag, (default, text, *more) in flags.items():  # a number must be positive, unless `more` sets its type
        kwargs = {"action": "store_true"} if default is False else {"type": default, "default": None} if isinstance(
            default, type) else {"type": number(type(default)) if isinstance(default, (int, float)) else type(default),
                                 "default": default}
        if not isinstance(default, (bool, type)) and default != "" and "default" not in (text or ""):
            text = f"{text} (default {default})" if text else f"default {default}"
        parser.add_argument(flag, help=text, **{**kwargs, **(more[0] if more else {})})
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats,
                            help=f"interleaved repeats; the {keep} is kept (default {repeats})")
    parser.add_argument("--workdir", default=None, help=workdir)
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results here")

    def command(args: argparse.Namespace) -> int:
        from featurestore.bench import gate

        module = bench_module(name)
        runs = gate.load_targets().runs_matching(name, parser, args)  # before the run: a bad file fails fast
        return finish(name, module.run(args), args.json_out, getattr(module, "failed", None), runs)
    parser.set_defaults(func=command)
    return parser


def number(kind: type, low: float = 0, *, inclusive: bool = False) -> Callable[[str], Any]:
    """An argparse type: a number of ``kind`` above ``low`` (at least ``low`` with ``inclusive``)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {'at least' if inclusive else 'more than'} {low:g}")
        return value
    parse.__name__ = kind.__name__  # what argparse calls the type in its messages
    return parse


def fresh(path: str) -> str:
    """``path`` as a new empty directory (what a kept ``--workdir`` held there removed)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


@contextlib.contextmanager
def scratch(args: argparse.Namespace, name: str) -> Iterator[str]:
    """``--workdir`` (kept), or a temp directory (under ``$FEATURESTORE_BENCH_DIR`` if set) removed after."""
    work = args.workdir or tempfile.mkdtemp(prefix=f"fs-bench-{name}-", dir=os.environ.get("FEATURESTORE_BENCH_DIR"))
    try:
        os.makedirs(work, exist_ok=True)
        with tempfile.TemporaryFile(dir=work):  # where the bench can write, or one line now
            pass
    except OSError as error:
        raise InvalidOption(f"--workdir {work}: cannot write there ({error.strerror or error}): give a directory "
                            "the bench may create files in") from None
    try:
        yield work
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


@dataclass
class Method:
    """One way of doing the measured work. ``run()`` is timed; with ``own``, it returns its own
    measurement instead (a child's seconds, a rate), which is kept in place of the elapsed seconds.
    ``setup`` and ``teardown`` run untimed around every call (an eviction, a fresh directory)."""

    name: str
    run: Callable[[], Any]
    setup: Callable[[], Any] | None = None
    teardown: Callable[[], Any] | None = None
    own: bool = False

    def once(self) -> float:
        if self.setup:
            self.setup()
        start = time.perf_counter()
        value = self.run()
        elapsed = time.perf_counter() - start
        if self.teardown:
            self.teardown()
        return float(value) if self.own else elapsed


class Times(dict[str, list[float]]):
    """Per method, its value in each repeat (seconds, or its own measurement: ``Method.own``)."""

    def median(self, name: str) -> float:
        return float(statistics.median(self[name]))

    def medians(self) -> dict[str, float]:
        return {name: self.median(name) for name in self if self[name]}

    def bests(self) -> dict[str, float]:
        """The smallest value of each: its best time (for rates, use ``max(times[name])``)."""
        return {name: float(min(self[name])) for name in self if self[name]}

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


def drain(batches: Iterable[Any]) -> int:
    """One pass over ``batches`` (a loader's epoch), each dropped as it comes; how many there were."""
    return sum(1 for _ in batches)


def rate(fn: Callable[[], Any], nbytes: float) -> Callable[[], float]:
    """A call that runs ``fn`` once and returns GB/s of ``nbytes`` (a :class:`Method` with ``own``)."""
    return lambda: gbps(nbytes, timed(fn))


def warm(*paths: str) -> None:
    """Read every file under ``paths`` once, so later reads come from the page cache: in 128 KiB
    reads, as ``cat`` or ``cp`` do, whose readahead fills it in large folios (8 MiB reads left
    pages that later reads copied 1.3x slower: docs/BENCHMARKS.md, "The harness")."""
    buffer = bytearray(128 << 10)
    for name in files_under(*paths):
        with open(name, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def tofile_synced(path: str, values: np.ndarray) -> float:
    """Seconds of numpy ``tofile`` of ``values`` to ``os.sync()``: the disk's own write rate."""
    start = time.perf_counter()
    values.tofile(path)
    os.sync()
    return time.perf_counter() - start


def write_synced(path: str, values: np.ndarray, batch: int, *, n: int | None = None, chunk_rows: int | None = None,
                 chunk_bytes: int | None = None) -> float:
    """Seconds of the writer writing ``n`` samples (default ``len(values)``; rows of ``values`` taken
    in turn), float16 stored, in batches, committed, to ``os.sync()``."""
    n = len(values) if n is None else n
    start = time.perf_counter()
    writer = featurestore.open_store(path, mode="a").create_split(
        "bench", "write", "s", num_samples=n, sample_shape=tuple(values.shape[1:]), dtype="float16",
        chunk_rows=chunk_rows, chunk_bytes=chunk_bytes)
    for lo in range(0, n, batch):
        writer.write(lo, values[lo % len(values):][: min(batch, n - lo)])
    writer.commit()
    os.sync()
    return time.perf_counter() - start


# ---------------------------------------------------------------------- child processes
def child_process(function: str, config: Any, *, cgroup: Any = None) -> subprocess.CompletedProcess[str]:
    """``featurestore.bench.MODULE:FUNCTION(config)`` in a fresh interpreter (in ``cgroup``, a
    :class:`~featurestore.testing.cgroup.MemoryCgroup`, if given), whatever its exit status."""
    command = [sys.executable, "-m", "featurestore.bench.harness", function, json.dumps(config)]
    if cgroup is not None:
        return cgroup.run(command)  # type: ignore[no-any-return]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def child(function: str, config: Any, *, cgroup: Any = None) -> Any:
    """:func:`child_process`'s result; raises with the child's stderr when it failed."""
    done = child_process(function, config, cgroup=cgroup)
    if done.returncode != 0:
        raise RuntimeError(f"bench child {function} failed (exit status {done.returncode}): {done.stderr[-2000:]}")
    return child_result(done)


def child_result(done: subprocess.CompletedProcess[str]) -> Any:
    """The return value of a child that exited 0: the JSON of its stdout's last line."""
    return json.loads(done.stdout.strip().splitlines()[-1])


def rss_runs(function: str, specs: dict[str, Any], runs: int = 3) -> dict[str, Any]:
    """Per label, the child ``function(spec)`` (an epoch through :func:`testing.memory.rss_epoch`:
    ``baseline_anon``, ``peak_anon``), ``runs`` times in fresh processes, the labels interleaved;
    each number the median over the runs (one process's peak moves by a fifth with its threads'
    timing), the runs kept as ``all``; ``loader_bytes``: per label, its peak over its baseline."""
    results: dict[str, list[dict[str, Any]]] = {label: [] for label in specs}
    for _ in range(max(1, runs)):
        for label, spec in specs.items():
            results[label].append(child(function, spec))
    out: dict[str, Any] = {label: {**rs[0], **{k: statistics.median_low([r[k] for r in rs]) for k, v in rs[0].items()
                                               if isinstance(v, (int, float)) and not isinstance(v, bool)},
                                   "all": rs} for label, rs in results.items()}
    out["loader_bytes"] = {label: out[label]["peak_anon"] - out[label]["baseline_anon"] for label in specs}
    return out


# ---------------------------------------------------------------------- int8 beside float16
def int8_figures(sizes: dict[str, int], reference: str, seconds: dict[str, dict[str, list[float]]], count: int,
                 unit: str) -> dict[str, Any]:
    """int8 beside ``reference`` (the same ``count`` samples or bags, epochs interleaved), per mode of
    ``seconds`` (``{mode: {reference: [s, ...], "int8": [s, ...]}}``): each one's ``unit``/s (median),
    int8's rate over the reference's per repeat and its median; the splits' bytes on storage (``sizes``)."""
    out: dict[str, Any] = {"reference": reference, "split_bytes": sizes,
                           "bytes_ratio": sizes["int8"] / sizes[reference]}
    for mode, times in seconds.items():  # per repeat, the reference's seconds over int8's
        per_repeat = [r / q for r, q in zip(times[reference], times["int8"]) if q]
        out[mode] = {f"{unit}_per_s": {d: count / statistics.median(times[d]) for d in (reference, "int8")},
                     "times_s": dict(times), "ratio_per_repeat": per_repeat,
                     "ratio_median": float(statistics.median(per_repeat))}
    return out


# ---------------------------------------------------------------------- small helpers
def gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def feature_bytes(split_dir: str) -> int:
    """A split's feature bytes on storage: every file of its ``features`` and (int8) ``scales``
    arrays, the part its dtype changes (coords, labels and statistics weigh the same in any dtype)."""
    return size(os.path.join(split_dir, "features"), os.path.join(split_dir, "scales"))


def size(*paths: str) -> int:
    """Bytes of every file under ``paths``."""
    return sum(os.path.getsize(f) for f in files_under(*paths))


def parse_dtypes(text: str, *, numpy_only: bool = False) -> list[str]:
    """``"float16,float32"`` -> the stored dtypes a bench measures in turn, one column each
    (``numpy_only``: no bfloat16, for a bench whose raw twin holds the same bytes). int8 is never a
    column of its own: it is measured beside float16, its reference, so it needs float16 listed."""
    names = [part.strip() for part in str(text).split(",") if part.strip()]
    for name in names or [text]:
        try:
            np.dtype(name) if numpy_only or name != "bfloat16" else None
        except TypeError:
            raise InvalidOption(f"--dtype {text!r}: {name!r} is not a dtype this bench stores; give names such as "
                                "float16,float32") from None
    if "int8" in names and "float16" not in names:
        raise InvalidOption(f"--dtype {text!r}: int8 is measured beside float16 (its reference, epochs "
                            "interleaved); give --dtype float16,int8")
    return list(dict.fromkeys(names))


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``"256x384,1024x1536"`` -> [(256, 384), (1024, 1536)]."""
    shapes = []
    for part in text.split(","):
        try:
            shapes.append(tuple(int(v) for v in part.strip().lower().split("x")))
        except ValueError:
            raise InvalidOption(f"bad shape {part!r} in {text!r}: write shapes as TxD, e.g. 256x384,1024x1536"
                                ) from None
    return shapes


def parse_numbers(flag: str, text: Any, kind: type = float, example: str = "250,384") -> list[Any]:
    """``"250,384"`` -> [250.0, 384.0]: a flag's comma-separated numbers of ``kind``, one or several."""
    try:
        values = [kind(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise InvalidOption(f"{flag} {text!r}: give numbers, one or several, such as {example}")
    return values


if __name__ == "__main__":  # a child of child_process: MODULE:FUNCTION(config), its result as JSON, the last line
    module, name = sys.argv[1].split(":")
    print(json.dumps(getattr(importlib.import_module(f"featurestore.bench.{module}"), name)(json.loads(sys.argv[2]))))
