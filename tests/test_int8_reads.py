"""An int8 split read where its scales matter: a damaged scales chunk, named locally and over
HTTP; values (not codes) from FeatureClient.read_samples when asked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import featurestore

pytest.importorskip("fastapi")


def test_a_damaged_scales_chunk_is_named_locally_and_over_http(tmp_path: Path) -> None:
    """One flipped byte in an int8 split's scales: every read needs them, so reads are refused,
    naming the scales chunk and the repair (a bare zarr checksum ValueError before; the server
    answered 500 InternalError)."""
    from fastapi.testclient import TestClient

    from featurestore.errors import CorruptChunk
    from featurestore.format import wire
    from server import Settings, create_app

    store = tmp_path / "store"
    writer = featurestore.open_store(str(store), mode="a").create_split(
        "d", "e", "s", num_samples=64, sample_shape=(4, 8), dtype="int8", chunk_rows=4)
    writer.write(0, np.random.default_rng(0).standard_normal((64, 4, 8)).astype(np.float32))
    writer.commit()
    chunk = store / "d" / "e" / "s" / "scales" / "c" / "10" / "0" / "0"
    raw = bytearray(chunk.read_bytes())
    raw[5] ^= 0x10
    chunk.write_bytes(bytes(raw))
    arr = featurestore.open_store(str(store)).open("d", "e", "s")
    with pytest.raises(CorruptChunk, match=r"chunk 10 of d/e/s/scales \(the int8 scales of the split's chunk 10; "
                                           r".*featurestore verify"):
        arr.read_numpy([3], dtype="float32")
    with TestClient(create_app(str(store), Settings())) as client:
        answer = client.get(wire.route(wire.ITEM, dataset="d", encoder="e", split="s", index=3))
    assert answer.status_code == 500 and answer.json()["error"] == "CorruptChunk", answer.text


def test_read_samples_over_http_gives_an_int8_split_s_values_when_asked(tmp_path: Path) -> None:
    """FeatureClient.read_samples took no dtype: an int8 split gave its codes, with no way to ask
    for values. Now dtype="float32" gives the local read's values, with the labels."""
    from fastapi.testclient import TestClient

    from client import FeatureClient
    from server import Settings, create_app

    store = tmp_path / "store"
    writer = featurestore.open_store(str(store), mode="a").create_split(
        "d", "e", "s", num_samples=16, sample_shape=(4, 8), dtype="int8", chunk_rows=4, label_dtype="int64")
    writer.write(0, np.random.default_rng(0).standard_normal((16, 4, 8)).astype(np.float32), np.arange(16))
    writer.commit()
    local = featurestore.open_store(str(store)).open("d", "e", "s")
    with TestClient(create_app(str(store), Settings())) as http:
        client = FeatureClient("http://testserver", http_client=http)
        values, labels = client.read_samples("d", "e", "s", [9, 2], dtype="float32")
        assert values.dtype == np.float32 and labels is not None and labels.tolist() == [9, 2]
        assert values.tobytes() == local.read_numpy([9, 2], dtype="float32").tobytes()
        codes, _ = client.read_samples("d", "e", "s", [9, 2])
        assert codes.dtype == np.int8 and codes.tobytes() == local.read_numpy([9, 2]).tobytes()


def test_read_ids_over_http_gives_an_int8_split_s_values_when_asked(tmp_path: Path) -> None:
    """FeatureClient.read_ids took no dtype: an int8 split gave codes only (its scales dropped)."""
    from fastapi.testclient import TestClient

    from client import FeatureClient
    from server import Settings, create_app

    store = tmp_path / "store"
    writer = featurestore.open_store(str(store), mode="a").create_split(
        "d", "e", "s", num_samples=8, sample_shape=(2, 8), dtype="int8", chunk_rows=4, ids=[f"s{i}" for i in range(8)])
    writer.write(0, np.random.default_rng(2).standard_normal((8, 2, 8)).astype(np.float32))
    writer.commit()
    local = featurestore.open_store(str(store)).open("d", "e", "s")
    with TestClient(create_app(str(store), Settings())) as http:
        client = FeatureClient("http://testserver", http_client=http)
        values, _ = client.read_ids("d", "e", "s", ["s7", "s1"], dtype="float32")
        assert values.tobytes() == local.read_numpy([7, 1], dtype="float32").tobytes()
        codes, _ = client.read_ids("d", "e", "s", ["s7"])
        assert codes.dtype == np.int8 and codes.tobytes() == local.read_numpy([7]).tobytes()


