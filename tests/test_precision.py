"""The precision policy: refusals (float16 overflow, NaN/Inf, wrong shape or dtype), the
quantization report against the source values, and per-channel statistics that merge exactly."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from _core_helpers import SAMPLE_SHAPE, chunk_keys, float32_source, write_shuffled
from hypothesis import given, settings
from hypothesis import strategies as st

import featurestore
from featurestore.errors import (
    DtypeMismatch,
    Float16Overflow,
    MissingChunks,
    NonFiniteValues,
    ShapeMismatch,
)

ROWS = 5


def _store(tmp_path: Path) -> featurestore.FeatureStore:
    return featurestore.open_store(str(tmp_path / "store"), mode="a")


def _create(store: featurestore.FeatureStore, n: int, dtype: str = "float16", split: str = "s",
            **kwargs: Any) -> featurestore.SplitWriter:
    itemsize = 4 if dtype == "float32" else 2
    return store.create_split("d", "e", split, num_samples=n, sample_shape=SAMPLE_SHAPE, dtype=dtype,
                              chunk_bytes=ROWS * 32 * itemsize, **kwargs)


def _wide_range(n: int, seed: int = 0) -> np.ndarray:
    """float32 values over six decades, per-channel offsets, both signs (all within float16)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *SAMPLE_SHAPE)) * 10.0 ** rng.uniform(-3, 3, (n, *SAMPLE_SHAPE))
    x += np.arange(SAMPLE_SHAPE[-1]) * 50.0
    return x.astype(np.float32)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("as_torch", [False, True])
def test_float16_overflow_is_refused_and_nothing_is_stored(tmp_path: Path, as_torch: bool) -> None:
    store = _store(tmp_path)
    w = _create(store, 10)
    good = float32_source(10)
    bad = good.copy()
    bad[4, 0, 0], bad[6, 1, 2] = 70000.0, -1e5  # one value in chunk 0, one in chunk 1
    w.write(0, good[:3])  # chunk 0 partly buffered
    with pytest.raises(Float16Overflow) as info:
        w.write(3, torch.from_numpy(bad[3:]) if as_torch else bad[3:])
    message = str(info.value)
    assert "2 values" in message and "100000" in message
    assert "bfloat16" in message and "float32" in message
    assert isinstance(info.value, OverflowError)
    features = chunk_keys(store, "d", "e", "s", "features", 3, 2)
    assert not any(store.storage.exists(k) for k in features)
    with pytest.raises(MissingChunks):  # rows 3..9 of the refused batch are not buffered
        w.commit()
    assert store.split_status("d", "e", "s") == "writing"
    w.write(3, good[3:])
    w.commit()
    np.testing.assert_array_equal(store.open("d", "e", "s").read_numpy(range(10)), good.astype(np.float16))


def test_float16_range_edge(tmp_path: Path) -> None:
    store = _store(tmp_path)
    w = _create(store, 5)
    x = np.zeros((5, *SAMPLE_SHAPE), np.float32)
    x[0, 0, :2] = [65504.0, -65504.0]
    w.write(0, x)  # the largest float16 values are fine
    w.commit()
    assert store.open("d", "e", "s").metadata["quantization"]["abs_max"] == 65504.0
    w = _create(store, 5, split="t")
    x[1, 1, 1] = np.nextafter(np.float32(-65504.0), np.float32(-np.inf))
    with pytest.raises(Float16Overflow, match="1 values"):
        w.write(0, x)
    # bfloat16 and float32 have float32's range: the same values are stored
    for dtype in ("bfloat16", "float32"):
        w = _create(store, 5, dtype=dtype, split=f"big-{dtype}")
        w.write(0, x * 1000)
        w.commit()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_nan_and_inf_are_refused(tmp_path: Path, dtype: str) -> None:
    store = _store(tmp_path)
    w = _create(store, 5, dtype=dtype)
    x = float32_source(5)
    x[1, 0, 0], x[2, 3, 7], x[4, 2, 2] = np.nan, np.inf, -np.inf
    # the rows that hold them are named: a batch of hundreds is not searched by hand
    where = r"samples \[0, 5\) \(3 of them; first: the batch's row 1\)"
    with pytest.raises(NonFiniteValues, match="1 NaN and 2 Inf values in the features of " + where):
        w.write(0, x)
    with pytest.raises(NonFiniteValues, match=where):
        w.write(0, torch.from_numpy(x).bfloat16())
    with pytest.raises(NonFiniteValues, match=where):
        w.write(0, x.astype(np.float16))
    with pytest.raises(MissingChunks):
        w.commit()
    assert not store.storage.exists(chunk_keys(store, "d", "e", "s", "features", 3, 1)[0])


