"""Statistics where the features are (featurestore.core.device_stats): per-sample figures that do
not depend on the batch cut or torch's thread count, the numpy fallback, the CUDA path, and the
put pool's ordering and error handling."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import featurestore
from featurestore.core import device_stats
from featurestore.core.batch import prepare_numpy
from featurestore.format.stats import ROW_FIELDS, RowStats

# [T, C] samples large enough that torch's CPU reductions run in parallel (> 32768 values).
SHAPE = (96, 48)


def _features(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *SHAPE)).astype(np.float32) * rng.uniform(0.1, 30, SHAPE[-1]).astype(np.float32)
    return x + np.float32(500) * (np.arange(SHAPE[-1], dtype=np.float32) % 3)  # large means


def _rows_equal(a: RowStats, b: RowStats) -> None:
    for name in ROW_FIELDS:
        got, want = getattr(a, name), getattr(b, name)
        assert got.tobytes() == want.tobytes(), name


def _with_threads(threads: int, fn: Any) -> Any:
    """Run ``fn`` with ``threads`` torch intra-op threads, the statistics included (their own cap,
    FEATURESTORE_STATS_THREADS, is lifted to the same count)."""
    before = torch.get_num_threads()
    cap = os.environ.get("FEATURESTORE_STATS_THREADS")
    torch.set_num_threads(threads)
    os.environ["FEATURESTORE_STATS_THREADS"] = str(threads)
    try:
        assert device_stats.stats_threads() == threads
        return fn()
    finally:
        torch.set_num_threads(before)
        if cap is None:
            del os.environ["FEATURESTORE_STATS_THREADS"]
        else:
            os.environ["FEATURESTORE_STATS_THREADS"] = cap


@pytest.mark.parametrize("logical", ["float16", "bfloat16", "float32"])
def test_per_sample_figures_ignore_the_batch_cut_and_the_thread_count(logical: str) -> None:
    x = torch.from_numpy(_features(24))
    whole = _with_threads(1, lambda: device_stats.prepare(x, logical, SHAPE[-1], 0))
    many = _with_threads(4, lambda: device_stats.prepare(x, logical, SHAPE[-1], 0))
    _rows_equal(whole.rows, many.rows)
    assert whole.stored.tobytes() == many.stored.tobytes()
    for lo, hi in ((0, 1), (1, 8), (8, 24)):
        part = _with_threads(2, lambda: device_stats.prepare(x[lo:hi], logical, SHAPE[-1], lo))
        _rows_equal(part.rows, whole.rows[lo:hi])
        assert part.stored.tobytes() == whole.stored[lo:hi].tobytes()
    assert whole.rows.max_abs_error.max() > 0 or logical == "float32"


def test_split_report_is_identical_under_any_thread_count_and_writer_count(tmp_path: Path) -> None:
    x = _features(40, seed=3)
    store = featurestore.open_store(str(tmp_path / "store"), mode="a")
    chunk_bytes = 6 * int(np.prod(SHAPE)) * 2  # 6 samples per chunk, an edge chunk of 4
    metas = []
    for split, threads, cut in (("a", 1, 40), ("b", 4, 7), ("c", 2, 3)):
        def run() -> dict[str, Any]:
            w = store.create_split("d", "e", split, num_samples=40, sample_shape=SHAPE, dtype="float16",
                                   chunk_bytes=chunk_bytes)
            for lo in range(0, 40, cut):
                w.write(lo, x[lo:lo + cut])
            return w.commit()
        metas.append(_with_threads(threads, run))
    # two writers of one split (chunk i to writer i % 2), numpy input, then a commit-only process
    first = store.create_split("d", "e", "two", num_samples=40, sample_shape=SHAPE, dtype="float16",
                               chunk_bytes=chunk_bytes)
    second = store.create_split("d", "e", "two", num_samples=40, sample_shape=SHAPE, dtype="float16",
                                chunk_bytes=chunk_bytes, resume=True)
    for index in range(first.num_chunks):
        lo, hi = first.chunk_range(index)
        (first if index % 2 else second).write(lo, torch.from_numpy(x[lo:hi]))
    first.close()
    second.close()
    metas.append(store.create_split("d", "e", "two", num_samples=40, sample_shape=SHAPE, dtype="float16",
                                    chunk_bytes=chunk_bytes, resume=True).commit())
    for meta in metas[1:]:
        assert meta["quantization"] == metas[0]["quantization"]
        assert meta["channel_stats"] == metas[0]["channel_stats"]
    stored = store.open("d", "e", "a").read_numpy(np.arange(40)).astype(np.float64).reshape(-1, SHAPE[-1])
    np.testing.assert_allclose(metas[0]["channel_stats"]["mean"], stored.mean(axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(metas[0]["channel_stats"]["std"], stored.std(axis=0), rtol=1e-6)


@pytest.mark.parametrize("logical", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("source", ["float32", "float16", "float64"])
def test_numpy_fallback_agrees_with_torch(logical: str, source: str) -> None:
    """The torch-free path (a host without torch) stores the same bytes and the same maxima;
    sums agree to float32 group-sum rounding."""
    x = _features(6, seed=5).astype(source)
    ours = device_stats.prepare(torch.from_numpy(x), logical, SHAPE[-1], 0)
    theirs = prepare_numpy(x, logical, SHAPE[-1], 0)
    assert ours.stored.tobytes() == theirs.stored.tobytes()
    for name in ("abs_max", "max_abs_error", "max_rel_error"):
        np.testing.assert_array_equal(getattr(ours.rows, name), getattr(theirs.rows, name), err_msg=name)
    for name in ("sq_error", "sq_source", "mean", "m2"):
        np.testing.assert_allclose(getattr(ours.rows, name), getattr(theirs.rows, name), rtol=2e-6, err_msg=name)


def test_a_donated_batch_is_not_copied_and_a_borrowed_one_is(tmp_path: Path) -> None:
    """A float16 batch stored as float16 needs no cast: unless donated, the writer copies it, so
    a caller that reuses its buffer right after write() cannot change what is stored."""
    store = featurestore.open_store(str(tmp_path / "store"), mode="a")
    x = _features(12).astype(np.float16)
    w = store.create_split("d", "e", "s", num_samples=12, sample_shape=SHAPE, dtype="float16",
                           chunk_bytes=4 * int(np.prod(SHAPE)) * 2)
    buffer = x.copy()
    for lo in range(0, 12, 4):
        buffer[:] = x
        w.write(lo, buffer[lo:lo + 4])
        buffer[:] = 0  # the caller reuses its buffer at once
    w.commit()
    assert store.open("d", "e", "s").read_numpy(np.arange(12)).tobytes() == x.tobytes()
    batch = device_stats.prepare(torch.from_numpy(x), "float16", SHAPE[-1], 0)
    assert batch.aliases_source and np.shares_memory(batch.stored, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("logical", ["float16", "bfloat16"])
def test_cuda_statistics_match_the_cpu(logical: str) -> None:
    """Bytes and maxima identical to the CPU's; sums within the tolerance docs/EXTRACT.md states."""
    x = torch.from_numpy(_features(16, seed=9))
    cpu = device_stats.prepare(x, logical, SHAPE[-1], 0)
    gpu = device_stats.prepare(x.cuda(), logical, SHAPE[-1], 0)
    assert gpu.stored.tobytes() == cpu.stored.tobytes()
    for name in ("abs_max", "max_abs_error", "max_rel_error"):
        np.testing.assert_array_equal(getattr(gpu.rows, name), getattr(cpu.rows, name), err_msg=name)
    for name in ("sq_error", "sq_source", "mean", "m2"):
        np.testing.assert_allclose(getattr(gpu.rows, name), getattr(cpu.rows, name), rtol=1e-6, err_msg=name)
    # a batch cut on the GPU keeps its per-sample figures within the same tolerance
    part = device_stats.prepare(x[3:7].cuda(), logical, SHAPE[-1], 3)
    np.testing.assert_allclose(part.rows.m2, gpu.rows.m2[3:7], rtol=1e-6)


