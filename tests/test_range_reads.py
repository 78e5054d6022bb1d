"""Contiguous-range local reads (whole bags, ``read_range``; issue 23): a range whose chunks were
not checked yet is read in one pass (each chunk once, its rows straight into the output, its
crc32c checked over the same bytes), chunks checked earlier are read by parallel preads, and
every guarantee of the checked read holds: same bytes as a gather, a flipped byte anywhere in a
chunk (in the rows asked for or outside them) raised as CorruptChunk naming the chunk.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from _loader_fixtures import DATASET, ENCODER, NUM_SAMPLES, reference, write_reference_store

import featurestore
from featurestore.bench.cgroup import evict
from featurestore.core import checked, reader
from featurestore.errors import CorruptChunk

CHUNK_ROWS = 8  # the reference store's float32 split (_loader_fixtures)


@pytest.fixture
def store(tmp_path: Any) -> str:
    root = str(tmp_path / "store")
    write_reference_store(root)
    return root


def _open(store: str) -> Any:
    return featurestore.open_store(store).open(DATASET, ENCODER, "f32")


def _chunk_file(store: str, chunk: int) -> str:
    return os.path.join(store, DATASET, ENCODER, "f32", "features", "c", str(chunk), "0", "0")


def test_unchecked_range_is_read_in_one_pass(store: str) -> None:
    evict(store)
    arr = _open(store)
    got = arr.read_range(5, 37)  # chunks 0..4, starting and ending mid-chunk
    np.testing.assert_array_equal(got, reference()[0][5:37])
    # no second pass: nothing went through the mmap gather or the per-row preads
    assert arr.read_counts == {"mmap": 0, "inline": 0, "pool": 0}
    assert arr._verified.pending(list(range(5))) == []


def test_range_over_checked_and_unchecked_chunks(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reader, "_RANGE_PREAD_BYTES", 0)  # this store's ranges are tiny
    arr = _open(store)
    ref = reference()[0]
    arr.read_numpy([17, 3])  # chunks 0 and 2 checked first
    gathered = arr.read_counts["mmap"] + arr.read_counts["inline"]
    got = arr.read_range(1, NUM_SAMPLES)
    np.testing.assert_array_equal(got, ref[1:])
    assert arr._verified.pending(list(range(-(-NUM_SAMPLES // CHUNK_ROWS)))) == []
    np.testing.assert_array_equal(arr.read_range(2, 30), ref[2:30])  # all checked: parallel preads
    assert arr.read_counts["mmap"] + arr.read_counts["inline"] == gathered and arr.read_counts["pool"] > 0


@pytest.mark.parametrize("row_in_chunk", [1, 6], ids=["in-the-range", "outside-the-range"])
def test_flipped_byte_in_a_range_is_refused(store: str, row_in_chunk: int) -> None:
    path = _chunk_file(store, 2)
    raw = bytearray(open(path, "rb").read())
    raw[row_in_chunk * 96 + 5] ^= 0x10
    with open(path, "wb") as f:
        f.write(raw)
    arr = _open(store)
    with pytest.raises(CorruptChunk, match=r"chunk 2 of .*crc32c mismatch"):
        arr.read_range(10, 20)  # rows 0..3 of chunk 2: row 6 lies outside, still checked
    with pytest.raises(CorruptChunk):
        arr.read_range(10, 20)  # not remembered as checked


def test_truncated_chunk_in_a_range_is_refused(store: str) -> None:
    path = _chunk_file(store, 1)
    os.truncate(path, 100)
    with pytest.raises(CorruptChunk, match="chunk 1 of .*size 100 bytes"):
        _open(store).read_range(0, 24)


def test_check_files_into_lands_the_payload_range_in_the_view(store: str) -> None:
    payload = CHUNK_ROWS * 96
    view = bytearray(3 * 96)
    reasons = checked.check_files([_chunk_file(store, 4)], payload, into=[(2 * 96, memoryview(view))])
    assert reasons == [None]
    np.testing.assert_array_equal(np.frombuffer(bytes(view), np.float32).reshape(3, 3, 8), reference()[0][34:37])
