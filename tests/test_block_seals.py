"""Block seals: a read checks the row blocks covering its rows, not whole chunks (docs/FORMAT.md,
"Block seals").

The whole-chunk crc32c needed every byte of a chunk: a cold read of a few rows of an int8 split
(chunks of hundreds of MiB) read each touched chunk whole, then its rows again. With
``block_seals`` a flipped byte is refused by exactly the reads of its block, a cold read reads
about its rows' blocks, and object storage serves one block range for a row. Splits written
without block seals keep the whole-chunk check.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.cli import main
from featurestore.core import block_seals
from featurestore.errors import CorruptChunk, InvalidOption
from featurestore.format import layout
from featurestore.format.block_seals import BLOCK_BYTES, BLOCK_SEALS
from featurestore.testing.cgroup import evict

from _block_seal_helpers import read_bytes, unsealed_blocks  # noqa: F401 (a fixture)

TOP = ("ds", "enc", "s")
CHANNELS = 256


@pytest.fixture(autouse=True)
def local_blocks_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks are checked by block only from 64 MiB on; these tests' chunks are small."""
    monkeypatch.setenv("FEATURESTORE_BLOCK_CHECK_MIB", "0")


def _write(url: str, dtype: str, row_values: int, chunk_rows: int, n: int, **options: Any) -> np.ndarray:
    """A split of ``n`` rows of ``row_values`` values; returns what a read gives back (float32
    values for int8, whose codes are checked through ``read_numpy(dtype="float32")``)."""
    rng = np.random.default_rng(7)
    shape = (row_values // CHANNELS, CHANNELS)  # tokens x channels: a small split document
    values = rng.standard_normal((n, *shape)).astype(np.float32)
    store = featurestore.open_store(url, mode="a", **options)
    writer = store.create_split(*TOP, num_samples=n, sample_shape=shape, dtype=dtype, chunk_rows=chunk_rows)
    writer.write(0, values if dtype == "int8" else values.astype(dtype))
    writer.commit()
    if dtype == "float16":  # no read here: a read maps the chunks, and mapped pages stay cached
        return values.astype(np.float16).astype(np.float32)
    return featurestore.open_store(url, **options).open(*TOP).read_numpy(np.arange(n), dtype="float32")


def _read(url: str, rows: list[int], **options: Any) -> np.ndarray:
    """``rows`` by a freshly opened array (a new reader has checked nothing yet)."""
    return featurestore.open_store(url, **options).open(*TOP).read_numpy(rows, dtype="float32")


def _flip(url: str, chunk: int, offset: int) -> None:
    path = Path(url).joinpath(*TOP, layout.chunk_key(layout.FEATURES, chunk, 3))
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


# float16: 32 KiB rows, 32 a block, 4 blocks a chunk; int8: 16 KiB rows, 64 a block, 128 rows a
# chunk (an int8 chunk holds at least 128), 2 blocks a chunk.
GEOMETRY = {"float16": (16384, 128, 160), "int8": (16384, 128, 256)}


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_flipped_byte_is_refused_by_reads_of_its_block_only(tmp_path: Path, dtype: str) -> None:
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY[dtype]
    values = _write(url, dtype, row_values, chunk_rows, n)
    row_bytes = row_values * (2 if dtype == "float16" else 1)
    per_block = BLOCK_BYTES // row_bytes
    assert chunk_rows // per_block >= 2
    _flip(url, 0, per_block * row_bytes + 7)  # block 1 of chunk 0: rows [per_block, 2 * per_block)
    others = [0, per_block - 1, 2 * per_block % chunk_rows, chunk_rows, n - 1]
    assert np.array_equal(_read(url, others), values[others])  # the other blocks of the same chunk read
    for row in (per_block, 2 * per_block - 1):
        with pytest.raises(CorruptChunk, match=rf"block 1 \(rows {per_block}-{2 * per_block - 1}\) of chunk 0 "):
            _read(url, [0, row])
    array = featurestore.open_store(url).open(*TOP)
    with pytest.raises(CorruptChunk):
        array.read_numpy([per_block])
    with pytest.raises(CorruptChunk):  # not remembered as checked after the refusal
        array.read_numpy([per_block + 1])


def test_auto_checks_no_local_read_that_bypasses_the_page_cache(tmp_path: Path) -> None:
    """``verify_reads="auto"`` leaves local ``cache="direct"`` reads unchecked (sizes only), with
    block seals as without: measured at the seed shape, the block checks there cost more than
    the epoch could spare (docs/READS.md). ``"first"`` checks them by block."""
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    values = _write(url, "float16", row_values, chunk_rows, n)
    per_block = BLOCK_BYTES // (row_values * 2)
    _flip(url, 0, (per_block + 3) * row_values * 2 + 7)  # row per_block + 3, in block 1
    array = featurestore.open_store(url).open(*TOP)
    array.cache = "direct"
    got = array.read_numpy([0, per_block + 3], dtype="float32")
    assert np.array_equal(got[0], values[0]) and not np.array_equal(got[1], values[per_block + 3])
    array = featurestore.open_store(url).open(*TOP)
    array.cache, array.verify_reads = "direct", "first"
    with pytest.raises(CorruptChunk, match="block 1"):
        array.read_numpy([per_block + 3])


def test_a_cold_read_of_a_few_rows_reads_their_blocks_not_the_chunk(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    chunk_rows = 512  # float16 rows of 32 KiB: a 16 MiB chunk of 16 blocks
    values = _write(url, "float16", 16384, chunk_rows, chunk_rows)
    path = Path(url).joinpath(*TOP, layout.chunk_key(layout.FEATURES, 0, 3))
    evict(str(path))  # written pages synced first: DONTNEED would keep dirty ones
    rows = [3, 400]  # blocks 0 and 12
    array = featurestore.open_store(url).open(*TOP)
    before = read_bytes()
    got = array.read_numpy(rows, dtype="float32")
    read = read_bytes() - before
    assert np.array_equal(got, values[rows])
    assert BLOCK_BYTES <= read <= 3 * BLOCK_BYTES, f"{read} bytes read for 2 rows of a {path.stat().st_size}-byte chunk"


def _dropped_cold(url: str) -> None:
    evict(str(Path(url).joinpath(*TOP, layout.chunk_key(layout.FEATURES, 0, 3))))


def test_local_chunks_below_the_threshold_are_checked_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under FEATURESTORE_BLOCK_CHECK_MIB a local chunk is read whole by its check (a sequential
    read-ahead whose pages serve its later rows); at or above it, by block."""
    url = str(tmp_path / "store")
    chunk_rows = 512  # a 16 MiB chunk
    values = _write(url, "float16", 16384, chunk_rows, chunk_rows)
    reads = {}
    for mib in ("17", "16"):
        monkeypatch.setenv("FEATURESTORE_BLOCK_CHECK_MIB", mib)
        _dropped_cold(url)
        array = featurestore.open_store(url).open(*TOP)
        before = read_bytes()
        assert np.array_equal(array.read_numpy([3, 400], dtype="float32"), values[[3, 400]])
        reads[mib] = read_bytes() - before
    assert reads["17"] >= chunk_rows * 32768, reads  # the whole chunk for its crc32c
    assert reads["16"] <= 3 * BLOCK_BYTES, reads  # two blocks
    monkeypatch.setenv("FEATURESTORE_BLOCK_CHECK_MIB", "lots")
    with pytest.raises(InvalidOption, match="FEATURESTORE_BLOCK_CHECK_MIB"):
        featurestore.open_store(url).open(*TOP).read_numpy([1])


def test_concurrent_cold_reads_fetch_each_block_once(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    values = _write(url, "float16", row_values, chunk_rows, n)
    array = featurestore.open_store(url).open(*TOP)
    fetched: list[int] = []
    real = array._copy_local_blocks

    def fetch(pending: list[int], *args: Any) -> Any:
        fetched.extend(pending)
        threading.Event().wait(0.2)  # long enough that the threads overlap
        return real(pending, *args)

    array._copy_local_blocks = fetch  # type: ignore[method-assign]
    rows = [1, 40, 100, 150]  # blocks 0, 1, 3 of chunk 0 and 0 of chunk 1
    barrier, results = threading.Barrier(4), []

    def run() -> None:
        barrier.wait()
        results.append(array.read_numpy(rows, dtype="float32"))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and all(np.array_equal(r, values[rows]) for r in results)
    assert sorted(fetched) == [0, 1, 3, 4]  # once each, not once a thread


@pytest.mark.usefixtures("unsealed_blocks")
def test_a_split_without_block_seals_reads_and_verifies_by_whole_chunks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    values = _write(url, "float16", row_values, chunk_rows, n)
    assert not Path(url).joinpath(*TOP, BLOCK_SEALS).exists()
    assert np.array_equal(_read(url, [0, 100, 159]), values[[0, 100, 159]])
    assert main(["verify", url]) == 0
    _flip(url, 0, 3 * BLOCK_BYTES + 1)
    with pytest.raises(CorruptChunk, match="chunk 0 of"):  # any read of the chunk: the whole-chunk check
        _read(url, [0])
    capsys.readouterr()
    assert main(["verify", url]) == 1
    damaged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and "block" not in damaged[0], damaged


def test_verify_names_the_damaged_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["int8"]
    _write(url, "int8", row_values, chunk_rows, n)
    capsys.readouterr()
    assert main(["verify", url]) == 0
    _flip(url, 1, BLOCK_BYTES + 5)  # chunk 1, block 1: rows 192-255 of the split
    capsys.readouterr()
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "features/c/1/0/0: crc32c mismatch (flipped or truncated bytes) in block 1 (rows 192-255)\n" in out, out


def test_block_seals_are_a_plain_zarr_array(tmp_path: Path) -> None:
    import crc32c
    import zarr

    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    _write(url, "float16", row_values, chunk_rows, n)
    seals = zarr.open_array(str(Path(url).joinpath(*TOP, BLOCK_SEALS)), mode="r")
    assert seals.shape == (2, 4) and seals.dtype == np.uint32 and seals.attrs["featurestore"]["block_rows"] == 32
    chunk = Path(url).joinpath(*TOP, layout.chunk_key(layout.FEATURES, 1, 3)).read_bytes()
    table = seals[:]
    assert int(table[1, -1]) == int.from_bytes(chunk[-4:], "little")  # the last one is the trailer
    block = chunk[2 * BLOCK_BYTES : 3 * BLOCK_BYTES]  # the one-liner of docs/FORMAT.md
    assert crc32c.crc32c(block, int(table[1, 1])) == int(table[1, 2])


def test_an_s3_read_of_one_row_fetches_its_block(seaweed: Any, seaweed_url: str) -> None:
    options = dict(seaweed.storage_options)
    chunk_rows = 256  # float16 rows of 32 KiB: 8 MiB chunks of 8 blocks
    values = _write(seaweed_url, "float16", 16384, chunk_rows, 2 * chunk_rows, **options)
    array = featurestore.open_store(seaweed_url, **options).open(*TOP)
    assert array.path == "ranges"
    array.read_numpy([0])  # the split's tables (chunk_seals, block_seals) read once
    storage = array.storage
    before = storage.bytes_read
    got = array.read_numpy([300], dtype="float32")
    fetched = storage.bytes_read - before
    assert np.array_equal(got, values[[300]])
    assert BLOCK_BYTES <= fetched < BLOCK_BYTES + 64 * 1024, fetched  # the block (and the split's document)
    before = storage.bytes_read
    array.read_numpy([301])  # its block is checked: the row alone
    assert storage.bytes_read - before < 64 * 1024 + 32 * 1024


def test_a_damaged_block_seals_row_falls_back_to_whole_chunk_checks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    values = _write(url, "float16", row_values, chunk_rows, n)
    row = Path(url).joinpath(*TOP, BLOCK_SEALS, "c", "0", "0")
    raw = bytearray(row.read_bytes())
    raw[1] ^= 0x01
    row.write_bytes(bytes(raw))
    assert np.array_equal(_read(url, [0, 150]), values[[0, 150]])  # the data still reads
    _flip(url, 1, 3 * BLOCK_BYTES + 9)  # chunk 1, block 3: caught by any read of chunk 1 now
    with pytest.raises(CorruptChunk, match="chunk 1 of"):
        _read(url, [130])
    capsys.readouterr()
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED ds/enc/s/{BLOCK_SEALS}/c/0/0: crc32c mismatch" in out, out


def test_a_resume_seals_the_blocks_of_chunks_an_older_writer_left(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    shape = (row_values // CHANNELS, CHANNELS)
    values = np.random.default_rng(3).standard_normal((n, *shape)).astype(np.float16)
    create = dict(num_samples=n, sample_shape=shape, dtype="float16", chunk_rows=chunk_rows)
    enabled, block_seals.ENABLED = block_seals.ENABLED, False
    try:  # chunk 0 by a writer without block seals
        writer = featurestore.open_store(url, mode="a").create_split(*TOP, **create)
        writer.write(0, values[:chunk_rows])
        writer.close()
    finally:
        block_seals.ENABLED = enabled
    assert not Path(url).joinpath(*TOP, BLOCK_SEALS, "c", "0").exists()
    writer = featurestore.open_store(url, mode="a").create_split(*TOP, resume=True, **create)
    assert writer.pending_chunks() == [1]
    writer.write(chunk_rows, values[chunk_rows:])
    writer.commit()
    _flip(url, 0, 2 * BLOCK_BYTES + 3)  # chunk 0, block 2: rows 64-95
    assert np.array_equal(_read(url, [0, 100]), values[[0, 100]].astype(np.float32))
    with pytest.raises(CorruptChunk, match=r"block 2 \(rows 64-95\) of chunk 0 "):
        _read(url, [70])


def test_a_read_of_many_blocks_checks_them_a_slab_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from featurestore.core import checked

    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    values = _write(url, "float16", row_values, chunk_rows, n)
    monkeypatch.setattr(checked, "CHECK_BYTES", BLOCK_BYTES)  # one block a slab
    rows = [150, 0, 40, 70, 100, 129, 1]  # 5 blocks, in no order
    assert np.array_equal(_read(url, rows), values[rows])
    _flip(url, 0, 3 * BLOCK_BYTES + 2)  # chunk 0, block 3 (rows 96-127), checked last but one
    array = featurestore.open_store(url).open(*TOP)
    with pytest.raises(CorruptChunk, match=r"block 3 \(rows 96-127\) of chunk 0 "):
        array.read_numpy(rows)
    assert np.array_equal(array.read_numpy([0, 150], dtype="float32"), values[[0, 150]])


# A writer killed in its features chunk's put: the chunk's early puts (its block seals row among
# them) have landed, the chunk has not. argv: store, rows of a chunk, samples.
KILLED_IN_FEATURES_PUT = r"""
import sys, time
import numpy as np
import featurestore
from featurestore.core.storage import files

real_stream = files.stream_parts

def paused_stream(f, parts, *, seal, writeback):
    if "/features/c/" in f.name:
        print("in-features-put", flush=True)
        time.sleep(600)
    real_stream(f, parts, seal=seal, writeback=writeback)

files.stream_parts = paused_stream
url, chunk_rows, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
values = np.random.default_rng(11).standard_normal((chunk_rows, 64, 256)).astype(np.float16)
writer = featurestore.open_store(url, mode="a").create_split("ds", "enc", "s", num_samples=n, sample_shape=(64, 256),
                                                              dtype="float16", chunk_rows=chunk_rows)
writer.write(0, values)
writer.flush()
"""


def test_a_row_left_by_a_killed_writer_beside_the_chunk_an_older_writer_put_is_recomputed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The row of chunk 0 lands, its writer is SIGKILLed in the chunk's put; a writer without block
    seals resumes and puts chunk 0 with other rows; the commit must not keep the stale row."""
    import signal
    import subprocess
    import sys

    url = str(tmp_path / "store")
    row_values, chunk_rows, n = GEOMETRY["float16"]
    shape = (row_values // CHANNELS, CHANNELS)
    child = subprocess.Popen([sys.executable, "-c", KILLED_IN_FEATURES_PUT, url, str(chunk_rows), str(n)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(120, child.kill)
    watchdog.start()
    try:
        assert child.stdout is not None and child.stdout.readline() == b"in-features-put\n", child.stderr
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
        watchdog.cancel()
    split = Path(url).joinpath(*TOP)
    assert split.joinpath(BLOCK_SEALS, "c", "0", "0").exists()
    assert not split.joinpath(layout.chunk_key(layout.FEATURES, 0, 3)).exists()
    values = np.random.default_rng(12).standard_normal((n, *shape)).astype(np.float16)
    create = dict(num_samples=n, sample_shape=shape, dtype="float16", chunk_rows=chunk_rows, resume=True)
    enabled, block_seals.ENABLED = block_seals.ENABLED, False
    try:  # an older version resumes: chunk 0 with other rows, no row of its own
        writer = featurestore.open_store(url, mode="a").create_split(*TOP, **create)
        assert writer.pending_chunks() == [0, 1]
        writer.write(0, values)
        writer.close()
    finally:
        block_seals.ENABLED = enabled
    writer = featurestore.open_store(url, mode="a").create_split(*TOP, **create)
    assert writer.pending_chunks() == []
    writer.commit()
    chunk = split.joinpath(layout.chunk_key(layout.FEATURES, 0, 3)).read_bytes()
    row = np.frombuffer(split.joinpath(BLOCK_SEALS, "c", "0", "0").read_bytes()[:-4], "<u4")
    assert int(row[-1]) == int.from_bytes(chunk[-4:], "little")
    capsys.readouterr()
    assert main(["verify", url]) == 0, capsys.readouterr().out
    _flip(url, 0, 2 * BLOCK_BYTES + 3)  # reads check chunk 0 by its blocks: its row is used
    with pytest.raises(CorruptChunk, match=r"block 2 \(rows 64-95\) of chunk 0 "):
        _read(url, [70])
