"""The CPU int8 dequantize alone beside a float16 split's upcast of the same rows.

For each shape (dense rows of a shuffled batch, several chunks' scales; a bag's patches, one scales
row), out dtype and thread count it times, interleaved, median of --repeats:

  upcast   out.copy_(torch.from_numpy(float16_rows))   (what a float16 split pays)
  numpy    client.dequantize.numpy_into                 (the formula before the kernel)
  torch    torch.mul(codes, gathered scales, out=out)   (int8 promotion inside torch)
  kernel   client.dequantize.into                       (numba, when installed)

and prints each one's time over the upcast's (lower is better; 1.0 = as cheap as the upcast).
Threads: torch.set_num_threads for upcast/torch, into(threads=) for the kernel (numpy: 1).

  PYTHONPATH=$PWD python scripts/dequant_speed.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from client import dequantize


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(name: str, codes: np.ndarray, groups: np.ndarray, table: np.ndarray, dtype: torch.dtype,
         threads: int, repeats: int) -> None:
    half = (codes.astype(np.float32) * table[groups]).astype(np.float16)  # a float16 split's rows
    out = torch.empty(codes.shape, dtype=dtype)
    codes_t, table_t, groups_t = torch.from_numpy(codes), torch.from_numpy(table), torch.from_numpy(groups)
    torch.set_num_threads(threads)
    runs = {
        "upcast": lambda: out.copy_(torch.from_numpy(half)),
        "numpy": lambda: dequantize.numpy_into(codes, groups, table, out),
        "torch": lambda: torch.mul(codes_t, table_t[0] if len(table) == 1 else table_t[groups_t], out=out),
        "kernel": lambda: dequantize.into(codes, groups, table, out, threads=threads),
    }
    if not dequantize.wait_warm(120):
        del runs["kernel"]
    times: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(repeats):
        for key, fn in runs.items():
            times[key].append(timed(fn))
    base = statistics.median(times["upcast"])
    line = "  ".join(f"{key} {statistics.median(t) / base:5.2f}x" for key, t in times.items() if key != "upcast")
    print(f"{name:<26} {str(dtype).replace('torch.', ''):<8} threads {threads}  upcast {1e3 * base:7.2f} ms  {line}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    shapes = []
    for rows, dim, chunks in ((1024, 3072, 64), (256, 384, 64)):  # shuffled: a chunk's scales per row
        codes = rng.integers(-127, 128, (rows, dim), dtype=np.int8)
        table = (rng.random((chunks, dim), dtype=np.float32) * 0.05).astype(np.float32)
        shapes.append((f"dense [{rows}, {dim}]", codes, rng.integers(0, chunks, rows).astype(np.int64), table))
    codes = rng.integers(-127, 128, (4096, 1024), dtype=np.int8)
    shapes.append(("bag [4096, 1024]", codes, np.zeros(4096, np.int64),
                   (rng.random((1, 1024), dtype=np.float32) * 0.05).astype(np.float32)))
    for name, codes, groups, table in shapes:
        for dtype in (torch.float32, torch.float16):
            for threads in (1, 2):
                case(name, codes, groups, table, dtype, threads, args.repeats)


if __name__ == "__main__":
    main()
