"""``featurestore import``: per-sample directories, HDF5, tensor files; precision; resume; errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import featurestore
from featurestore.cli import main
from featurestore.errors import CacheKeyMismatch, NonFiniteValues, ShapeMismatch
from featurestore.extract.importer import ImportOptions, import_cache
from featurestore.extract.sources import SourceError

N, T, D = 40, 4, 8  # samples of [4, 8]: a 2x2 grid in --grid 2 2, or 1 prefix token + ... (see tests)


def feats(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randn(n, T, D, generator=torch.Generator().manual_seed(seed)) * 3


def opts(tmp_path: Path, source: Path | str, split: str = "s", **kw: object) -> ImportOptions:
    return ImportOptions(source=str(source), store=str(tmp_path / "store"), dataset="ds", encoder_name="enc",
                         split=split, progress=False, **kw)  # type: ignore[arg-type]


def stored(tmp_path: Path, split: str = "s") -> featurestore.core.reader.FeatureArray:  # type: ignore[name-defined]
    return featurestore.open_store(str(tmp_path / "store")).open("ds", "enc", split)


def test_directory_of_pt_files_float16_with_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    x = feats()
    (tmp_path / "c").mkdir()
    for i in range(N):  # names in natural order: s2 before s10
        torch.save(x[i].clone(), tmp_path / "c" / f"s{i}.pt")
    rc = main(["import", str(tmp_path / "c"), "--store", str(tmp_path / "store"), "--dataset", "ds",
               "--encoder-name", "enc", "--split", "s", "--no-progress", "--labels", str(_labels(tmp_path))])
    assert rc == 0
    out = capsys.readouterr().out
    assert "quantization: float32 -> float16: max abs error" in out and "imported ds/enc/s: 40x4x8 float16" in out
    arr = stored(tmp_path)
    assert arr.dtype == "float16" and arr.shape == (N, T, D)
    assert torch.equal(arr.read(list(range(N))), x.half())
    assert arr.metadata["quantization"]["max_abs_error"] > 0
    assert arr.metadata["token_layout"]["grid"] == [2, 2] and arr.metadata["source_dtype"] == "float32"
    assert arr.metadata["encoder"]["spec"].startswith("import:dir:")
    assert torch.equal(arr.labels.read([0, 39]), torch.tensor([0, 39 % 3]).to(arr.labels.read([0]).dtype))
    ids = featurestore.open_store(str(tmp_path / "store")).open("ds", "enc", "s").ids  # type: ignore[attr-defined]
    assert list(ids[:3]) == ["s0", "s1", "s2"] and ids[10] == "s10"


def _labels(tmp_path: Path) -> Path:
    np.save(tmp_path / "labels.npy", (np.arange(N) % 3).astype(np.int64))
    return tmp_path / "labels.npy"


def test_directory_of_npy_and_a_second_run_is_a_no_op(tmp_path: Path) -> None:
    x = feats(1).numpy()
    (tmp_path / "c").mkdir()
    for i in range(N):
        np.save(tmp_path / "c" / f"{i:03d}.npy", x[i])
    first = import_cache(opts(tmp_path, tmp_path / "c", dtype="float32"))
    assert first.status == "complete" and first.imported == N
    assert np.array_equal(stored(tmp_path).read(list(range(N))).numpy(), x)
    assert stored(tmp_path).metadata["quantization"]["exact"]
    assert import_cache(opts(tmp_path, tmp_path / "c", dtype="float32")).status == "already-complete"
    with pytest.raises(CacheKeyMismatch, match="--overwrite"):
        import_cache(opts(tmp_path, tmp_path / "c", dtype="float16"))


def test_torch_tensor_file_memory_mapped_bfloat16_kept(tmp_path: Path) -> None:
    x = feats(2).bfloat16()
    torch.save(x, tmp_path / "cache.pt")
    result = import_cache(opts(tmp_path, tmp_path / "cache.pt", prefix_tokens=0, grid=(1, 4)))
    arr = stored(tmp_path)
    assert result.imported == N and arr.dtype == "bfloat16"
    assert torch.equal(arr.read(list(range(N))), x)  # bfloat16 kept bit for bit
    assert arr.metadata["token_layout"]["grid"] == [1, 4]
    # A dict of tensors needs --key.
    torch.save({"feats": x.float(), "labels": torch.zeros(N)}, tmp_path / "d.pt")
    with pytest.raises(SourceError, match="--key"):
        import_cache(opts(tmp_path, tmp_path / "d.pt", split="d"))
    import_cache(opts(tmp_path, tmp_path / "d.pt", split="d", key="feats", dtype="float32"))
    assert torch.equal(stored(tmp_path, "d").read([5]), x.float()[5:6])
    # The labels of the same dict by their key; an unknown key names the dict's keys.
    import_cache(opts(tmp_path, tmp_path / "d.pt", split="dl", key="feats", labels="labels", dtype="float32"))
    assert stored(tmp_path, "dl").labels.read([5]).tolist() == [0.0]
    with pytest.raises(SourceError, match=r"--labels 'label' is neither a .npy/.pt file nor a key of the torch dict .*\(it has: feats, "
                                          r"labels\)"):
        import_cache(opts(tmp_path, tmp_path / "d.pt", split="dx", key="feats", labels="label"))
    assert "dx" not in featurestore.open_store(str(tmp_path / "store")).splits("ds", "enc")  # nothing written


def test_hdf5_one_array_and_one_dataset_per_sample(tmp_path: Path) -> None:
    h5py = pytest.importorskip("h5py")
    x = feats(3).numpy()
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["embeddings"] = x
        f["labels"] = np.arange(N, dtype=np.int64) % 4
    import_cache(opts(tmp_path, tmp_path / "a.h5", split="a", labels="labels", dtype="float32"))
    arr = stored(tmp_path, "a")
    assert np.array_equal(arr.read(list(range(N))).numpy(), x)
    assert arr.labels is not None and arr.labels.read([7]).tolist() == [3]
    with h5py.File(tmp_path / "b.h5", "w") as f:
        group = f.create_group("per_sample")
        for i in range(N):
            group[f"tile_{i}"] = x[i]
    import_cache(opts(tmp_path, tmp_path / "b.h5", split="b", key="per_sample", dtype="float32"))
    assert np.array_equal(stored(tmp_path, "b").read(list(range(N))).numpy(), x)


def test_ragged_input_is_one_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "c").mkdir()
    for i in range(N):
        torch.save(torch.zeros(T + (i == 17), D), tmp_path / "c" / f"{i}.pt")
    with pytest.raises(ShapeMismatch, match=r"sample 17 \(17.pt\) is float32 \[5, 8\] but sample 0"):
        import_cache(opts(tmp_path, tmp_path / "c", dtype="float32"))
    rc = main(["import", str(tmp_path / "c"), "--store", str(tmp_path / "store"), "--dataset", "ds",
               "--encoder-name", "enc", "--split", "r", "--no-progress", "--dtype", "float32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "sample 17 (17.pt)" in err[0]
    np.save(tmp_path / "labels.npy", np.zeros(N + 1))
    torch.save(feats(), tmp_path / "f.pt")
    with pytest.raises(ShapeMismatch, match="one label row per sample"):
        import_cache(opts(tmp_path, tmp_path / "f.pt", split="m", labels=str(tmp_path / "labels.npy")))
    np.save(tmp_path / "ints.npy", np.zeros((N, T, D), dtype=np.int32))
    with pytest.raises(ShapeMismatch, match="float features"):
        import_cache(opts(tmp_path, tmp_path / "ints.npy", split="i"))


def test_bad_token_layout_and_an_empty_cache_are_refused_before_a_split(tmp_path: Path) -> None:
    """A non-positive --grid was stored as the split's grid; an empty cache named no file and no fix."""
    torch.save(feats(), tmp_path / "f.pt")
    for grid in ((-2, -2), (0, 4)):
        with pytest.raises(ShapeMismatch, match=rf"--grid {grid[0]} {grid[1]}: H and W must be positive.*--grid 1 4"):
            import_cache(opts(tmp_path, tmp_path / "f.pt", split="g", grid=grid))
    with pytest.raises(ShapeMismatch, match=r"--grid 3 3 needs 9 .*give H W with H x W = 4"):
        import_cache(opts(tmp_path, tmp_path / "f.pt", split="g", grid=(3, 3)))
    with pytest.raises(ShapeMismatch, match=r"--prefix-tokens 7 does not fit .*: give 0 to 3"):
        import_cache(opts(tmp_path, tmp_path / "f.pt", split="g", prefix_tokens=7))
    np.save(tmp_path / "none.npy", np.zeros((0, T, D), dtype=np.float32))
    with pytest.raises(SourceError, match=r"cache '.*none\.npy' holds 0 samples .*at least one sample"):
        import_cache(opts(tmp_path, tmp_path / "none.npy", split="g"))
    assert not (tmp_path / "store").exists()  # nothing written


