"""The CPU int8 dequantize (client.dequantize.into): the numba kernel gives numpy's formula's bits
(float32(code * scale), rounded once to float16) over random shapes, groups, output dtypes and
thread counts; odd strides, out-of-range groups and a process without numba keep numpy's answer."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from client import dequantize

NUMBA = importlib.util.find_spec("numba") is not None
needs_numba = pytest.mark.skipif(not NUMBA, reason="numba is not installed: no kernel to compare")


def sample(seed: int, rows: int, shape: tuple[int, ...], groups: int, *, runs: bool) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, (rows, *shape), dtype=np.int8)
    # Scales from float16's subnormals to past its range: rounding, subnormal and inf results.
    table = (rng.random((groups, *shape), dtype=np.float32)
             * rng.choice(np.float32([1e-9, 1e-6, 1e-3, 1.0, 700.0]), (groups, *shape))).astype(np.float32)
    at = np.sort(rng.integers(0, groups, rows)) if runs else rng.integers(0, groups, rows)
    return codes, at.astype(np.int64), table


def reference(codes: np.ndarray, at: np.ndarray, table: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The formula as format.int8 writes it, in one call (no blocks, no kernel)."""
    out = np.empty(codes.shape, np.float16 if dtype == torch.float16 else np.float32)
    with np.errstate(over="ignore"):
        np.multiply(codes, table[at], out=out, casting="same_kind")
    return torch.from_numpy(out)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = torch.int16 if a.dtype.itemsize == 2 else torch.int32
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(width), b.contiguous().view(width))


@pytest.fixture
def kernel_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel loaded, and numpy's path made to fail: a pass is the kernel's."""
    assert dequantize.wait_warm(120), "numba is installed but the kernel did not load"

    def refuse(*args: Any) -> None:
        raise AssertionError("into fell back to numpy")

    monkeypatch.setattr(dequantize, "numpy_into", refuse)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_kernel_gives_the_numpy_formulas_bits(kernel_only: None, dtype: torch.dtype, threads: int, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    shape = ((int(rng.integers(1, 70)),), (int(rng.integers(1, 9)), int(rng.integers(1, 40))))[seed % 2]
    rows, groups = int(rng.integers(1, 300)), int(rng.integers(1, 12))
    codes, at, table = sample(seed, rows, shape, groups, runs=seed % 3 == 0)
    out = torch.full(codes.shape, 3.0, dtype=dtype)
    with np.errstate(over="ignore"):
        dequantize.into(codes, at, table, out, threads=threads)
    assert same_bits(out, reference(codes, at, table, dtype))


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_bag_piece_and_int32_groups(kernel_only: None, dtype: torch.dtype) -> None:
    codes, _, table = sample(9, 513, (1024,), 1, runs=True)
    at = np.zeros(len(codes), np.int32)  # a bag's piece: one scales row; any integer dtype
    out = torch.empty(codes.shape, dtype=dtype)
    dequantize.into(codes, at, table, out)
    assert same_bits(out, reference(codes, at.astype(np.int64), table, dtype))
    assert dequantize.into(codes[:0], at[:0], table, out[:0]).shape[0] == 0
    empty = torch.empty(3, 0, dtype=dtype)
    assert dequantize.into(codes[:3, :0], at[:3], table[:, :0], empty) is empty  # rows of no values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_odd_strides_are_dequantized_by_numpy(dtype: torch.dtype) -> None:
    dequantize.wait_warm(120)
    codes, at, table = sample(3, 40, (6, 10), 4, runs=False)
    strided_codes = codes[:, :, ::2]  # not C-contiguous: the kernel's flat view would be wrong
    strided_table = np.ascontiguousarray(table[:, :, ::2])
    want = reference(np.ascontiguousarray(strided_codes), at, strided_table, torch.float32).to(dtype)
    out = torch.empty(40, 6, 5, dtype=dtype)
    transposed = torch.empty(5, 6, 40, dtype=dtype).permute(2, 1, 0)  # a non-contiguous out
    with np.errstate(over="ignore"):  # numpy's float16 cast warns of the infs
        assert same_bits(dequantize.into(strided_codes, at, strided_table, out), want)
        dequantize.into(np.ascontiguousarray(strided_codes), at, strided_table, transposed)
    assert same_bits(transposed, want)


def test_groups_outside_the_table_keep_numpys_answer() -> None:
    dequantize.wait_warm(120)
    codes, at, table = sample(4, 20, (8,), 3, runs=False)
    at[7] = 3
    with pytest.raises(IndexError):
        dequantize.into(codes, at, table, torch.empty(20, 8))
    at[7] = -1  # numpy's wrap to the last row, as before the kernel
    out = dequantize.into(codes, at, table, torch.empty(20, 8))
    assert same_bits(out, reference(codes, np.where(at < 0, 2, at), table, torch.float32))


CHILD = """
import json, sys
import numpy as np, torch
sys.modules["numba"] = None  # as if not installed: importing it fails
from client import dequantize
from tests.test_dequantize import sample
codes, at, table = sample(5, 300, (3, 70), 7, runs=False)
outs = {}
for name, dtype in (("float32", torch.float32), ("float16", torch.float16)):
    out = torch.empty(codes.shape, dtype=dtype)
    with np.errstate(over="ignore"):
        dequantize.into(codes, at, table, out)
    outs[name] = out.numpy().tobytes().hex()