@pytest.mark.parametrize("dtype", [">f4", ">f2", ">f8"])
def test_big_endian_values_are_stored_as_their_values(tmp_path: Path, dtype: str) -> None:
    """An h5 or npy written big-endian reached the statistics kernel as is: a numba typing error
    (many lines, the file not named) and a split left writing."""
    store = _store(tmp_path)
    x = float32_source(5)
    w = _create(store, 5, dtype="float32")
    w.write(0, x.astype(dtype))
    w.commit()
    got = store.open("d", "e", "s").read_numpy(np.arange(5))
    assert got.tobytes() == x.astype(dtype).astype(np.float32).tobytes()
    bags = store.create_bag_split("d", "e", "b", dim=x.shape[-1])
    bags.add_bag("a", x[0].astype(dtype))
    bags.commit()
    assert np.array_equal(store.open_bags("d", "e", "b").read_numpy("a")[0], x[0].astype(dtype).astype(np.float16))


def test_wrong_shape_or_dtype_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    w = _create(store, 10, label_dtype="int64")
    x, y = float32_source(10), np.arange(10)
    for bad in (np.zeros((2, 4, 7), np.float32), np.zeros((4, 8), np.float32),
                np.zeros((2, 1, 4, 8), np.float32), np.zeros((2, 8, 4), np.float32)):
        with pytest.raises(ShapeMismatch, match="4, 8"):
            w.write(0, bad, labels=y[:len(bad)])
    for bad in (x.astype(np.int32), x.astype(np.int64), torch.from_numpy(x).int(), x > 0,
                x.astype(np.complex64)):
        with pytest.raises(DtypeMismatch):
            w.write(0, bad, labels=y)
    with pytest.raises(ShapeMismatch):
        w.write(0, x)  # the split has labels: they are required
    with pytest.raises(ShapeMismatch):
        w.write(0, x, labels=y[:9])
    with pytest.raises(DtypeMismatch):
        w.write(0, x, labels=y + 0.5)
    w.write(0, x, labels=y.astype(np.int32))  # a lossless label cast is fine
    w.commit()
    np.testing.assert_array_equal(store.open("d", "e", "s").labels.read_numpy(range(10)), y)
    plain = _create(store, 2, split="nolabels")
    with pytest.raises(ShapeMismatch):
        plain.write(0, x[:2], labels=y[:2])


# ---------------------------------------------------------------------- the report
def _errors(source32: np.ndarray, decoded: np.ndarray) -> tuple[float, float]:
    err = np.abs(decoded.astype(np.float64) - source32.astype(np.float64))
    mag = np.abs(source32.astype(np.float64))
    keep = mag >= 6.103515625e-05
    return float(err.max()), float((err[keep] / mag[keep]).max())


