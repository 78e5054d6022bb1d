"""int8 against float16 dense writes of the same float32 input, side by side in one run.

    PYTHONPATH=. python scripts/int8_write_speed.py --samples 512 --shape 256x384 --repeats 3
    PYTHONPATH=. python scripts/int8_write_speed.py --profile int8   # cProfile of one int8 write
    PYTHONPATH=. python scripts/int8_write_speed.py --trees /path/to/old/checkout,.  # before/after

Each repeat writes the same batches once as float16 and once as int8 (alternating which goes
first) into a fresh local split, timed to ``commit()`` (no ``os.sync``: the page cache takes the
bytes, so the figures are the writer's CPU cost, which is what int8's encoding adds). The median
of each and their ratio are printed. ``--trees``: each write in a child process importing
featurestore from each checkout in turn (interleaved), so two versions are compared in one run.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import featurestore


def write(root: str, values: np.ndarray, dtype: str, batch: int, chunk_rows: int | None) -> float:
    shutil.rmtree(root, ignore_errors=True)
    start = time.perf_counter()
    writer = featurestore.open_store(root, mode="a").create_split(
        "bench", "int8", "s", num_samples=len(values), sample_shape=values.shape[1:], dtype=dtype,
        chunk_rows=chunk_rows)
    for lo in range(0, len(values), batch):
        writer.write(lo, values[lo:lo + batch])
    writer.commit()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--shape", default="256x384", help="sample shape, e.g. 256x384")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunk-rows", type=int, default=None, help="rows per chunk (default: from 8 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", choices=("int8", "float16"), default=None,
                        help="instead of timing: cProfile one write of this dtype, top functions by own time")
    parser.add_argument("--trees", default=None, help="comma-separated checkouts to compare, each in child processes")
    parser.add_argument("--child", choices=("int8", "float16"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trees:
        return compare_trees(args)
    shape = tuple(int(s) for s in args.shape.split("x"))
    values = np.random.default_rng(0).standard_normal((args.samples, *shape), dtype=np.float32)
    values[:, :, 7] *= 50.0  # a channel with massive activations, as ViTs have
    with tempfile.TemporaryDirectory() as tmp:
        root = f"{tmp}/store"
        write(root, values[: args.batch], "int8", args.batch, args.chunk_rows)  # imports, numba compiles
        write(root, values[: args.batch], "float16", args.batch, args.chunk_rows)
        if args.child:
            print(write(root, values, args.child, args.batch, args.chunk_rows))
            return
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            write(root, values, args.profile, args.batch, args.chunk_rows)
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(15)
            return
        times: dict[str, list[float]] = {"float16": [], "int8": []}
        for repeat in range(args.repeats):
            order = ("float16", "int8") if repeat % 2 == 0 else ("int8", "float16")
            for dtype in order:
                times[dtype].append(write(root, values, dtype, args.batch, args.chunk_rows))
    gb = values.nbytes / 1e9
    median = {k: statistics.median(v) for k, v in times.items()}
    for dtype, seconds in median.items():
        print(f"{dtype:8s} {seconds:7.3f} s  {gb / seconds:6.2f} GB/s of float32 input  "
              f"(runs: {', '.join(f'{t:.3f}' for t in times[dtype])})")
    print(f"int8/float16 write speed: {median['float16'] / median['int8']:.2f}")


def compare_trees(args: argparse.Namespace) -> None:
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    times: dict[tuple[str, str], list[float]] = {(t, d): [] for t in trees for d in ("float16", "int8")}
    common = ["--samples", str(args.samples), "--shape", args.shape, "--batch", str(args.batch)]
    if args.chunk_rows:
        common += ["--chunk-rows", str(args.chunk_rows)]
    for repeat in range(args.repeats):
        for tree in trees if repeat % 2 == 0 else trees[::-1]:
            for dtype in ("float16", "int8") if repeat % 2 == 0 else ("int8", "float16"):
                env = {**os.environ, "PYTHONPATH": tree}
                done = subprocess.run([sys.executable, os.path.abspath(__file__), *common, "--child", dtype],
                                      env=env, capture_output=True, text=True, check=True, cwd=tree)
                times[(tree, dtype)].append(float(done.stdout.split()[-1]))
    for tree in trees:
        f16, i8 = (statistics.median(times[(tree, d)]) for d in ("float16", "int8"))
        print(f"{tree}: float16 {f16:.3f} s, int8 {i8:.3f} s, int8/float16 write speed {f16 / i8:.2f} "
              f"(runs: {times[(tree, 'float16')]}, {times[(tree, 'int8')]})")


if __name__ == "__main__":
    main()