@pytest.mark.parametrize("logical", ["bfloat16", "float32"])
@pytest.mark.parametrize("source", ["float32", "float64"])
def test_torch_and_numpy_agree_on_values_whose_squares_leave_float32(logical: str, source: str) -> None:
    """Values near bfloat16's largest, and tiny ones, squared in float32 overflowed to
    inf (or underflowed to 0) on the torch path; both paths now square them in float64."""
    x = _features(6, seed=5) * 1e-3
    x[0, 1, 2], x[1, 0, 0], x[2, 3, 4], x[5, 7, 1] = 3.0e38, -1e22, 1e-30, 1e20
    x = x.astype(source)
    ours = device_stats.prepare(torch.from_numpy(x), logical, SHAPE[-1], 0)
    theirs = prepare_numpy(x, logical, SHAPE[-1], 0)
    assert ours.stored.tobytes() == theirs.stored.tobytes()
    for name in ("abs_max", "max_abs_error", "max_rel_error"):
        np.testing.assert_array_equal(getattr(ours.rows, name), getattr(theirs.rows, name), err_msg=name)
    for name in ("sq_error", "sq_source"):
        assert np.isfinite(getattr(ours.rows, name)).all(), name
        np.testing.assert_allclose(getattr(ours.rows, name), getattr(theirs.rows, name), rtol=1e-12, err_msg=name)
    if source != logical:  # exact storage has no error figures to take
        np.testing.assert_allclose(ours.rows.sq_source, (x.astype(np.float64) ** 2).reshape(6, -1).sum(axis=1),
                                   rtol=1e-12)
