"""The writer's one-pass CPU kernel (featurestore.core.fused_stats): the numpy reference's bytes
and figures bit for bit, whatever the thread count; the same refusals; used by the writer."""

from __future__ import annotations

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import featurestore
from featurestore.core import fused_stats
from featurestore.core.batch import is_exact, prepare_numpy
from featurestore.errors import Float16Overflow, NonFiniteValues
from featurestore.format.stats import ROW_FIELDS

pytestmark = pytest.mark.skipif(not fused_stats.available(), reason="numba is not installed (the numba extra)")

SOURCES = ["float32", "float16", "bfloat16", "float64"]
STORED = ["float16", "bfloat16", "float32"]


def _features(n: int, tokens: int, channels: int, seed: int = 0) -> np.ndarray:
    """Large channel means against their spread, tiny and subnormal-range values, exact zeros,
    negative zeros and values near float16's largest (65280 is exact in bfloat16 too)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, tokens, channels)).astype(np.float32)
    x *= rng.uniform(0.1, 30, channels).astype(np.float32)
    x += np.float32(500) * (np.arange(channels, dtype=np.float32) % 3)
    flat = x.reshape(-1)
    picks = rng.choice(flat.size, size=min(flat.size, 64), replace=False)
    specials = np.array([0.0, -0.0, 1e-8, -3e-6, 6.0e-5, 6.2e-5, 65280.0, -65280.0, 2.0**-24, 1.5 * 2.0**-24],
                        np.float32)
    flat[picks] = np.resize(specials, picks.size)
    return x


def _as(x: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(what the kernel takes, what the numpy reference takes) for a source dtype."""
    if kind == "bfloat16":
        values = x.astype(ml_dtypes.bfloat16)
        return values.view(np.uint16), values
    values = x.astype(kind)
    return values, values


def _same(a: fused_stats.Prepared, b: fused_stats.Prepared) -> None:
    assert a.stored.tobytes() == b.stored.tobytes()
    for name in ROW_FIELDS:
        assert getattr(a.rows, name).tobytes() == getattr(b.rows, name).tobytes(), name


@pytest.mark.parametrize("stored", STORED)
@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("shape", [(96, 48), (37, 70), (16, 1), (5, 3), (1, 9000)])
def test_bit_identical_to_the_numpy_reference(shape: tuple[int, int], source: str, stored: str) -> None:
    """Every (source, stored) pair, with tails (37 tokens), one channel, fewer tokens than a group
    and a sample wider than a work item (9000 channels)."""
    raw, reference_input = _as(_features(5, *shape), source)
    want = prepare_numpy(reference_input, stored, shape[-1], 0)
    for private in (False, True):
        got = fused_stats.prepare(raw, source, stored, shape[-1], 0, threads=1, private=private)
        _same(got, want)
        if private:
            assert not np.shares_memory(got.stored, raw)
    if source != stored and source != "float64":
        assert want.rows.max_abs_error.max() > 0 or stored == "float32"


@pytest.mark.parametrize("stored", STORED)
def test_thread_count_changes_no_bit(stored: str) -> None:
    raw = _features(7, 64, 4100, seed=2)  # 4100 channels: two work items per sample
    one = fused_stats.prepare(raw, "float32", stored, 4100, 0, threads=1)
    two = fused_stats.prepare(raw, "float32", stored, 4100, 0, threads=2)
    _same(one, two)
    for lo, hi in ((0, 1), (1, 5), (5, 7)):  # and the batch cut
        part = fused_stats.prepare(raw[lo:hi], "float32", stored, 4100, lo, threads=2)
        assert part.stored.tobytes() == one.stored[lo:hi].tobytes()
        for name in ROW_FIELDS:
            assert getattr(part.rows, name).tobytes() == getattr(one.rows, name)[lo:hi].tobytes(), name


def test_every_float16_value_and_rounding_tie() -> None:
    """The kernel's float16 rounding against numpy's on every finite float16, every midpoint
    between neighbours (ties to even) and random float32 bit patterns in range."""
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    midpoints = (halves[:-1].astype(np.float64) + halves[1:]) / 2
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 0x477FE000, 1 << 16, dtype=np.uint32).view(np.float32)
    values = np.concatenate([halves, -halves, midpoints.astype(np.float32), bits, -bits])
    values = values[: len(values) - len(values) % 8].reshape(1, -1, 8)
    got = fused_stats.prepare(values, "float32", "float16", 8, 0, threads=1)
    assert got.stored.tobytes() == values.astype(np.float16).tobytes()


def _conversion_inputs() -> tuple[np.ndarray, np.ndarray]:
    """(every float16 bit pattern but NaN payloads, float32 values: every finite float16, every
    midpoint between neighbours and random bit patterns within float16's range, both signs)."""
    bits = np.arange(0, 1 << 16, dtype=np.uint16)
    bits = bits[(bits & 0x7C00) != 0x7C00]  # Inf and NaN: refused before any conversion
    halves = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    midpoints = ((halves[:-1].astype(np.float64) + halves[1:]) / 2).astype(np.float32)
    random = np.random.default_rng(3).integers(0, 0x477FE000, 1 << 16, dtype=np.uint32).view(np.float32)
    values = np.concatenate([halves, midpoints, random])
    return bits, np.concatenate([values, -values])