@pytest.mark.parametrize("dtype, bound", [("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_quantization_report_values(tmp_path: Path, dtype: str, bound: float) -> None:
    store = _store(tmp_path)
    x = _wide_range(37)
    w = _create(store, 37, dtype=dtype)
    write_shuffled(w, x)
    q = w.commit()["quantization"]
    decoded = x.astype(np.float16) if dtype == "float16" else x.astype(ml_dtypes.bfloat16)
    abs_error, rel_error = _errors(x, decoded.astype(np.float32))
    assert (q["source_dtype"], q["stored_dtype"], q["exact"]) == ("float32", dtype, False)
    assert q["values"] == x.size
    assert q["abs_max"] == float(np.abs(x).max())
    assert 0 < q["max_rel_error"] <= bound
    assert q["max_rel_error"] == pytest.approx(rel_error, rel=1e-6)
    assert q["max_abs_error"] == pytest.approx(abs_error, rel=1e-6)
    rms = np.sqrt(np.mean((decoded.astype(np.float64) - x) ** 2))
    assert q["rms_error"] == pytest.approx(rms, rel=1e-6)
    assert q["rel_rms_error"] == pytest.approx(rms / np.sqrt(np.mean(x.astype(np.float64) ** 2)), rel=1e-6)
    assert (q["overflow_count"], q["nan_count"], q["inf_count"]) == (0, 0, 0)


@pytest.mark.parametrize("dtype, source", [
    ("float32", lambda x: x),
    ("float32", lambda x: x.astype(np.float16)),
    ("bfloat16", lambda x: torch.from_numpy(x).bfloat16()),
    ("float16", lambda x: torch.from_numpy(x).half()),
])
def test_exact_storage_reports_exact(tmp_path: Path, dtype: str, source: Any) -> None:
    store = _store(tmp_path)
    x = float32_source(12, scale=30.0)
    w = _create(store, 12, dtype=dtype)
    w.write(0, source(x))
    q = w.commit()["quantization"]
    assert q["exact"] is True
    assert (q["max_abs_error"], q["max_rel_error"], q["rms_error"]) == (0.0, 0.0, 0.0)
    values = source(x)
    values = values.float().numpy() if isinstance(values, torch.Tensor) else values
    assert q["abs_max"] == float(np.abs(values.astype(np.float32)).max())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_channel_stats_match_numpy_on_stored_values(tmp_path: Path, dtype: str) -> None:
    store = _store(tmp_path)
    x = _wide_range(37, seed=3) / 100 + np.arange(8, dtype=np.float32) * 1e3
    w = _create(store, 37, dtype=dtype)
    write_shuffled(w, x)
    stats = w.commit()["channel_stats"]
    arr = store.open("d", "e", "s")
    stored = arr.read(np.arange(37)).float().numpy().astype(np.float64).reshape(-1, 8)
    assert stats["count"] == stored.shape[0]
    np.testing.assert_allclose(stats["mean"], stored.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["std"], stored.std(axis=0), rtol=1e-6)


def test_report_is_identical_however_the_split_is_written(tmp_path: Path) -> None:
    x = _wide_range(53, seed=7)
    store = _store(tmp_path)
    results = []

    w = _create(store, 53, split="one-batch")
    w.write(0, x)
    results.append(w.commit())

    w = _create(store, 53, split="shuffled")
    write_shuffled(w, x, seed=11)
    results.append(w.commit())

    # two writers, each holding the rows of its own chunks (chunk i to writer i % 2)
    first = _create(store, 53, split="two-writers")
    second = _create(store, 53, split="two-writers", resume=True)
    for index in range(first.num_chunks)[::-1]:
        lo, hi = first.chunk_range(index)
        for a in range(lo, hi, 2):  # small batches, inside the chunk
            (first if index % 2 == 0 else second).write(a, x[a:min(a + 2, hi)])
    first.close()
    results.append(second.commit())

    # a writer interrupted after three chunks, then resumed in a later session
    w = _create(store, 53, split="resumed")
    w.write(0, x[:3 * ROWS + 2])
    w.close()
    w = _create(store, 53, split="resumed", resume=True)
    assert w.pending_chunks() == list(range(3, w.num_chunks))
    write_shuffled(w, x, seed=2)
    results.append(w.commit())

    reference = results[0]
    assert reference["quantization"]["exact"] is False
    for meta in results[1:]:
        assert meta["quantization"] == reference["quantization"]
        assert meta["channel_stats"] == reference["channel_stats"]
        assert meta["source_dtype"] == "float32"
    data = [store.open("d", "e", s).read_numpy(np.arange(53)).tobytes()
            for s in ("one-batch", "shuffled", "two-writers", "resumed")]
    assert len(set(data)) == 1


def test_commit_only_writer_keeps_the_source_dtype(tmp_path: Path) -> None:
    """A process that only commits (every chunk written by others) reports the real source."""
    store = _store(tmp_path)
    x = _wide_range(10)
    w = _create(store, 10)
    w.write(0, x)
    w.close()
    meta = _create(store, 10, resume=True).commit()
    assert meta["source_dtype"] == "float32"
    assert meta["quantization"]["source_dtype"] == "float32"
    assert meta["quantization"]["exact"] is False


@settings(max_examples=25, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
       n=st.integers(1, 30), rows=st.integers(1, 7))
def test_any_batching_gives_the_same_bytes_and_report(data: Any, dtype: str, n: int, rows: int) -> None:
    """Property: for any chunking, batch cut and order, the stored bytes equal numpy's / torch's
    cast and the report equals the one-batch report."""
    x = np.asarray(_wide_range(n, seed=n * 7 + rows) / 10)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [])
    spans = list(zip([0, *cuts], [*cuts, n]))
    order = data.draw(st.permutations(spans))
    itemsize = 4 if dtype == "float32" else 2
    url = f"memory://fs-hyp-{uuid.uuid4().hex[:12]}"
    store = featurestore.open_store(url, mode="a")
    metas = []
    for split, batches in (("one", [(0, n)]), ("many", order)):
        w = store.create_split("d", "e", split, num_samples=n, sample_shape=SAMPLE_SHAPE, dtype=dtype,
                               chunk_bytes=rows * 32 * itemsize)
        for a, b in batches:
            w.write(a, x[a:b])
        metas.append(w.commit())
    got = store.open("d", "e", "many").read(np.arange(n))
    expected = {"float32": lambda: torch.from_numpy(x), "float16": lambda: torch.from_numpy(x.astype(np.float16)),
                "bfloat16": lambda: torch.from_numpy(x).bfloat16()}[dtype]()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    assert metas[0]["quantization"] == metas[1]["quantization"]
    assert metas[0]["channel_stats"] == metas[1]["channel_stats"]
    store.storage.delete_tree("")


def test_channel_stats_of_large_chunks(tmp_path: Path) -> None:
    """One 512 KiB chunk holding 32768 rows per channel: sums must not accumulate in float32."""
    store = _store(tmp_path)
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((128, 256, 8)) * rng.uniform(0.1, 5, 8) + rng.uniform(-3, 3, 8)).astype(np.float32)
    w = store.create_split("d", "e", "big", num_samples=128, sample_shape=(256, 8), dtype="float16")
    assert w.num_chunks == 1
    w.write(0, x)
    stats = w.commit()["channel_stats"]
    stored = store.open("d", "e", "big").read_numpy(np.arange(128)).astype(np.float64).reshape(-1, 8)
    np.testing.assert_allclose(stats["mean"], stored.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["std"], stored.std(axis=0), rtol=1e-6)


def test_bfloat16_never_rounds_to_inf(tmp_path: Path) -> None:
    """float32 values near FLT_MAX round to Inf in bfloat16: refused, like any non-finite value."""
    store = _store(tmp_path)
    largest = np.array(0x7F7F, np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    x = np.zeros((2, *SAMPLE_SHAPE), np.float32)
    x[0, 0, :2] = [largest, -largest]
    w = _create(store, 2, dtype="bfloat16")
    w.write(0, x)  # bfloat16's largest finite value is stored as it is
    assert w.commit()["quantization"]["abs_max"] == float(largest)
    assert store.open("d", "e", "s").read_numpy([0])[0, 0, :2].tolist() == [0x7F7F, 0xFF7F]
    x[1, 2, 3] = np.float32(3.4e38)  # rounds to Inf in bfloat16
    w = _create(store, 2, dtype="bfloat16", split="t")
    with pytest.raises(NonFiniteValues, match="1 values .* Inf in bfloat16"):
        w.write(0, x)
    with pytest.raises(MissingChunks):
        w.commit()


# ---------------------------------------------------------------------- extreme values
@pytest.fixture(params=["fused", "torch", "numpy"])
def stats_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each of the writer's statistics paths: the numba kernel, torch passes, numpy passes."""
    from featurestore.core import fused_stats, intake

    if request.param == "fused":
        if not fused_stats.available():
            pytest.skip("numba is not installed (the numba extra)")
    else:
        monkeypatch.setattr(fused_stats, "available", lambda: False)
    if request.param == "numpy":
        monkeypatch.setattr(intake, "_torch_available", lambda: False)
    return str(request.param)


def _reference_report(x: np.ndarray, decoded: np.ndarray) -> dict[str, float]:
    """The report's error figures in float64 (scaled by the abs max, so no square overflows)."""
    scale = float(np.abs(x).max())
    error = (decoded.astype(np.float64) - x.astype(np.float64)) / scale
    source = x.astype(np.float64) / scale
    rms = np.sqrt(np.mean(error**2))
    return {"rms_error": float(rms * scale), "rel_rms_error": float(rms / np.sqrt(np.mean(source**2))),
            "max_abs_error": float(np.abs(error).max() * scale)}


@pytest.mark.parametrize("dtype, big", [("bfloat16", 1e20), ("bfloat16", 1e22), ("bfloat16", 3.3e38),
                                        ("float16", 6.5e4), ("bfloat16", 1e-30), ("bfloat16", 1e-38)])
def test_report_is_right_for_any_value_the_stored_dtype_holds(tmp_path: Path, stats_path: str, dtype: str,
                                                              big: float) -> None:
    """With one bfloat16 value of 1e20 rel_rms_error was 0.0 (source**2 overflowed
    float32), one >= 1e22 made commit() raise "Out of range float values are not JSON compliant"
    (error**2 did) and left the split writing. Values far below 1 squared to 0 the same way."""
    store = _store(tmp_path)
    x = (float32_source(12, scale=3.0) * (big if big < 1 else 1.0)).astype(np.float32)
    x[3, 1, 2] = big
    w = _create(store, 12, dtype=dtype)
    w.write(0, x)
    q = w.commit()["quantization"]
    assert store.split_status("d", "e", "s") == "complete"
    decoded = (x.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else x.astype(np.float16)).astype(np.float32)
    want = _reference_report(x, decoded)
    for name, value in want.items():
        assert q[name] == pytest.approx(value, rel=1e-6), name
    assert q["rel_rms_error"] > 0 and q["abs_max"] == pytest.approx(float(np.abs(x).max()))


def test_float64_source_is_recorded_and_measured_as_float64(tmp_path: Path, stats_path: str) -> None:
    """A float64 source was reported against its float32 rounding (float64 -> float32
    read "exact"). The source dtype is float64 and the error is the float64 -> stored one."""
    store = _store(tmp_path)
    x = float32_source(12, scale=30.0).astype(np.float64) * (1 + 1e-9)  # not float32 values
    for split, dtype in (("f32", "float32"), ("f16", "float16")):
        w = _create(store, 12, dtype=dtype, split=split)
        w.write(0, x)
        meta = w.commit()
        q = meta["quantization"]
        assert (meta["source_dtype"], q["source_dtype"], q["stored_dtype"]) == ("float64", "float64", dtype)
        decoded = x.astype(np.float32).astype(dtype).astype(np.float64)
        assert q["exact"] is False
        assert q["max_abs_error"] == pytest.approx(float(np.abs(decoded - x).max()), rel=1e-9)
        for name, value in _reference_report(x, decoded).items():
            assert q[name] == pytest.approx(value, rel=1e-6), name
    # float64 values that float32 holds exactly are stored exactly, and said so
    w = _create(store, 12, dtype="float32", split="exact")
    w.write(0, float32_source(12, scale=30.0).astype(np.float64))
    q = w.commit()["quantization"]
    assert (q["source_dtype"], q["exact"], q["max_abs_error"], q["rms_error"]) == ("float64", True, 0.0, 0.0)


def test_float64_beyond_float32_is_refused(tmp_path: Path, stats_path: str) -> None:
    """A float64 value past float32's range used to be stored as Inf in a float32 split."""
    store = _store(tmp_path)
    x = float32_source(4, scale=3.0).astype(np.float64)
    x[1, 0, 0] = -1e39
    w = _create(store, 4, dtype="float32")
    with pytest.raises(NonFiniteValues, match="round to Inf in float32"):
        w.write(0, x)
    w.write(0, x * 0)
    assert np.isfinite(w.commit()["quantization"]["abs_max"])


def test_a_report_figure_that_is_not_finite_is_stored_as_null() -> None:
    """Rows written by an older version may hold an overflowed (inf) sum: the report stores null
    for it, never a value strict JSON cannot hold."""
    import json

    from featurestore.format.stats import ChunkStats, report

    total = ChunkStats(channels=2, rows=1, values=4, abs_max=1e22, max_abs_error=1e19,
                       sum_sq_error=float("inf"), sum_sq_source=float("inf"))
    out = report(total, source_dtype="float32", logical_dtype="bfloat16")
    json.dumps(out, allow_nan=False)
    assert out["quantization"]["rms_error"] is None and out["quantization"]["rel_rms_error"] is None


def test_a_float64_cache_is_imported_as_float64(tmp_path: Path) -> None:
    """`featurestore import` of a float64 cache reported "float32 -> float32 (exact)":
    it rounded the rows itself and declared float32. The report now says float64 -> stored."""
    from featurestore.extract.importer import ImportOptions, import_cache

    x = float32_source(10, scale=30.0).astype(np.float64) * (1 + 1e-9)
    np.save(tmp_path / "cache.npy", x)
    result = import_cache(ImportOptions(source=str(tmp_path / "cache.npy"), store=str(tmp_path / "store"),
                                        dataset="d", encoder_name="e", split="s", dtype="float32",
                                        progress=False))
    meta = result.metadata
    q = meta["quantization"]
    assert (meta["source_dtype"], q["source_dtype"], q["stored_dtype"], q["exact"]) == (
        "float64", "float64", "float32", False)
    assert q["max_abs_error"] == pytest.approx(float(np.abs(x.astype(np.float32) - x).max()), rel=1e-9)
