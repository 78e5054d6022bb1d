"""GPU check of the slide-level probe: ABMIL on one synthetic cohort, CPU vs CUDA, and the DDP
example under torchrun with nccl. Prints one JSON line per figure (run by scripts/gpu_check.sh).

    python scripts/gpu_probe_check.py /tmp/gpu-store
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from featurestore.demo.synthetic_bags import write_bag_splits
from featurestore.probes.mil_run import run_mil_probe


def main(root: str) -> None:
    dim = 1536
    counts = write_bag_splits(root, "cohort", {"float16": "enc16"},
                              {"train": {"num": 64, "seed": 1, "min_patches": 500, "max_patches": 3000},
                               "val": {"num": 32, "seed": 2, "min_patches": 500, "max_patches": 3000}}, dim=dim)
    print(json.dumps({"cohort": counts}), flush=True)
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        started = time.perf_counter()
        result = run_mil_probe(root, "cohort", "enc16", train_split="train", eval_split="val", seeds=1, epochs=5,
                               device=device)
        print(json.dumps({"abmil": device, "seconds": round(time.perf_counter() - started, 2),
                          "auc": result["metrics"]["auc"]["mean"], "threads": torch.get_num_threads()}), flush=True)
    if torch.cuda.is_available():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                               "examples/ddp_abmil.py", root, "cohort", "enc16", "train", "--epochs", "2"],
                              capture_output=True, text=True, env=env, timeout=300)
        print(json.dumps({"ddp_nccl_rc": proc.returncode, "seconds": round(time.perf_counter() - started, 2),
                          "last": (proc.stdout.strip().splitlines() or [""])[-1][-300:],
                          "stderr": proc.stderr[-600:] if proc.returncode else ""}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(f"usage: python {sys.argv[0]} STORE_DIR  (a scratch directory; the GPU probe checks write there)")
    main(sys.argv[1])
