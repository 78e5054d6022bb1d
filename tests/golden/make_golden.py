"""Write the golden stores under tests/golden/ (run once, by the code of the day they were made).

The stores are committed as data: tests/test_golden.py reads them with today's code and must get
the values this generator produced, bit for bit, so a change of the format's code that stops
reading stores already on users' disks fails there. Re-running this script replaces them; do so
only for a deliberate format change, and keep the old ones readable (a new directory name).

    python tests/golden/make_golden.py tests/golden/v2-2026-11
"""

from __future__ import annotations

import shutil
import sys

import numpy as np

import featurestore
from featurestore.format.metadata import Provenance

DTYPES = ("float32", "float16", "bfloat16")


def dense_values(dtype: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Seeded features [20, 6, 8] float32 (one outlier channel), int64 labels, ids."""
    rng = np.random.default_rng(1234 + DTYPES.index(dtype))
    feats = rng.standard_normal((20, 6, 8)).astype(np.float32)
    feats[:, :, 3] *= 40.0  # a channel with large activations, as ViTs have
    labels = rng.integers(0, 3, 20).astype(np.int64)
    ids = [f"img-{i:03d}" for i in range(20)]
    return feats, labels, ids


def bag_values(dtype: str) -> list[tuple[str, np.ndarray, np.ndarray, int, dict]]:
    """Seeded bags: ids, features [n, 8], int64 coords [n, 2], labels, attrs (one empty bag)."""
    rng = np.random.default_rng(4321 + DTYPES.index(dtype))
    bags = []
    for i, n in enumerate((7, 0, 13, 1, 30, 5)):
        feats = rng.standard_normal((n, 8)).astype(np.float32) * (1 + i)
        coords = (rng.integers(0, 50, (n, 2)) * 256).astype(np.int64)
        bags.append((f"slide-{chr(ord('e') - i)}", feats, coords, i % 2, {"case_id": f"case-{i // 2}", "i": i}))
    return bags


def write(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)
    store = featurestore.open_store(root, mode="a")
    for dtype in DTYPES:
        feats, labels, ids = dense_values(dtype)
        w = store.create_split("golden", f"dense-{dtype}", "train", num_samples=len(feats),
                               sample_shape=feats.shape[1:], dtype=dtype, label_shape=(), label_dtype="int64",
                               chunk_rows=6, ids=ids,
                               provenance=Provenance(encoder={"name": "golden", "spec": "seeded"},
                                                     cache_key=f"golden-dense-{dtype}", source_dtype="float32"))
        w.write(0, feats, labels)
        w.commit()
        bw = store.create_bag_split("golden", f"bags-{dtype}", "train", dim=8, dtype=dtype,
                                    metadata={"cache_key": f"golden-bags-{dtype}"},
                                    patch_size_level0=256, chunk_bytes=8 * 8 * 4 * 2)
        for bag_id, f, c, label, attrs in bag_values(dtype):
            bw.add_bag(bag_id, f, coords=c, label=label, attrs=attrs)
        bw.close()
        bw.commit()


if __name__ == "__main__":
    write(sys.argv[1])
