"""Mean-embed of a float16 bag split vs a plain read of all its bags (docs/EXTRACT.md, "Slide and
patient embeddings"): is pooling the bottleneck?

    python scripts/embed_throughput.py DIR [--mb 200] [--repeats 3]

Writes DIR/store (a bag split of ~MB float16), then alternates, each in a fresh process (so each
checks every chunk's crc32c once, as a real run does): a plain read of every bag with
``bags.read_numpy`` into a reused buffer, and ``featurestore embed --slide-encoder mean``. Cold:
every file of the store is dropped from the page cache first (fdatasync + posix_fadvise DONTNEED);
warm: after one untimed read. Both the read and the pooling stream (``Pooler.pool`` over every
bag) are timed after the split is opened; the whole ``embed`` run also counts its fixed costs
(opening, the writer's statistics kernel, the commit). Prints each run's GB/s and the best-of ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

DIM, PATCHES = 1024, 1000


def make(root: Path, mb: int) -> None:
    import featurestore

    store = featurestore.open_store(str(root), mode="a")
    if "uni" in (store.encoders("bench") if "bench" in store.datasets() else []):
        return
    bags = max(1, mb * 2**20 // (PATCHES * DIM * 2))
    w = store.create_bag_split("bench", "uni", "train", dim=DIM, dtype="float16", patch_size_level0=256)
    rng = np.random.default_rng(0)
    for i in range(bags):
        n = int(PATCHES * rng.uniform(0.5, 1.5))
        w.add_bag(f"slide-{i:04d}", rng.standard_normal((n, DIM), dtype=np.float32).astype(np.float16),
                  coords=np.zeros((n, 2), np.int64), label=i % 2)
    w.close()
    w.commit()


def drop(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def plain_read(root: Path) -> float:
    import featurestore

    bags = featurestore.open_store(str(root)).open_bags("bench", "uni", "train")
    buffer = np.empty((int(bags.lengths.max()), bags.dim), np.float16)
    started = time.perf_counter()
    for i in range(len(bags)):
        bags.read_numpy(i, out=buffer[: int(bags.lengths[i])])
    return time.perf_counter() - started


def pool_only(root: Path) -> float:
    """The pooling stream alone (reads + float64 sums), timed like the plain read: after the open."""
    import featurestore
    from featurestore.embed.pooling import Pooler
    from featurestore.embed.rows import plan

    bags = featurestore.open_store(str(root)).open_bags("bench", "uni", "train")
    rows = plan(bags, None, "bench/uni/train")
    pooler = Pooler(bags, "mean")
    started = time.perf_counter()
    for _ in pooler.pool(rows, [None] * len(rows)):
        pass
    seconds = time.perf_counter() - started
    pooler.close()
    return seconds


def mean_embed(root: Path) -> float:
    import shutil

    from featurestore.embed.run import EmbedOptions, embed
    from featurestore.extract.dist import Coordinator

    shutil.rmtree(root / "bench" / "mean", ignore_errors=True)  # the last run's output, not timed
    started = time.perf_counter()
    embed(EmbedOptions(store=str(root), dataset="bench", encoder="uni", split="train", slide_encoder="mean",
                       encoder_name="mean"), Coordinator())
    return time.perf_counter() - started


def child(what: str, root: Path) -> None:
    seconds = {"read": plain_read, "pool": pool_only, "embed": mean_embed}[what](root)
    print(json.dumps({"seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None)
    args = parser.parse_args()
    root = Path(args.dir) / "store"
    if args.child:
        return child(args.child, root)
    make(root, args.mb)
    nbytes = sum(p.stat().st_size for p in (root / "bench" / "uni" / "train" / "features").rglob("*") if p.is_file())
    print(f"bag split: {nbytes / 1e6:.0f} MB of float16 feature chunks")
    for mode in ("cold", "warm"):
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for what in ("read", "pool", "embed"):
                if mode == "cold":
                    drop(root)
                else:
                    plain_read(root)
                out = subprocess.run([sys.executable, __file__, args.dir, "--child", what], capture_output=True,
                                     text=True, check=True)
                seconds = json.loads(out.stdout.strip().splitlines()[-1])["seconds"]
                print(f"  {mode} {what}: {seconds:.3f} s, {nbytes / seconds / 1e9:.2f} GB/s")
                best[what] = min(best.get(what, float("inf")), seconds)
        print(f"{mode} (best of {args.repeats}): mean pooling stream {best['read'] / best['pool']:.2f}x of the "
              f"plain read's speed; whole `embed` run {best['read'] / best['embed']:.2f}x (fixed costs included)")


if __name__ == "__main__":
    main()
