"""Checked reads: damaged chunks are refused with their name, locally and on S3.

Each case damages one chunk of a complete split the way a disk or a careless copy would (a
flipped byte, a truncated chunk, a deleted chunk) and reads rows of it. Before checked reads the
flipped byte was served as data, the truncated chunk gave a raw ``ValueError: buffer is smaller
than requested size`` and the deleted one a message about unwritten chunks with no name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.errors import CorruptChunk, MissingChunks
from featurestore.format import layout

N, SHAPE, ROWS = 24, (4, 16), 4  # 6 chunks of 4 rows, float16: 128 bytes a row
CHUNK = 2  # the damaged chunk: rows 8..11
KEY = layout.chunk_key(layout.split_key("ds", "enc", "s") + "/features", CHUNK, 3)


def _write_split(url: str, options: dict[str, Any], values: np.ndarray) -> None:
    """One complete float16 split ``ds/enc/s`` of ``values``, in chunks of ``ROWS`` rows."""
    store = featurestore.open_store(url, mode="a", **options)
    writer = store.create_split("ds", "enc", "s", num_samples=N, sample_shape=SHAPE, dtype="float16",
                                chunk_bytes=ROWS * 128)
    writer.write(0, values)
    writer.commit()


@pytest.fixture(params=["local", "s3"])
def damaged_store(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, dict[str, Any], Any]:
    """(url, options, fs) of a store with one complete float16 split; ``fs`` edits raw objects."""
    if request.param == "local":
        import fsspec

        url, options, fs, root = str(tmp_path / "store"), {}, fsspec.filesystem("file"), str(tmp_path / "store")
    else:
        import s3fs

        bucket = request.getfixturevalue("s3_bucket")
        options = dict(request.getfixturevalue("s3_storage_options"))
        url, root = f"s3://{bucket}/store", f"{bucket}/store"
        fs = s3fs.S3FileSystem(**options)
    _write_split(url, options, np.arange(N * 64, dtype=np.float32).reshape(N, *SHAPE) / 100)
    fs.invalidate_cache()
    return url, options, (fs, f"{root}/{KEY}")


def _open(url: str, options: dict[str, Any]) -> Any:
    return featurestore.open_store(url, **options).open("ds", "enc", "s")


def test_flipped_byte_is_refused_naming_the_chunk(damaged_store: Any) -> None:
    url, options, (fs, path) = damaged_store
    raw = bytearray(fs.cat_file(path))
    raw[5] ^= 0x10  # one bit of row 8's payload; the crc trailer is unchanged
    fs.pipe_file(path, bytes(raw))
    array = _open(url, options)
    assert np.array_equal(array.read_numpy([0, 23]), _open(url, options).read_numpy([0, 23]))  # other chunks read
    with pytest.raises(CorruptChunk, match="crc32c") as info:
        array.read_numpy([1, 9])
    assert f"chunk {CHUNK}" in str(info.value) and "--resume" in str(info.value)


def test_truncated_chunk_is_refused_naming_the_chunk(damaged_store: Any) -> None:
    url, options, (fs, path) = damaged_store
    fs.pipe_file(path, bytes(fs.cat_file(path))[:200])
    with pytest.raises(CorruptChunk) as info:
        _open(url, options).read_numpy([10])
    assert KEY.split("/c/")[1].replace("/", "") in str(info.value).replace("/", "") or f"chunk {CHUNK}" in str(info.value)
    assert "--resume" in str(info.value)


def test_deleted_chunk_of_a_complete_split_names_it(damaged_store: Any) -> None:
    url, options, (fs, path) = damaged_store
    fs.rm(path)
    fs.invalidate_cache()
    with pytest.raises(MissingChunks) as info:
        _open(url, options).read_numpy([3, 8])
    message = str(info.value)
    assert KEY.split("/features/")[1] in message and "complete split" in message and "--resume" in message


def test_truncated_chunk_is_refused_even_with_verify_reads_off(damaged_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url, options, (fs, path) = damaged_store
    fs.pipe_file(path, bytes(fs.cat_file(path))[:200])
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")
    with pytest.raises(CorruptChunk):
        _open(url, options).read_numpy([11])


def test_verify_reads_off_skips_the_crc(damaged_store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url, options, (fs, path) = damaged_store
    raw = bytearray(fs.cat_file(path))
    raw[5] ^= 0x10
    fs.pipe_file(path, bytes(raw))
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "off")
    _open(url, options).read_numpy([9])  # served unchecked: what the setting means
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "first")
    with pytest.raises(CorruptChunk):
        _open(url, options).read_numpy([9])


@pytest.mark.parametrize("local_read", ["mmap", "pread"])
def test_every_local_path_checks(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, local_read: str) -> None:
    url = str(tmp_path / "store")
    _write_split(url, {}, np.ones((N, *SHAPE), np.float32))
    path = f"{url}/{KEY}"
    with open(path, "r+b") as f:
        f.seek(130)
        f.write(b"\xff")  # was 0x00 (the low byte of float16 1.0)
    monkeypatch.setenv("FEATURESTORE_LOCAL_READ", local_read)
    monkeypatch.setenv("FEATURESTORE_VERIFY_READS", "first")  # also under cache="direct"
    monkeypatch.setenv("FEATURESTORE_READ_CACHE", "direct")
    with pytest.raises(CorruptChunk, match=path):
        _open(url, {}).read_numpy([8])


def test_loader_surfaces_the_damage(tmp_path: Any) -> None:
    from client import FeatureDataset, FeatureLoader

    url = str(tmp_path / "store")
    _write_split(url, {}, np.ones((N, *SHAPE), np.float32))
    with open(f"{url}/{KEY}", "r+b") as f:
        f.seek(3)
        f.write(b"\x7f")
    with pytest.raises(CorruptChunk, match=f"chunk {CHUNK}"):
        for _ in FeatureLoader(FeatureDataset(url, "ds", "enc", "s"), batch_size=4, shuffle=False, device="cpu"):
            pass