@pytest.mark.parametrize("family", ["soft", "hard"])
def test_both_float16_conversions_round_as_numpy(family: str) -> None:
    """The integer (soft) and hardware (hard) conversions, whichever this host's kernels use:
    float16 -> float32 exact, float32 -> float16 and its value rounded to nearest even."""
    import numba

    from featurestore.core import fused_kernel

    if family == "hard" and not fused_kernel.HARDWARE_HALF:
        pytest.skip("this CPU target has no float16 conversion instructions (the soft ones are used)")
    to_f32 = getattr(fused_kernel, f"{family}_half_to_f32")
    to_half = getattr(fused_kernel, f"{family}_f32_to_half")
    value = getattr(fused_kernel, f"{family}_half_value")

    @numba.njit
    def convert(bits, values, widened, rounded, rounded_values):  # type: ignore[no-untyped-def]
        for i in range(bits.size):
            widened[i] = to_f32(bits[i])
        for i in range(values.size):
            rounded[i] = to_half(values[i])
            rounded_values[i] = value(values[i])

    bits, values = _conversion_inputs()
    widened = np.empty(bits.size, np.float32)
    rounded = np.empty(values.size, np.uint16)
    rounded_values = np.empty(values.size, np.float32)
    convert(bits, values, widened, rounded, rounded_values)
    assert widened.tobytes() == bits.view(np.float16).astype(np.float32).tobytes()
    assert rounded.tobytes() == values.astype(np.float16).tobytes()
    assert rounded_values.tobytes() == values.astype(np.float16).astype(np.float32).tobytes()


def test_a_target_without_float16_instructions_uses_the_soft_conversions(tmp_path: Path) -> None:
    """``NUMBA_CPU_NAME=generic`` lowers float16 conversions to helper calls numba does not link
    (a crash if called): the probe sees them, and the kernel's bytes stay numpy's."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from featurestore.core import fused_kernel, fused_stats\n"
        "x = np.random.default_rng(0).standard_normal((3, 40, 24)).astype(np.float32)\n"
        "got = fused_stats.prepare(x, 'float32', 'float16', 24, 0, threads=1)\n"
        "print(fused_kernel.HARDWARE_HALF, got.stored.tobytes() == x.astype(np.float16).tobytes())\n"
    )
    env = {**os.environ, "NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True"]


@pytest.mark.parametrize(("values", "stored", "error", "words"), [
    (np.float32(np.nan), "float16", NonFiniteValues, "1 NaN and 0 Inf"),
    (np.float32(-np.inf), "float32", NonFiniteValues, "0 NaN and 1 Inf"),
    (np.float32(70000), "float16", Float16Overflow, "float16's range"),
    (np.float32(3.4e38), "bfloat16", NonFiniteValues, "round to Inf in bfloat16"),
])
def test_refusals_match_the_other_paths(values: np.float32, stored: str, error: type, words: str) -> None:
    raw = _features(3, 16, 8)
    raw[1, 4, 2] = values
    with pytest.raises(error, match=words) as ours:
        fused_stats.prepare(raw, "float32", stored, 8, 10, threads=1)
    with pytest.raises(error) as theirs:
        prepare_numpy(raw, stored, 8, 10)
    assert str(ours.value) == str(theirs.value)
    assert "samples [10, 13)" in str(ours.value)


def test_float64_overflowing_float32_is_refused_as_out_of_range() -> None:
    raw = _features(2, 16, 8).astype(np.float64)
    raw[0, 0, 0] = 1e300
    with pytest.raises(Float16Overflow, match="abs max 1e"):
        fused_stats.prepare(raw, "float64", "float16", 8, 0, threads=1)


def test_the_writer_uses_the_kernel_and_stores_what_numpy_would(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A split written through the kernel holds the bytes and the report of one written through
    the numpy reference (numba switched off), chunk by chunk."""
    x = _features(12, 32, 24, seed=4)
    calls: list[int] = []
    real = fused_stats.prepare

    def counted(*args: object, **kwargs: object) -> fused_stats.Prepared:
        calls.append(len(args[0]))  # type: ignore[arg-type]  # create_split's warm-up: 1-row batches
        return real(*args, **kwargs)  # type: ignore[arg-type]

    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    monkeypatch.setattr(fused_stats, "prepare", counted)
    metas = {}
    for split, fused in (("fused", True), ("numpy", False)):
        monkeypatch.setattr(fused_stats, "available", lambda fused=fused: fused)
        monkeypatch.setattr("featurestore.core.intake._torch_available", lambda: False)
        w = store.create_split("d", "e", split, num_samples=12, sample_shape=(32, 24), dtype="float16", chunk_rows=5)
        for lo in range(0, 12, 4):
            w.write(lo, x[lo:lo + 4])
        metas[split] = w.commit()
    assert calls.count(4) == 3
    assert metas["fused"]["quantization"] == metas["numpy"]["quantization"]
    assert metas["fused"]["channel_stats"] == metas["numpy"]["channel_stats"]
    a = store.open("d", "e", "fused").read_numpy(np.arange(12))
    assert a.tobytes() == store.open("d", "e", "numpy").read_numpy(np.arange(12)).tobytes()


