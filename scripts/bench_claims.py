"""What ``--worker`` claims cost, on a SeaweedFS started here (docs/EXTRACT.md, "Cluster workers").

1. claim overhead per unit: claim + the renew before the add + done, for ``--units`` tiny units
   (one worker, no encoding): milliseconds per unit;
2. ``featurestore import DIR --worker`` of ``--slides`` small per-slide h5 files: one worker vs
   ``--workers K`` workers on this host (wall seconds, process start included);
3. ``featurestore extract --images wsi:... --worker`` of ``--wsi`` small synthetic slides
   (builtin:tiny-vit): K workers vs ``torchrun --nproc-per-node K`` of the same extraction (the
   import has no torchrun mode).

    PYTHONPATH=. python scripts/bench_claims.py --units 1000 --slides 64 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import h5py
import numpy as np


def claim_overhead(storage: object, units: int) -> float:
    from featurestore.core import claims

    key = f"bench/{uuid.uuid4().hex[:8]}"
    board = claims.ClaimBoard(storage, key, lease=120, max_attempts=3)  # type: ignore[arg-type]
    started = time.perf_counter()
    for i in range(units):
        claim, _ = board.claim(f"slide-{i:05d}")
        assert claim is not None
        assert board.renew(claim)
        assert board.finish(claim)
    return (time.perf_counter() - started) / units * 1000


def slides(root: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rows = 200 + i % 50
        with h5py.File(root / f"s{i:04d}.h5", "w") as f:
            f["features"] = rng.standard_normal((rows, 64)).astype(np.float16)
            f["coords"] = rng.integers(0, 50_000, (rows, 2)).astype(np.int64)


def run_cli(cmd_prefix: list[str], source: list[str], url: str, options: dict[str, str], count: int,
            *extra: str) -> float:
    cmd = [*cmd_prefix, *source, "--store", url, "--storage-options", json.dumps(options),
           "--dataset", "bench", "--encoder-name", "enc", "--split", uuid.uuid4().hex[:8], "--no-progress", *extra]
    started = time.perf_counter()
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(count)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--slides", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--wsi", type=int, default=8)
    args = parser.parse_args()
    from featurestore.testing.seaweedfs import seaweed_server
    from featurestore.core.storage.obstore import ObjectStorage

    with tempfile.TemporaryDirectory() as tmp, seaweed_server(os.path.join(tmp, "weed")) as server:
        server.create_bucket("bench-claims")
        url, options = "s3://bench-claims/store", dict(server.storage_options)
        ms = claim_overhead(ObjectStorage(url, options), args.units)
        print(f"claim overhead: {ms:.1f} ms per unit (claim + renew + done, {args.units} units, SeaweedFS)")
        source = Path(tmp) / "src"
        slides(source, args.slides)
        cli = [sys.executable, "-m", "featurestore.cli"]
        k = args.workers
        imp = ["import", str(source)]
        one = run_cli(cli, imp, url, options, 1, "--worker")
        many = run_cli(cli, imp, url, options, k, "--worker")
        print(f"import of {args.slides} slides: 1 worker {one:.1f}s, {k} workers {many:.1f}s ({one / many:.2f}x)")
        from featurestore.demo.slides import write_cohort

        cohort = Path(tmp) / "cohort"
        write_cohort(cohort, args.wsi, width=1024, height=768, mpp=0.5)
        ext = ["extract", "--images", f"wsi:{cohort}", "--encoder", "builtin:tiny-vit", "--patch-size", "64",
               "--batch-size", "64", "--threads", "1", "--num-workers", "0"]
        workers = run_cli(cli, ext, url, options, k, "--worker")
        torchrun = [str(Path(sys.executable).parent / "torchrun"), f"--nproc-per-node={k}", "-m", "featurestore.cli"]
        ranks = run_cli(torchrun, ext, url, options, 1)
        print(f"extract of {args.wsi} slides: {k} workers {workers:.1f}s, torchrun x{k} {ranks:.1f}s "
              f"(--worker speed / torchrun speed {ranks / workers:.2f}x)")


if __name__ == "__main__":
    main()