def test_reading_a_split_an_import_left_incomplete_names_a_fix_that_fits(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """The message said `featurestore extract ... --resume` (not how this split was written) and
    allow_incomplete=True, which no CLI verb takes."""
    from featurestore.errors import IncompleteSplit

    x = feats()
    x[0, 0, 0] = float("nan")
    torch.save(x, tmp_path / "f.pt")
    with pytest.raises(NonFiniteValues):
        import_cache(opts(tmp_path, tmp_path / "f.pt", split="w"))
    fix = (r"plus --resume \(`featurestore extract \.\.\.` or `featurestore import \.\.\.`\); "
           r"or, in Python, .*allow_incomplete")
    with pytest.raises(IncompleteSplit, match=fix):
        stored(tmp_path, "w")
    rc = main(["probe", str(tmp_path / "store"), "--dataset", "ds", "--encoder", "enc", "--train", "w", "--eval", "w",
               "--quiet", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "`featurestore import ...`" in err, err


def test_values_refused_mid_import_give_an_import_s_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A value float16 cannot hold (or a NaN) found after the split was made: the message gives a
    fix that works (--dtype bfloat16 alone was refused: the split exists, incomplete), and names
    no extraction flag (--precision)."""
    x = feats().numpy()
    x[30, 1, 2] = 1e5
    np.save(tmp_path / "big.npy", x)
    base = ["import", str(tmp_path / "big.npy"), "--store", str(tmp_path / "store"), "--dataset", "ds",
            "--encoder-name", "enc", "--split", "b", "--no-progress", "--chunk-mb", str(8 * T * D * 2 / 2**20)]
    assert main([*base, "--dtype", "float16"]) == 1
    err = capsys.readouterr().err
    assert "exceed float16's range" in err and "then rerun with --overwrite" in err and "--precision" not in err, err
    assert main([*base, "--dtype", "bfloat16", "--overwrite"]) == 0  # the fix as given
    capsys.readouterr()
    x[30, 1, 2] = np.nan
    np.save(tmp_path / "nan.npy", x)
    base[1], base[9] = str(tmp_path / "nan.npy"), "n"
    assert main(base) == 1
    err = capsys.readouterr().err
    assert "1 NaN and 0 Inf values" in err and "Fix those samples in the cache" in err, err
    assert "--precision" not in err and "then rerun with --overwrite" in err, err


def test_resume_reads_only_the_missing_chunks(tmp_path: Path) -> None:
    x = feats(4)
    (tmp_path / "c").mkdir()
    for i in range(N):
        torch.save(x[i].clone(), tmp_path / "c" / f"{i}.pt")
    good = (tmp_path / "c" / "33.pt").read_bytes()  # sample 33 is not among the fingerprinted files
    (tmp_path / "c" / "33.pt").write_bytes(b"\0" * len(good))  # a damaged file, same size
    small = {"dtype": "float32", "chunk_mb": 8 * T * D * 4 / (1 << 20), "batch_size": 3}  # 8 rows per chunk
    with pytest.raises(SourceError, match="33.pt"):
        import_cache(opts(tmp_path, tmp_path / "c", **small))
    assert featurestore.open_store(str(tmp_path / "store")).split_metadata("ds", "enc", "s")["status"] == "writing"
    (tmp_path / "c" / "33.pt").write_bytes(good)
    result = import_cache(opts(tmp_path, tmp_path / "c", resume=True, **small))
    assert result.status == "complete" and result.imported == 8  # chunks 0-3 were kept
    assert torch.equal(stored(tmp_path).read(list(range(N))), x)


def test_import_repairs_flipped_bytes_and_swapped_chunks_with_verify_chunks(tmp_path: Path) -> None:
    """`import` had no --verify-chunks, so the advised repair did not exist for it."""
    x = feats(7).numpy()
    np.save(tmp_path / "x.npy", x)
    small = {"dtype": "float32", "chunk_mb": 8 * T * D * 4 / (1 << 20)}  # 8 rows per chunk, 5 chunks
    assert import_cache(opts(tmp_path, tmp_path / "x.npy", **small)).status == "complete"
    chunks = tmp_path / "store" / "ds" / "enc" / "s" / "features" / "c"
    first, last = chunks / "0" / "0" / "0", chunks / "4" / "0" / "0"
    a, b = first.read_bytes(), last.read_bytes()
    first.write_bytes(b)
    last.write_bytes(a)  # swapped: each crc32c still valid
    flipped = chunks / "2" / "0" / "0"
    raw = bytearray(flipped.read_bytes())
    raw[7] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    assert import_cache(opts(tmp_path, tmp_path / "x.npy", resume=True, **small)).status == "already-complete"
    rc = main(["import", str(tmp_path / "x.npy"), "--store", str(tmp_path / "store"), "--dataset", "ds",
               "--encoder-name", "enc", "--split", "s", "--dtype", "float32", "--chunk-mb", str(small["chunk_mb"]),
               "--resume", "--verify-chunks", "--no-progress"])
    assert rc == 0
    assert torch.equal(stored(tmp_path).read(list(range(N))), torch.from_numpy(x))
    assert featurestore.open_store(str(tmp_path / "store")).split_metadata("ds", "enc", "s")["status"] == "complete"


def test_a_directory_of_one_bag_per_file_is_pointed_to_bags_before_anything_is_written(tmp_path: Path) -> None:
    source = tmp_path / "features"
    source.mkdir()
    for i, n in enumerate((5, 9, 3)):  # one slide's [n, D] patches per file, as CLAM's pt_files under another name
        torch.save(torch.randn(n, D), source / f"slide{i}.pt")
    with pytest.raises(ShapeMismatch, match=r"sample 2 \(slide2\.pt\) is float32 \[3, 8\] .* import the directory as a "
                                            r"bag split with --bags\)$"):
        import_cache(opts(tmp_path, source))
    assert not (tmp_path / "store").exists()  # refused before any split was made: no --overwrite needed after
    assert import_cache(opts(tmp_path, source, bags=True)).imported == 3
    assert featurestore.open_store(str(tmp_path / "store")).open_bags("ds", "enc", "s").lengths.tolist() == [5, 9, 3]
