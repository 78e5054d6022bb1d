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