def test_a_borrowed_batch_is_copied_in_the_pass_and_a_donated_one_is_not(tmp_path: Path) -> None:
    x = _features(8, 16, 8).astype(np.float16)
    kept = fused_stats.prepare(x, "float16", "float16", 8, 0, threads=1, private=False)
    assert kept.aliases_source and np.shares_memory(kept.stored, x)
    copied = fused_stats.prepare(x, "float16", "float16", 8, 0, threads=1, private=True)
    assert not copied.aliases_source and copied.stored.tobytes() == x.tobytes()
    _same(kept, copied)


@pytest.mark.parametrize("stored", ["float16", "float32"])
def test_strided_and_read_only_batches_are_read_in_place(stored: str) -> None:
    """An encoder's tokens without the CLS token (each sample contiguous, the batch not) and a
    read-only batch give what their contiguous copies give."""
    tokens = _features(6, 17, 24, seed=7)
    strided = tokens[:, 1:]
    assert not strided.flags.c_contiguous
    contiguous = np.ascontiguousarray(strided)
    want = prepare_numpy(contiguous, stored, 24, 0)
    _same(fused_stats.prepare(strided, "float32", stored, 24, 0, threads=1), want)
    _same(fused_stats.prepare(strided[::2], "float32", stored, 24, 0, threads=1),
          prepare_numpy(np.ascontiguousarray(strided[::2]), stored, 24, 0))
    frozen = contiguous.copy()
    frozen.flags.writeable = False
    _same(fused_stats.prepare(frozen, "float32", stored, 24, 0, threads=1), want)


def test_a_kernel_that_cannot_load_falls_back_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. numba finding no writable cache directory: writes go on through torch/numpy."""
    import sys

    monkeypatch.setitem(sys.modules, "featurestore.core.fused_kernel", None)  # import now fails
    fused_stats.available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="fused CPU statistics kernel is off.*NUMBA_CACHE_DIR"):
            assert fused_stats.available() is False
    finally:
        fused_stats.available.cache_clear()


def test_warm_up_loads_the_kernel_a_batch_will_use_and_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Extraction loads the kernel on a thread while its image workers start (run in a fresh
    process: this one has loaded kernels already). A failure is left for the first write."""
    import subprocess
    import sys

    code = ("from featurestore.core import fused_kernel, fused_stats\n"
            "assert not fused_kernel.f32_bf16.signatures\n"
            "fused_stats.warm_up('float32', 'bfloat16')\n"
            "print(len(fused_kernel.f32_bf16.signatures), len(fused_kernel.f32_f16.signatures))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "0"]

    fused_stats.warm_up("int8", "float16")  # not a kind the kernel takes: nothing to load

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(fused_stats, "prepare", broken)
    fused_stats.warm_up("float32", "float16")  # swallowed: the first write meets it again


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
@pytest.mark.parametrize("source", ["float32", "bfloat16", "float64"])
def test_wide_values_are_summed_in_float64_as_the_numpy_reference(source: str, stored: str) -> None:
    """Bfloat16/float32 values reach 3.4e38; their squares overflowed (and below ~1e-19
    underflowed) the kernel's float32 group sums. Now both paths square them in float64, in the
    same order: the same bits, finite, right."""
    x = _features(4, 37, 70) * np.float32(1e-3)
    x[0, 5, 3], x[1, 20, 0], x[2, 36, 69], x[3, 0, 0] = 3.0e38, -1e22, 1e-30, 1e20
    raw, reference_input = _as(x, source)
    want = prepare_numpy(reference_input, stored, 70, 0)
    got = fused_stats.prepare(raw, source, stored, 70, 0, threads=2)
    _same(got, want)
    assert np.isfinite(got.rows.sq_error).all() and np.isfinite(got.rows.sq_source).all()
    if not is_exact(source, stored):  # exact storage has no error figures to take
        wide = reference_input.astype(np.float64)
        np.testing.assert_allclose(got.rows.sq_source, (wide**2).reshape(4, -1).sum(axis=1), rtol=1e-12)


def test_a_forked_child_writes_after_its_parent_wrote(tmp_path: Path) -> None:
    """The child of a process that wrote (its statistics pools made) writes too: it inherited the
    pools without their threads, and its first write waited on them forever."""
    import multiprocessing

    def write(name: str) -> None:
        writer = featurestore.open_store(str(tmp_path), mode="a").create_split(
            "ds", "enc", name, num_samples=600, sample_shape=(64,), chunk_rows=23, dtype="float32")
        writer.write(0, np.ones((600, 64), np.float32))
        writer.commit()

    write("parent")
    child = multiprocessing.get_context("fork").Process(target=write, args=("child",))
    child.start()
    child.join(60)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung and child.exitcode == 0, "the forked child's write hung or failed"
