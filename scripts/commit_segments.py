"""What a bag split's commit costs when every slide is a segment of its own (``--worker``), on a
SeaweedFS started here, optionally with a delay added to every storage call to stand for an
object store's round trip (docs/EXTRACT.md, "Cluster workers": the commit).

    PYTHONPATH=. python scripts/commit_segments.py --segments 100 --latency-ms 20

Prints the seconds of the commit's parts (collect, the chunks laid out, the index, the late
check) and of the whole commit, and how many calls of each kind it made.
"""

from __future__ import annotations

import argparse
import collections
import time
from typing import Any

import numpy as np

import featurestore
from featurestore.core import bag_commit
from featurestore.core.storage.obstore import ObjectStorage
from featurestore.testing.seaweedfs import seaweed_server

CALLS = ("read", "read_ranges", "read_ranges_into", "read_many", "listdir", "size", "copy", "write", "exists",
         "read_versioned", "delete_tree")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--segments", type=int, default=100, help="slides, one segment each (default 100)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="added to every storage call (default 0)")
    parser.add_argument("--dim", type=int, default=256, help="feature width (default 256)")
    args = parser.parse_args()
    counts: collections.Counter[str] = collections.Counter()
    counting = [False]
    for name in CALLS:  # every storage call of the commit delayed and counted
        def delayed(self: Any, *a: Any, _call: Any = getattr(ObjectStorage, name), _name: str = name,
                    **k: Any) -> Any:
            if counting[0]:
                counts[_name] += 1
                time.sleep(args.latency_ms / 1e3)
            return _call(self, *a, **k)
        setattr(ObjectStorage, name, delayed)
    for part in ("collect", "_write_rows", "_write_index", "late_bags"):
        def timed(*a: Any, _fn: Any = getattr(bag_commit, part), _part: str = part, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                print(f"  {_part}: {time.perf_counter() - start:.2f} s", flush=True)
        setattr(bag_commit, part, timed)
    with seaweed_server() as server:
        server.create_bucket("commit-segments")
        store = featurestore.open_store("s3://commit-segments/store", mode="a", **server.storage_options)
        writer = store.create_bag_split("ds", "enc", "s", dim=args.dim, chunk_bytes=1 << 20)
        rng = np.random.default_rng(0)
        for i in range(args.segments):
            session = writer.session()
            rows = int(rng.integers(200, 1500))
            session.add_bag(f"slide-{i:05d}", rng.standard_normal((rows, args.dim), dtype=np.float32).astype(np.float16))
            session.close()
        counting[0] = True
        start = time.perf_counter()
        writer.commit()
        seconds = time.perf_counter() - start
        counting[0] = False
        assert len(store.open_bags("ds", "enc", "s").ids) == args.segments
    print(f"commit of {args.segments} segments, {args.latency_ms:g} ms added a call: {seconds:.2f} s; "
          f"calls: {dict(counts)}")


if __name__ == "__main__":
    main()
