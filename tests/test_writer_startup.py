"""A process's first write does not wait for the statistics kernel to load, and writes the same
split as the kernel does (core.intake, core.fused_stats.warm_up_soon)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from featurestore.core import fused_stats

pytestmark = pytest.mark.skipif(not fused_stats.available(), reason="numba is not installed (the numba extra)")

# Run in a fresh process (this one has numba loaded). ``import numba`` is held until the first
# batches are written: a write that waited for the kernel would not return.
_CODE = textwrap.dedent("""
    import importlib.abc, importlib.util, json, sys, threading
    import numpy as np

    release = threading.Event()

    class Hold(importlib.abc.MetaPathFinder):  # numba's module runs once released (import lock free)
        def find_spec(self, name, path, target=None):
            if name != "numba":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("numba")
            run = spec.loader.exec_module
            spec.loader.exec_module = lambda module: (release.wait(120), run(module))
            return spec

    sys.meta_path.insert(0, Hold())
    import featurestore
    from featurestore.core import fused_stats

    root = sys.argv[1]
    values = np.random.default_rng(0).standard_normal((96, 8, 24), dtype=np.float32)
    values[5, 3, 2] = 70000.0 / 3  # float16 rounding error figures on a large value too

    def write(split, batches):
        w = featurestore.open_store(root, mode="a").create_split(
            "d", "e", split, num_samples=96, sample_shape=(8, 24), dtype="float16", chunk_rows=32)
        for lo in batches:
            done = threading.Event()
            t = threading.Thread(target=lambda: (w.write(lo, values[lo : lo + 16]), done.set()))
            t.start()
            t.join(30)
            if not done.is_set():
                print(json.dumps({"waited_for_numba": lo}))
                sys.stdout.flush()
                import os
                os._exit(3)
        return w

    early = write("early", [0, 16])  # numba held: these go through the numpy reference
    assert "numba" not in sys.modules or not fused_stats.ready("float32", "float16")
    release.set()
    while not fused_stats.ready("float32", "float16"):
        threading.Event().wait(0.05)
    for lo in range(32, 96, 16):
        early.write(lo, values[lo : lo + 16])
    early.commit()
    write("late", range(0, 96, 16)).commit()  # every batch through the kernel
    store = featurestore.open_store(root)
    a, b = store.open("d", "e", "early"), store.open("d", "e", "late")
    same_rows = a.read_numpy(np.arange(96)).tobytes() == b.read_numpy(np.arange(96)).tobytes()
    stats = lambda s: {k: s.metadata[k] for k in ("channel_stats", "quantization", "source_dtype")}
    print(json.dumps({"same_rows": same_rows, "same_stats": stats(a) == stats(b) and bool(stats(a))}))
""")


def test_first_write_goes_on_while_the_kernel_loads_and_stores_the_same_split(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _CODE, str(tmp_path / "store")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.strip().splitlines()[-1] == '{"same_rows": true, "same_stats": true}'