def _int8_split(store: Path, *, commit: bool = True) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((12, 2, 8)).astype(np.float32)
    writer = featurestore.open_store(str(store), mode="a").create_split(
        "d", "e", "s", num_samples=12, sample_shape=(2, 8), dtype="int8", chunk_rows=4)
    writer.write(0, x[:8])
    if commit:
        writer.write(8, x[8:])
        writer.commit()
    else:
        writer.close()
    return x


def test_a_missing_scales_chunk_is_refused_not_read_as_zeros(tmp_path: Path) -> None:
    """zarr reads an absent chunk as its fill value: the rows of a chunk whose scales file was
    gone came back as codes times 0, from every reader and the server, with no error."""
    from fastapi.testclient import TestClient

    from featurestore.errors import MissingChunks
    from featurestore.format import wire
    from server import Settings, create_app

    store = tmp_path / "store"
    x = _int8_split(store)
    (store / "d" / "e" / "s" / "scales" / "c" / "1" / "0" / "0").unlink()
    arr = featurestore.open_store(str(store)).open("d", "e", "s")
    with pytest.raises(MissingChunks, match=r"d/e/s/scales: chunk 1 is missing from a complete split"):
        arr.read_numpy([5], dtype="float32")
    assert np.allclose(arr.read_numpy([0, 9], dtype="float32"), x[[0, 9]], atol=0.05)  # the others still read
    with TestClient(create_app(str(store), Settings())) as client:
        answer = client.get(wire.route(wire.ITEM, dataset="d", encoder="e", split="s", index=5))
    assert answer.status_code >= 500 and answer.json()["error"] == "MissingChunks", answer.text


def test_an_unfinished_int8_split_reads_its_written_rows(tmp_path: Path) -> None:
    from featurestore.errors import MissingChunks

    store = tmp_path / "store"
    x = _int8_split(store, commit=False)
    arr = featurestore.open_store(str(store)).open("d", "e", "s", allow_incomplete=True)
    assert np.allclose(arr.read_numpy([1, 6], dtype="float32"), x[[1, 6]], atol=0.05)
    with pytest.raises(MissingChunks, match="not been written yet"):
        arr.read_numpy([9], dtype="float32")


def test_a_missing_scales_document_is_one_named_error(tmp_path: Path) -> None:
    from featurestore.errors import InvalidMetadata

    store = tmp_path / "store"
    _int8_split(store)
    (store / "d" / "e" / "s" / "scales" / "zarr.json").unlink()
    arr = featurestore.open_store(str(store)).open("d", "e", "s")
    with pytest.raises(InvalidMetadata, match=r"d/e/s/scales \(the split's int8 scales.*\) is missing or unreadable"):
        arr.read_numpy([0], dtype="float32")


def test_a_torch_read_dtype_is_refused_in_one_line(tmp_path: Path) -> None:
    import torch

    from featurestore.errors import DtypeMismatch

    store = tmp_path / "store"
    _int8_split(store)
    arr = featurestore.open_store(str(store)).open("d", "e", "s")
    with pytest.raises(DtypeMismatch, match="read dtype torch.float32 is not offered"):
        arr.read_numpy([0], dtype=torch.float32)


@pytest.mark.parametrize("damage", ["flip", "document", "chunk"])
def test_verify_names_damaged_bag_scales_in_one_line(tmp_path: Path, damage: str) -> None:
    """verify crashed with zarr's checksum ValueError on a flipped bag scales byte, and stopped the
    whole store (exit 2, advice about mounts) on a missing scales document."""
    import subprocess
    import sys

    store = tmp_path / "store"
    writer = featurestore.open_store(str(store), mode="a").create_bag_split("b", "u", "all", dim=16, dtype="int8")
    rng = np.random.default_rng(0)
    for i in range(3):
        writer.add_bag(f"s{i}", rng.standard_normal((20 + i, 16)).astype(np.float32))
    writer.commit()
    scales = store / "b" / "u" / "all" / "scales"
    chunk = scales / "c" / "0" / "0"
    if damage == "flip":
        raw = bytearray(chunk.read_bytes())
        raw[3] ^= 0xFF
        chunk.write_bytes(bytes(raw))
    else:
        (scales / "zarr.json" if damage == "document" else chunk).unlink()
    done = subprocess.run([sys.executable, "-m", "featurestore.cli", "verify", str(store)], capture_output=True,
                          text=True)
    out = done.stdout + done.stderr
    named = {"flip": "scales/c/0/0: crc32c mismatch", "document": "scales/zarr.json: missing",
             "chunk": "scales/c/0/0: missing"}[damage]
    assert done.returncode == 1 and f"DAMAGED b/u/all/{named}" in out and "Traceback" not in out, out
    assert "do not match" not in out  # the bags themselves are not blamed for their scales
