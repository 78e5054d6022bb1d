"""A process forked while a kernel loads on a thread (the writer's after ``create_split``, the int8
dequantize kernel as an epoch starts) gets a child that works: the fork waits for the load, so the
child never inherits the kernel module's import lock or numba's compiler lock held by a thread it
does not have. Before, such a child hung on its first write, or at its exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("numba")

_WRITER = """
import multiprocessing, sys, numpy as np, featurestore
KW = dict(num_samples=64, sample_shape=(256,), dtype="float16", chunk_rows=64)
def child(root):
    w = featurestore.open_store(root, mode="a").create_split("d", "e", "x", **KW, resume=True)
    w.write(0, np.ones((64, 256), np.float32))
    w.close()
if __name__ == "__main__":
    featurestore.open_store(sys.argv[1], mode="a").create_split("d", "e", "x", **KW).close()  # starts the load
    p = multiprocessing.get_context("fork").Process(target=child, args=(sys.argv[1],))
    p.start()
    p.join(60)
    if p.exitcode is None:
        p.kill()
    print("child exit", p.exitcode)
"""

_DEQUANTIZE = """
import multiprocessing
from client import dequantize
def child():
    assert dequantize.wait_warm(60), "the kernel did not load in the child"
if __name__ == "__main__":
    dequantize.warm_up_soon()  # as a loader does when an int8 epoch starts
    p = multiprocessing.get_context("fork").Process(target=child)
    p.start()
    p.join(60)
    if p.exitcode is None:
        p.kill()
    print("child exit", p.exitcode)
"""


@pytest.mark.parametrize("script", [_WRITER, _DEQUANTIZE], ids=["writer", "int8 dequantize"])
def test_a_child_forked_during_a_kernel_load_works(script: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "child exit 0", proc.stdout + proc.stderr[-2000:]
