"""Checked reads under a loader's concurrency, and the streamed crc32c check of a chunk file.

A loader reads several batches at once; on a cold epoch they touch the same chunks. Each chunk is
read whole for its crc32c by one thread while the others wait for it: an int8 split's chunks
(at least 128 rows, hundreds of MiB) used to be read and checked by every thread in flight, so a
cold shuffled epoch read its split once per thread before the first batch came out.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.core import block_seals, checked
from featurestore.errors import CorruptChunk
from featurestore.format import layout

N, SHAPE, ROWS = 24, (4, 16), 4  # 6 chunks of 4 rows, float16: 128 bytes a row
THREADS = 4


def _split(tmp_path: Any) -> tuple[str, np.ndarray]:
    url = str(tmp_path / "store")
    values = (np.arange(N * 64, dtype=np.float32).reshape(N, *SHAPE) / 100).astype(np.float16)
    # Written as before block seals: the whole-chunk check is what such a split keeps
    # (tests/test_block_seals.py has the block-sealed reads).
    enabled, block_seals.ENABLED = block_seals.ENABLED, False
    try:
        writer = featurestore.open_store(url, mode="a").create_split(
            "ds", "enc", "s", num_samples=N, sample_shape=SHAPE, dtype="float16", chunk_bytes=ROWS * 128)
        writer.write(0, values)
        writer.commit()
    finally:
        block_seals.ENABLED = enabled
    return url, values


def _chunk_file(url: str, chunk: int) -> str:
    return os.path.join(url, layout.chunk_key(layout.split_key("ds", "enc", "s") + "/features", chunk, 3))


def _slow_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every chunk file ``check_files`` is given (the check made slow enough that threads overlap)."""
    seen: list[str] = []
    real = checked.check_files

    def check_files(paths: Any, payload: int, *args: Any) -> Any:
        seen.extend(paths)
        time.sleep(0.2)
        return real(paths, payload, *args)

    monkeypatch.setattr(checked, "check_files", check_files)
    return seen


def _together(read: Any) -> list[Any]:
    """``read()`` on THREADS threads started at once: each one's result or exception."""
    barrier = threading.Barrier(THREADS)
    results: list[Any] = [None] * THREADS

    def run(k: int) -> None:
        barrier.wait()
        try:
            results[k] = read()
        except Exception as error:  # noqa: BLE001  # compared by the test
            results[k] = error

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_concurrent_reads_check_each_chunk_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url, values = _split(tmp_path)
    seen = _slow_checks(monkeypatch)
    array = featurestore.open_store(url).open("ds", "enc", "s")
    rows = [1, 9, 17, 22]  # chunks 0, 2, 4, 5
    results = _together(lambda: array.read_numpy(rows))
    for result in results:
        assert isinstance(result, np.ndarray) and np.array_equal(result, values[rows])
    assert sorted(seen) == sorted(_chunk_file(url, c) for c in (0, 2, 4, 5))  # once each, not once a thread


def test_concurrent_reads_of_a_damaged_chunk_all_refuse(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = _split(tmp_path)
    path = _chunk_file(url, 2)
    raw = bytearray(open(path, "rb").read())
    raw[5] ^= 0x10
    open(path, "wb").write(bytes(raw))
    _slow_checks(monkeypatch)
    array = featurestore.open_store(url).open("ds", "enc", "s")
    results = _together(lambda: array.read_numpy([0, 9]))
    assert all(isinstance(r, CorruptChunk) and "chunk 2" in str(r) for r in results), results
    with pytest.raises(CorruptChunk):  # not remembered as checked by anyone
        array.read_numpy([10])


@pytest.mark.parametrize("piece", [100, 514, 515, 516, 4096])  # the trailer in one piece, split, alone
def test_streamed_check_finds_what_the_whole_chunk_check_finds(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                               piece: int) -> None:
    url, _ = _split(tmp_path)
    payload = ROWS * 128
    good = open(_chunk_file(url, 0), "rb").read()
    assert len(good) == payload + layout.CRC_BYTES
    cases = {"good": good, "payload": good[:300] + bytes([good[300] ^ 1]) + good[301:],
             "trailer": good[:-1] + bytes([good[-1] ^ 1]), "short": good[:-3], "empty": b""}
    paths = []
    for name, blob in cases.items():
        paths.append(str(tmp_path / name))
        open(paths[-1], "wb").write(blob)
    monkeypatch.setattr(checked, "_PIECE", piece)
    monkeypatch.setattr(checked, "WINDOW", 2)  # pieces reused while the file is still being read
    with ThreadPoolExecutor(3) as executor:
        for pool in (executor, None):
            streamed = checked.check_files(paths * 2, payload, pool)
            whole = checked.check_files(paths * 2, payload, pool, lambda _k, _chunk: None)
            assert streamed == whole
            good_, payload_, trailer_, short_, empty_ = streamed[:5]
            assert good_ is None and "crc32c" in payload_ and "crc32c" in trailer_
            assert "size" in short_ and empty_ == "empty file"


def test_files_checked_a_group_at_a_time_keep_their_positions(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten files, four open at a time (a low descriptor limit): each reason, and each question to
    ``inspect``, is about the file at its own position."""
    import crc32c

    from featurestore.core import open_files

    monkeypatch.setattr(open_files, "descriptor_share", lambda: 16)  # groups of 4
    paths = []
    for k in range(10):
        payload = bytes([k]) * 1000
        path = tmp_path / f"c{k}"
        trailer = crc32c.crc32c(payload).to_bytes(4, "little")
        path.write_bytes(payload + (b"\0\0\0\0" if k == 5 else trailer))  # 5: a wrong crc32c
        paths.append(str(path))
    asked: list[tuple[int, int]] = []

    def inspect(k: int, chunk: memoryview) -> str | None:
        asked.append((k, chunk[0]))
        return "not this position's chunk" if k == 7 else None

    reasons = checked.check_files(paths, 1000, None, inspect)
    assert [k for k, r in enumerate(reasons) if r] == [5, 7] and "crc32c" in reasons[5]
    assert reasons[7] == "not this position's chunk"
    assert sorted(asked) == [(k, k) for k in range(10) if k != 5]
