"""Creating a split starts loading the writer's statistics kernel, so a process's first write
does not begin with numba's import (core.fused_stats.warm_up_soon, core.writer)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from featurestore.core import fused_stats

pytestmark = pytest.mark.skipif(not fused_stats.available(), reason="numba is not installed (the numba extra)")

# A fresh process: this one has the kernels loaded already.
_CODE = textwrap.dedent("""
    import sys, time
    import numpy as np
    import featurestore

    store = featurestore.open_store(sys.argv[1], mode="a")
    writer = store.create_split("d", "e", "s", num_samples=8, sample_shape=(4, 16), dtype="float16")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # no write yet: the kernels a float16 batch takes load anyway
        kernel = sys.modules.get("featurestore.core.fused_kernel")  # (maybe still being imported)
        copy, same = getattr(kernel, "f16_copy", None), getattr(kernel, "f16_same", None)
        if copy is not None and same is not None and copy.signatures and same.signatures:
            break
        time.sleep(0.05)
    else:
        print("not loaded")
        sys.exit(3)
    writer.write(0, np.ones((8, 4, 16), np.float16))
    writer.commit()
    print("loaded", store.open("d", "e", "s").read_numpy([7]).sum())
""")


def test_creating_a_split_loads_the_kernel_before_the_first_write(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _CODE, str(tmp_path / "store")], check=False, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.split() == ["loaded", "64.0"]


_EXIT_CODE = textwrap.dedent("""
    import atexit, threading
    from client import dequantize
    from featurestore.core import fused_stats

    def report():  # atexit runs after the interpreter joined its non-daemon threads, before it finalizes
        alive = [t.name for t in threading.enumerate() if "warm-up" in t.name]
        print("still loading: " + ", ".join(alive) if alive else "joined", flush=True)

    atexit.register(report)
    fused_stats.warm_up_soon("float32", "float16")
    dequantize.warm_up_soon()
""")


def test_a_process_ending_while_a_kernel_loads_waits_for_the_load(tmp_path: Path) -> None:
    # A load still running when the interpreter finalizes is ended inside LLVM's C++ frames: the
    # process aborted after its work was done (an extraction worker, exit status -6).
    done = subprocess.run([sys.executable, "-c", _EXIT_CODE], check=False, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.split() == ["joined"], done.stdout
