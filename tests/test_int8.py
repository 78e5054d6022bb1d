"""int8 splits: the scheme's bound for every element, the report, plain Zarr, old readers refused,
resume after SIGKILL byte-identical, local and SeaweedFS equal, bad input refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import featurestore
from featurestore.errors import DtypeMismatch, NonFiniteValues, UnsupportedFormatVersion
from featurestore.format import int8, layout

from _core_helpers import comparable_chunk_file

SPLIT = ("ds", "enc", "train")


def vit_like(n: int, tokens: int = 6, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Gaussian tokens, two channels with massive activations, a high-norm prefix token, an
    all-zero channel and a constant one."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, tokens, dim)).astype(np.float32)
    x[:, :, [3, 11]] *= 100.0
    x[:, 0] *= 20.0
    x[:, :, 5] = 0.0
    x[:, :, 6] = -2.5
    return x


def write(url: str, x: np.ndarray, dtype: str = "int8", chunk_rows: int | None = 16,
          chunk_bytes: int | None = None, **options: Any) -> Any:
    store = featurestore.open_store(url, mode="a", **options)
    writer = store.create_split(*SPLIT, num_samples=len(x), sample_shape=x.shape[1:], dtype=dtype,
                                chunk_rows=chunk_rows, chunk_bytes=chunk_bytes)
    for lo in range(0, len(x), 7):  # batches that cut across chunks
        writer.write(lo, x[lo:lo + 7])
    writer.commit()
    return store


# ---------------------------------------------------------------------- the scheme's bound
@st.composite
def chunks_of_values(draw: Any) -> np.ndarray:
    rows = draw(st.integers(1, 40))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
    seed = draw(st.integers(0, 2**31 - 1))
    magnitude = draw(st.sampled_from([1e-40, 1e-30, 1e-6, 1.0, 1e4, 1e30, 3e38]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, *shape)) * magnitude
    flat = x.reshape(rows, -1)
    if draw(st.booleans()):  # a channel with massive activations
        flat[:, draw(st.integers(0, flat.shape[1] - 1))] *= 1000.0 if magnitude < 1e34 else 1.0
    if draw(st.booleans()):
        flat[:, draw(st.integers(0, flat.shape[1] - 1))] = 0.0
    if draw(st.booleans()):
        flat[:, draw(st.integers(0, flat.shape[1] - 1))] = draw(st.floats(-1e6, 1e6, width=32))
    return np.clip(x, -3.4e38, 3.4e38).astype(np.float32)


@settings(max_examples=300, deadline=None)
@given(chunks_of_values())
def test_every_element_within_the_schemes_bound(x: np.ndarray) -> None:
    codes, scales, saturated = int8.encode(x)
    assert codes.dtype == np.int8 and codes.shape == x.shape and scales.shape == x.shape[1:]
    assert scales.dtype == np.float32 and codes.min(initial=0) >= -127
    back = int8.decode(codes, scales)
    error = np.abs(back.astype(np.float64) - x.astype(np.float64))
    assert np.all(error <= int8.error_bound(scales)), float((error - int8.error_bound(scales)).max())
    assert saturated == 0 or float(scales.max()) < 1.2e-38  # only a scale below float32's normal range
    assert np.all(back[:, np.all(x == 0, axis=0)] == 0)  # all-zero positions come back zero
    out = np.empty(x.shape, np.float32)  # the readers' vectorized path gives the same values
    int8.dequantize_into(codes, np.zeros(len(x), np.int64), scales[None], out)
    assert np.array_equal(out, back)


@settings(max_examples=12, deadline=None)
@given(chunks_of_values(), st.integers(1, 17), st.integers(1, 9))
def test_a_written_split_is_within_the_bound_for_every_element(x: np.ndarray, chunk_rows: int, batch: int) -> None:
    """Through the writer: any chunk geometry and batch cut, edge chunks padded, every element of
    the split read back within the bound of its own chunk's scale."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        store = featurestore.open_store(root, mode="a")
        writer = store.create_split(*SPLIT, num_samples=len(x), sample_shape=x.shape[1:], dtype="int8",
                                    chunk_rows=chunk_rows)
        for lo in range(0, len(x), batch):
            writer.write(lo, x[lo:lo + batch])
        writer.commit()
        array = store.open(*SPLIT)
        back = array.read_numpy(np.arange(len(x)), dtype="float32")
        scales = array.scales.table()[np.arange(len(x)) // array.chunk_rows]
        error = np.abs(back.astype(np.float64) - x.astype(np.float64))
        assert np.all(error <= int8.error_bound(scales))
        tiny = float(scales[scales > 0].min(initial=np.inf)) < 1.2e-38  # saturation needs such a scale
        assert store.split_metadata(*SPLIT)["quantization"]["saturation_count"] == 0 or tiny


# ---------------------------------------------------------------------- dense splits
def test_report_reads_and_bytes_against_float16(tmp_path: Path) -> None:
    x = vit_like(256)
    # chunk sizes in bytes: int8 chunks grow to MIN_CHUNK_ROWS rows (here 2 chunks, float16 8)
    store = write(str(tmp_path / "i8"), x, chunk_rows=None, chunk_bytes=32 * 6 * 32)
    write(str(tmp_path / "f16"), x, dtype="float16", chunk_rows=None, chunk_bytes=32 * 6 * 32 * 2)
    assert store.open(*SPLIT).chunk_rows == int8.MIN_CHUNK_ROWS
    meta = store.split_metadata(*SPLIT)
    assert meta["format_version"] == layout.INT8_FORMAT_VERSION and meta["logical_dtype"] == "int8"
    q = meta["quantization"]
    assert q["stored_dtype"] == "int8" and not q["exact"]
    assert q["saturation_count"] == 0 and q["nan_count"] == 0
    array = store.open(*SPLIT)
    back = array.read_numpy(np.arange(len(x)), dtype="float32")
    rel_rms = np.sqrt(((back - x) ** 2).sum() / (x ** 2).sum())
    assert q["rel_rms_error"] == pytest.approx(rel_rms, rel=1e-4) and rel_rms <= 0.01
    assert q["max_abs_error"] == pytest.approx(np.abs(back - x).max(), rel=1e-6)
    assert q["abs_max"] == pytest.approx(np.abs(x).max())
    # every element within the bound of its chunk's scale
    scales = array.scales.table()
    bound = int8.error_bound(scales)[np.arange(len(x)) // array.chunk_rows]
    assert np.all(np.abs(back - x) <= bound)
    # shuffled rows and float16 give the same values; no dtype: the stored codes
    index = np.random.default_rng(1).permutation(len(x))[:37]
    assert np.array_equal(array.read_numpy(index, dtype="float32"), back[index])
    out16 = np.empty((37, *x.shape[1:]), np.float16)
    assert array.read_numpy(index, out=out16, dtype="float16") is out16
    assert np.array_equal(out16, back[index].astype(np.float16))
    assert array.read_numpy(index).dtype == np.int8
    with pytest.raises(DtypeMismatch, match="int64"):
        array.read_numpy(index, dtype="int64")
    # the channel statistics describe the values back
    assert np.allclose(meta["channel_stats"]["mean"], back.reshape(-1, x.shape[-1]).mean(axis=0), atol=1e-3)
    # bytes on storage, scales included, against the float16 split of the same features
    def size(root: Path, *arrays: str) -> int:
        return sum(f.stat().st_size for a in arrays for f in (root / "ds/enc/train" / a / "c").rglob("*") if f.is_file())
    ratio = size(tmp_path / "i8", "features", "scales") / size(tmp_path / "f16", "features")
    assert ratio <= 0.52, ratio


def test_plain_zarr_reads_codes_and_scales(tmp_path: Path) -> None:
    import zarr

    x = vit_like(50)
    store = write(str(tmp_path / "s"), x)
    group = zarr.open_group(str(tmp_path / "s/ds/enc/train"), mode="r")
    codes, scales = group["features"][:], group["scales"][:]
    assert codes.dtype == np.int8 and scales.dtype == np.float32 and scales.shape == (4, 6, 32)
    # the formula of docs/FORMAT.md
    values = codes * scales[np.arange(len(codes)) // group["features"].chunks[0]]
    assert np.array_equal(values, store.open(*SPLIT).read_numpy(np.arange(50), dtype="float32"))


def test_an_older_reader_refuses_an_int8_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(str(tmp_path / "s"), vit_like(20))
    write(str(tmp_path / "f"), vit_like(20), dtype="float16")
    assert featurestore.open_store(str(tmp_path / "f")).split_metadata(*SPLIT)["format_version"] == 1
    monkeypatch.setattr(layout, "READ_FORMAT_VERSION", layout.BAGS_FORMAT_VERSION)
    featurestore.open_store(str(tmp_path / "f")).open(*SPLIT)  # float16 splits keep version 1
    with pytest.raises(UnsupportedFormatVersion, match="version 3"):
        featurestore.open_store(str(tmp_path / "s")).open(*SPLIT)


def test_non_finite_and_out_of_range_values_are_refused(tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path), mode="a")
    writer = store.create_split(*SPLIT, num_samples=8, sample_shape=(4,), dtype="int8", chunk_rows=4)
    for bad, error in ((np.inf, NonFiniteValues), (np.nan, NonFiniteValues)):
        x = np.ones((4, 4), np.float32)
        x[1, 2] = bad
        with pytest.raises(error, match="non-finite"):
            writer.write(0, x)
    with pytest.raises(NonFiniteValues, match="float32"):
        writer.write(0, np.full((4, 4), 1e39))
    writer.write(0, np.full((4, 4), 7e4, np.float32))  # float16's range does not bound int8: scales are float32
    assert writer.report()["quantization"]["abs_max"] == pytest.approx(7e4)


def bag_values(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, n in (("s-03", 50), ("s-01", 7), ("s-02", 0), ("s-04", 300), ("s-00", 1)):
        x = rng.standard_normal((n, 16)).astype(np.float32)
        x[:, 2] *= 100.0  # a channel with massive activations
        x[:, 5] = 0.0
        out[name] = x
    return out


def write_bags(url: str, values: dict[str, np.ndarray], **options: Any) -> Any:
    store = featurestore.open_store(url, mode="a", **options)
    writer = store.create_bag_split(*SPLIT, dim=16, dtype="int8", chunk_bytes=64 * 16)
    for name, x in values.items():
        writer.add_bag(name, x)
    writer.commit()
    return store


def test_bag_split_round_trip_plain_zarr_and_report(tmp_path: Path) -> None:
    import zarr

    from featurestore.cli import main

    values = bag_values()
    store = write_bags(str(tmp_path / "s"), values)
    meta = store.split_metadata(*SPLIT)
    assert meta["format_version"] == layout.INT8_FORMAT_VERSION
    q = meta["quantization"]
    assert q["stored_dtype"] == "int8" and q["saturation_count"] == 0 and q["rel_rms_error"] <= 0.01
    split = store.open_bags(*SPLIT)
    for name, x in values.items():
        codes, _ = split.read_numpy(name)
        back, _ = split.read_numpy(name, dtype="float32")
        assert codes.dtype == np.int8 and back.dtype == np.float32
        scale = split.scales[split.position(name)]
        assert np.all(np.abs(back - x) <= int8.error_bound(scale))  # per (bag, channel)
        half, _ = split.read_numpy(name, dtype="float16")
        assert np.array_equal(half, back.astype(np.float16))
    # plain zarr: bag i's values are features[offsets[i]:offsets[i+1]] * scales[i]
    group = zarr.open_group(str(tmp_path / "s/ds/enc/train"), mode="r")
    offsets, scales = group["offsets"][:], group["scales"][:]
    everything = group["features"][:] * np.repeat(scales, np.diff(offsets), axis=0)
    for i, name in enumerate(split.ids):
        assert np.array_equal(everything[offsets[i]:offsets[i + 1]], split.read_numpy(name, dtype="float32")[0])
    assert main(["verify", str(tmp_path / "s")]) == 0


def test_bag_split_on_seaweedfs_equals_local(tmp_path: Path, seaweed_url: str, seaweed: Any) -> None:
    values = bag_values(1)
    local = write_bags(str(tmp_path / "s"), values).open_bags(*SPLIT)
    remote = write_bags(seaweed_url, values, **seaweed.storage_options).open_bags(*SPLIT)
    for name in values:
        assert np.array_equal(remote.read_numpy(name)[0], local.read_numpy(name)[0])
        assert np.array_equal(remote.read_numpy(name, dtype="float32")[0], local.read_numpy(name, dtype="float32")[0])


def test_seaweedfs_equals_local(tmp_path: Path, seaweed_url: str, seaweed: Any) -> None:
    x = vit_like(45)
    local = write(str(tmp_path / "s"), x).open(*SPLIT)
    remote = write(seaweed_url, x, **seaweed.storage_options).open(*SPLIT)
    index = np.random.default_rng(2).permutation(45)
    assert np.array_equal(remote.read_numpy(index), local.read_numpy(index))
    assert np.array_equal(remote.read_numpy(index, dtype="float32"), local.read_numpy(index, dtype="float32"))


# ---------------------------------------------------------------------- crash safety
WRITER = r"""
import sys, time
import numpy as np
import featurestore
sys.path.insert(0, sys.argv[3])
from test_int8 import vit_like
root, resume = sys.argv[1], sys.argv[2] == "resume"
x = vit_like(70)
w = featurestore.open_store(root, mode="a").create_split("ds", "enc", "train", num_samples=70,
        sample_shape=(6, 32), dtype="int8", chunk_rows=8, resume=resume)
print("pending", *w.pending_chunks(), flush=True)
for lo in range(0, 70, 5):
    w.write(lo, x[lo:lo + 5])
    w.flush()
    print("progress", lo, flush=True)
    if lo == 30 and not resume:
        time.sleep(60)
w.commit()
print("done", flush=True)
"""


def _files(root: Path, arrays: tuple[str, ...] = ("features", "scales", "chunk_stats")) -> dict[str, bytes]:
    base = root / "ds/enc/train"
    return {str(p.relative_to(base)): comparable_chunk_file(str(p.relative_to(base)), p.read_bytes())
            for a in arrays for p in sorted((base / a).rglob("*")) if p.is_file() and "/c/" in str(p)}


def _run(root: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), mode, str(Path(__file__).parent)],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_sigkill_then_resume_is_byte_identical(tmp_path: Path) -> None:
    reference = tmp_path / "ref"
    write(str(reference), vit_like(70), chunk_rows=8)
    killed = _run(tmp_path / "s", "fresh")
    assert killed.stdout is not None
    for line in killed.stdout:
        if line.startswith("progress 30"):
            break
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert featurestore.open_store(str(tmp_path / "s")).split_status(*SPLIT) == "writing"
    resumed = _run(tmp_path / "s", "resume")
    out, _ = resumed.communicate(timeout=300)
    pending = [int(v) for v in out.splitlines()[0].split()[1:]]
    assert out.splitlines()[-1] == "done" and 0 not in pending and 8 in pending
    assert _files(tmp_path / "s") == _files(reference)


# ---------------------------------------------------------------------- the CLI
def test_extract_and_import_with_dtype_int8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from featurestore.cli import main

    images = np.random.default_rng(0).integers(0, 256, (10, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    common = ["--images", f"npy:{tmp_path / 'x.npy'}", "--encoder", "builtin:tiny-vit", "--store",
              str(tmp_path / "s"), "--dataset", "toy", "--batch-size", "4", "--num-workers", "0", "--no-progress"]
    assert main(["extract", *common, "--split", "i8", "--dtype", "int8"]) == 0
    assert main(["extract", *common, "--split", "f32", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "float32 -> int8" in out and "extracted toy/tiny-vit/i8" in out
    store = featurestore.open_store(str(tmp_path / "s"))
    i8, f32 = store.open("toy", "tiny-vit", "i8"), store.open("toy", "tiny-vit", "f32")
    x, back = f32.read_numpy(np.arange(10)), i8.read_numpy(np.arange(10), dtype="float32")
    rel_rms = float(np.sqrt(((back - x) ** 2).sum() / (x ** 2).sum()))
    assert rel_rms <= 0.01 and i8.metadata["quantization"]["rel_rms_error"] == pytest.approx(rel_rms, rel=1e-3)
    # a dense cache imported as int8 gives the same codes as the extraction
    np.save(tmp_path / "cache.npy", x)
    assert main(["import", str(tmp_path / "cache.npy"), "--store", str(tmp_path / "s"), "--dataset", "toy",
                 "--encoder-name", "tiny-vit", "--split", "imported", "--dtype", "int8", "--no-progress"]) == 0
    imported = store.open("toy", "tiny-vit", "imported")
    assert imported.chunk_rows == i8.chunk_rows == 10
    assert np.array_equal(imported.read_numpy(np.arange(10)), i8.read_numpy(np.arange(10)))


def test_a_lost_scales_row_is_damage_verify_finds_and_resume_rewrites(tmp_path: Path) -> None:
    from featurestore.cli import main

    x = vit_like(40)
    write(str(tmp_path / "s"), x, chunk_rows=16)
    (tmp_path / "s/ds/enc/train/scales/c/1/0/0").unlink()
    assert main(["verify", str(tmp_path / "s")]) != 0
    writer = featurestore.open_store(str(tmp_path / "s"), mode="a").create_split(
        *SPLIT, num_samples=40, sample_shape=x.shape[1:], dtype="int8", chunk_rows=16, resume=True)
    assert writer.pending_chunks() == [1]
    writer.write(16, x[16:32])
    writer.commit()
    assert main(["verify", str(tmp_path / "s")]) == 0
    back = featurestore.open_store(str(tmp_path / "s")).open(*SPLIT).read_numpy(np.arange(40), dtype="float32")
    assert np.sqrt(((back - x) ** 2).sum() / (x ** 2).sum()) <= 0.01


def test_writers_of_disjoint_chunks_equal_one_writer(tmp_path: Path) -> None:
    """The torchrun rule (chunk i to rank i % 2): scales are per chunk, so each rank's chunks are
    the one writer's, byte for byte."""
    x = vit_like(70)
    write(str(tmp_path / "one"), x, chunk_rows=8)
    store = featurestore.open_store(str(tmp_path / "two"), mode="a")
    create = dict(num_samples=70, sample_shape=x.shape[1:], dtype="int8", chunk_rows=8)
    store.create_split(*SPLIT, **create).close()
    ranks = [store.create_split(*SPLIT, **create, resume=True) for _ in (0, 1)]
    for rank, writer in enumerate(ranks):
        for i in range(rank, writer.num_chunks, 2):
            lo, hi = writer.chunk_range(i)
            writer.write(lo, x[lo:hi])
        writer.close()
    ranks[0].commit()
    assert _files(tmp_path / "two") == _files(tmp_path / "one")
    q1 = featurestore.open_store(str(tmp_path / "one")).split_metadata(*SPLIT)["quantization"]
    assert store.split_metadata(*SPLIT)["quantization"] == q1


BAG_WRITER = r"""
import sys, time
import featurestore
sys.path.insert(0, sys.argv[3])
from test_int8 import SPLIT, bag_values
root, resume = sys.argv[1], sys.argv[2] == "resume"
w = featurestore.open_store(root, mode="a").create_bag_split(*SPLIT, dim=16, dtype="int8",
        chunk_bytes=64 * 16, resume=resume)
print("done", *sorted(w.done_ids), flush=True)
for name, x in bag_values().items():
    if name in w.done_ids:
        continue
    w.add_bag(name, x)
    if name == "s-04" and not resume:
        w.close()  # its chunks and records on storage, then killed before the commit
        print("added", flush=True)
        time.sleep(60)
w.commit()
print("committed", flush=True)
"""


def test_bag_writer_sigkill_then_resume_is_byte_identical(tmp_path: Path) -> None:
    write_bags(str(tmp_path / "ref"), bag_values())
    killed = subprocess.Popen([sys.executable, "-c", BAG_WRITER, str(tmp_path / "s"), "fresh", str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None
    assert killed.stdout.readline().startswith("done") and killed.stdout.readline() == "added\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    resumed = subprocess.run([sys.executable, "-c", BAG_WRITER, str(tmp_path / "s"), "resume", str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0] == "done s-01 s-02 s-03 s-04"  # s-00 was never added
    arrays = ("features", "scales", "offsets")
    assert _files(tmp_path / "s", arrays) == _files(tmp_path / "ref", arrays)


def test_import_of_a_bag_cache_with_dtype_int8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import h5py

    from featurestore.cli import main

    rng = np.random.default_rng(3)
    (tmp_path / "feats").mkdir()
    data = {}
    for slide, n in {"B": 40, "A": 130, "C": 0}.items():
        x = rng.standard_normal((n, 16)).astype(np.float32)
        x[:, 4] *= 200.0
        data[slide] = x
        with h5py.File(tmp_path / "feats" / f"{slide}.h5", "w") as f:
            f.create_dataset("features", data=x)
            f.create_dataset("coords", data=np.zeros((n, 2), np.int64))
    assert main(["import", str(tmp_path / "feats"), "--store", str(tmp_path / "s"), "--dataset", "ds",
                 "--encoder-name", "enc", "--split", "train", "--dtype", "int8", "--no-progress"]) == 0
    assert "170 patches x 16 int8" in capsys.readouterr().out
    split = featurestore.open_store(str(tmp_path / "s")).open_bags(*SPLIT)
    for slide, x in data.items():
        back, _ = split.read_numpy(slide, dtype="float32")
        assert np.all(np.abs(back - x) <= int8.error_bound(split.scales[split.position(slide)]))





def test_float32_max_comes_back_finite() -> None:
    """Its scale, absmax / 127 rounded up, decoded 127 x scale as inf (the report then null)."""
    from featurestore.format import int8

    top = np.finfo(np.float32).max
    scales = int8.scales_for(np.array([top, 1.0], np.float32))
    values = int8.decode(np.array([[127, 127], [-127, -1]], np.int8), scales)
    assert np.isfinite(values).all() and abs(float(values[0, 0]) - float(top)) <= float(scales[0])
    assert scales[1] == np.float32(1.0 / 127)  # every other scale as before
