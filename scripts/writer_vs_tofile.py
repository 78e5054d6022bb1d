"""The writer's first write in a fresh process vs numpy ``tofile`` of the same bytes, both to ``os.sync()``.

What a user's first ``create_split`` + ``write`` + ``commit`` sees: every measurement runs in a new
Python process (featurestore imported before the clock starts, its data made before it too), so
nothing is warm: numba's kernel load, the writer's thread pools, the first files. Methods,
interleaved round after round in alternating order:

* ``tofile``: ``values.tofile(path); os.sync()``;
* ``writer fresh``: ``open_store(path).create_split(...)``, ``write`` in batches, ``commit``, ``os.sync()``;
* ``writer second``: the same, timed on a second split of the same process (the first untimed):
  what ``bench write`` measured after its warm-up round.

Each written file is evicted from the page cache after its timing and removed before the next
round (as ``bench write`` does). ``--profile`` prints where a fresh write spends its time instead
(cProfile, cumulative). Input ``[256, 384]`` float16, ``--mb`` MB (default 400).

    python scripts/writer_vs_tofile.py [--mb 400] [--repeats 5] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPE = (256, 384)
BATCH = 64


def _child(kind: str, path: str, mb: float, profile: bool) -> None:
    t_import = time.perf_counter()
    import featurestore
    from featurestore.testing.cgroup import evict
    from featurestore.extract.plan import chunk_rows_for

    t_import = time.perf_counter() - t_import
    n = int(mb * 1e6) // (SHAPE[0] * SHAPE[1] * 2)
    values = np.random.default_rng(0).standard_normal((n, *SHAPE), dtype=np.float32).astype(np.float16)

    def write(where: str) -> float:
        start = time.perf_counter()
        if kind == "tofile":
            values.tofile(where)
        else:
            writer = featurestore.open_store(where, mode="a").create_split(
                "bench", "write", "s", num_samples=n, sample_shape=SHAPE, dtype="float16",
                chunk_rows=chunk_rows_for(SHAPE, "float16", 8.0, BATCH))
            for lo in range(0, n, BATCH):
                writer.write(lo, values[lo : lo + BATCH])
            writer.commit()
        os.sync()
        return time.perf_counter() - start

    if kind == "second":
        write(path + "-first")
        evict(path + "-first")
        shutil.rmtree(path + "-first")
        os.sync()
    if profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        seconds = write(path)
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    else:
        seconds = write(path)
    evict(path)
    print(json.dumps({"seconds": seconds, "bytes": values.nbytes, "import_s": t_import}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=400.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile one fresh write, print it, stop")
    parser.add_argument("--before", default=None,
                        help="a checkout of another version: its fresh write is measured in the same rounds")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], args.child[1], args.mb, args.profile)
        return
    work = tempfile.mkdtemp(prefix="writer-vs-tofile-", dir=os.environ.get("TMPDIR"))
    kinds = ["tofile", "fresh", "second"] + (["before fresh"] if args.before else [])
    try:
        if args.profile:
            subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--profile", "--child", "fresh",
                            os.path.join(work, "p")], check=True)
            return
        times: dict[str, list[float]] = {k: [] for k in kinds}
        nbytes = 0
        for r in range(args.repeats):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                path = os.path.join(work, f"{kind}-{r}")
                env = dict(os.environ)
                if kind.startswith("before"):
                    env["PYTHONPATH"] = args.before
                out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--child",
                                      kind.removeprefix("before "), path],
                                     check=True, capture_output=True, text=True, env=env).stdout
                got = json.loads(out.strip().splitlines()[-1])
                times[kind].append(got["seconds"])
                nbytes = got["bytes"]
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
                os.sync()
        print(f"[writer_vs_tofile] [256, 384] float16, {nbytes / 1e9:.2f} GB, {args.repeats} interleaved rounds, "
              f"load {os.getloadavg()[0]:.1f} (2 cores, shared)")
        base = float(np.median(times["tofile"]))
        for kind, seconds in times.items():
            gb = [nbytes / s / 1e9 for s in seconds]
            med = float(np.median(seconds))
            print(f"{kind:<14} {nbytes / med / 1e9:6.3f} GB/s median  {min(gb):.3f}-{max(gb):.3f}  "
                  f"{base / med:5.2f}x tofile")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