print(json.dumps({"kernel": dequantize.wait_warm(30), "numba": "numba" in sys.modules and sys.modules["numba"] is not None, **outs}))
"""


@needs_numba
def test_without_numba_the_numpy_path_gives_the_kernels_bits(kernel_only: None) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=env,
                           check=True)
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["kernel"] is False and result["numba"] is False
    codes, at, table = sample(5, 300, (3, 70), 7, runs=False)
    for name, dtype in (("float32", torch.float32), ("float16", torch.float16)):
        out = torch.empty(codes.shape, dtype=dtype)
        dequantize.into(codes, at, table, out)  # the kernel here (numpy refused)
        assert out.numpy().tobytes().hex() == result[name]


RENT = """
import sys
import numpy as np, torch
from client import dequantize
dequantize.WARM_AFTER_VALUES = 1000
codes, at, table = np.zeros((10, 60), np.int8), np.zeros(10, np.int64), np.ones((1, 60), np.float32)
seen = []
for dtype, rows in ((torch.float32, 8), (torch.bfloat16, 10), (torch.float16, 8)):  # 480, (not counted), 960
    dequantize.into(codes[:rows], at[:rows], table, torch.empty(rows, 60, dtype=dtype))
    seen.append("thread" in dequantize._STATE)
dequantize.into(codes[:1], at[:1], table, torch.empty(1, 60))  # 1020: past the threshold
seen.append("thread" in dequantize._STATE)
print(seen, dequantize.wait_warm(60) == ("numba" in sys.modules))
"""


def test_the_kernel_loads_once_numpy_has_dequantized_warm_after_values() -> None:
    # A fresh process: below the threshold nothing loads numba (a short run never pays for it);
    # bfloat16 batches, which the kernel does not serve, do not count.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", RENT], capture_output=True, text=True, timeout=120, env=env,
                           check=True)
    assert child.stdout.split("\n")[0] == f"[False, False, False, {NUMBA}] True"


BUY = """
import sys, tempfile
import numpy as np, torch
import featurestore
from client import BagDataset, BagLoader, FeatureDataset, FeatureLoader, dequantize
work = tempfile.TemporaryDirectory()  # removed by its finalizer at exit
root = work.name
store = featurestore.open_store(root, mode="a")
writer = store.create_split("ds", "enc", "rows", num_samples=64, sample_shape=(4, 8), dtype="int8")
writer.write(0, np.random.default_rng(0).standard_normal((64, 4, 8), dtype=np.float32))
writer.commit()
bags = store.create_bag_split("ds", "enc", "bags", dim=8, dtype="int8")
for i in range(4):
    bags.add_bag(f"s{i}", np.ones((16, 8), np.float32), np.zeros((16, 2), np.int64))
bags.commit()
dequantize.WARM_AFTER_VALUES = 1 << 40  # never by the tally: only an epoch known long enough starts the load
kind, at_start = sys.argv[1], int(sys.argv[2])
dequantize.WARM_AT_START_VALUES = at_start
if kind == "rows":
    loader = FeatureLoader(FeatureDataset(root, "ds", "enc", "rows"), batch_size=8, device="cpu")
else:
    loader = BagLoader(BagDataset(root, "ds", "enc", "bags"), batch_size=1, device="cpu")
epoch = iter(loader)
started = "thread" in dequantize._STATE
for _ in epoch:
    pass
print(started, "thread" in dequantize._STATE)
"""


@needs_numba
@pytest.mark.parametrize("kind, values", [("rows", 64 * 4 * 8), ("bags", 4 * 16 * 8)])
def test_an_epoch_known_to_dequantize_enough_starts_the_kernels_load_at_once(kind: str, values: int) -> None:
    # A fresh process each: an epoch of `values` values starts the load as it starts when that is
    # at least WARM_AT_START_VALUES, and never when it is fewer.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    for threshold, expected in ((values, "True True"), (values + 1, "False False")):
        child = subprocess.run([sys.executable, "-c", BUY, kind, str(threshold)], capture_output=True, text=True,
                               timeout=180, env=env, check=True)
        assert child.stdout.strip().splitlines()[-1] == expected, (threshold, child.stdout, child.stderr[-2000:])
