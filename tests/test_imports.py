"""The core import and the numpy read path never import torch (the server image has none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import featurestore

CHILD = r"""
import json, sys
import numpy as np
import featurestore
after_import = sorted(m for m in ("torch", "fastapi", "s3fs", "zarr") if m in sys.modules)
store = featurestore.open_store(sys.argv[1])
out = {"after_import": after_import, "listing": store.splits("d", "e")}
for split in ("plain", "zstd"):
    arr = store.open("d", "e", split)
    values = arr.read_numpy(np.array([5, 0, 5, 11]))
    out[split] = [arr.path, values.dtype.str, values.view(np.uint16).tolist()]
    out[split + "-labels"] = arr.labels.read_numpy([3, 1]).tolist() if arr.labels else None
out["after_read"] = "torch" in sys.modules
print(json.dumps(out))
"""


def test_core_import_and_numpy_reads_do_not_import_torch(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = featurestore.open_store(str(root), mode="a")
    x = np.random.default_rng(0).standard_normal((12, 2, 3)).astype(np.float32)
    for split, compressor in (("plain", None), ("zstd", "zstd")):
        w = store.create_split("d", "e", split, num_samples=12, sample_shape=(2, 3), dtype="bfloat16",
                               chunk_bytes=5 * 12, compressor=compressor, label_dtype="int64")
        w.write(0, x, labels=np.arange(12))
        w.commit()
    result = subprocess.run([sys.executable, "-c", CHILD, str(root)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["after_import"] == []  # no torch, server stack, network client or zarr on import
    assert out["after_read"] is False
    assert out["listing"] == ["plain", "zstd"]
    expected = store.open("d", "e", "plain").read_numpy(np.array([5, 0, 5, 11])).tolist()
    assert out["plain"] == ["mmap", "<u2", expected]
    assert out["zstd"] == ["zarr", "<u2", expected]
    assert out["plain-labels"] == [3, 1]
