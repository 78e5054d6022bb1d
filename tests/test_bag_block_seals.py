"""Block seals of bag splits: a whole-bag read checks the row blocks its bag lies in, in the one
pass that reads them (docs/FORMAT.md, "Block seals"; docs/READS.md, "Block-checked reads").

Bag chunks are small (8 MiB by default) and a bag is a run of rows: the whole-chunk check read
each chunk a bag touched whole, then the bag's rows again. Local reads of a bag split check by
block whatever the chunk's size; bag splits written before block seals keep the whole-chunk check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import featurestore
from featurestore.cli import main
from featurestore.errors import CorruptChunk
from featurestore.format import layout
from featurestore.format.block_seals import BLOCK_BYTES, BLOCK_SEALS
from featurestore.testing.cgroup import evict

from _block_seal_helpers import read_bytes, unsealed_blocks, writers_without_block_seals  # noqa: F401 (a fixture)

TOP = ("ds", "enc", "s")
DIM = 4096  # float16 rows of 8 KiB: 128 rows a block
CHUNK_BYTES = 4 << 20  # 512 rows, 4 blocks a chunk: below the dense rule's 64 MiB
PER_BLOCK = BLOCK_BYTES // (DIM * 2)
LENGTHS = (100, 60, 200, 300, 90, 400, 50)  # 1200 rows: chunks 0-2


def _bags() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {f"b{i}": rng.standard_normal((n, DIM)).astype(np.float16) for i, n in enumerate(LENGTHS)}


def _write(url: str, data: dict[str, np.ndarray], *, close_only: bool = False, resume: bool = False) -> None:
    store = featurestore.open_store(url, mode="a")
    writer = store.create_bag_split(*TOP, dim=DIM, chunk_bytes=CHUNK_BYTES, resume=resume)
    for bag_id, values in data.items():
        if bag_id not in writer.done_ids:
            writer.add_bag(bag_id, values, coords=np.zeros((len(values), 2), np.int32))
    writer.close() if close_only else writer.commit()


def _rows_of(data: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
    starts = np.concatenate([[0], np.cumsum([len(v) for v in data.values()])])
    return {bag_id: (int(starts[i]), int(starts[i + 1])) for i, bag_id in enumerate(data)}


def _flip(url: str, chunk: int, offset: int) -> None:
    path = Path(url).joinpath(*TOP, layout.chunk_key(layout.FEATURES, chunk, 2))
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(bytes(raw))


def test_a_flipped_byte_refuses_only_the_bags_of_its_block(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    data = _bags()
    _write(url, data)
    assert Path(url).joinpath(*TOP, BLOCK_SEALS, layout.ZARR_JSON).exists()
    _flip(url, 0, PER_BLOCK * DIM * 2 + 11)  # block 1 of chunk 0: rows 128-255
    bags = featurestore.open_store(url).open_bags(*TOP)
    for bag_id, (start, stop) in _rows_of(data).items():
        if start < 2 * PER_BLOCK and stop > PER_BLOCK:  # b1 (100-159), b2 (160-359)
            with pytest.raises(CorruptChunk, match=rf"block 1 \(rows {PER_BLOCK}-{2 * PER_BLOCK - 1}\) of chunk 0 "):
                bags.read_numpy(bag_id)
        else:  # b0 (0-99) and b3 (360-659) share chunk 0 with the damage, and read
            np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], data[bag_id])
    with pytest.raises(CorruptChunk):  # not remembered as checked after the refusal
        bags.read_numpy("b1")


def test_a_cold_whole_bag_read_reads_its_blocks_once(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    data = _bags()
    _write(url, data)
    bags = featurestore.open_store(url).open_bags(*TOP)
    evict(str(Path(url).joinpath(*TOP)))
    before = read_bytes()
    features, _ = bags.read_numpy("b3")  # rows 360-659: blocks 2-3 of chunk 0, 0-1 of chunk 1
    read = read_bytes() - before
    np.testing.assert_array_equal(features, data["b3"])
    # the bag's 4 blocks (4 MiB, 2.3 MiB of them its rows), the kernel's read-ahead past them and
    # its coords chunks; the whole-chunk check read both 4 MiB chunks whole (8.4 MB here)
    assert 4 * BLOCK_BYTES <= read < 2 * CHUNK_BYTES, read
    np.testing.assert_array_equal(bags.read_numpy("b3")[0], data["b3"])  # checked once: gathered again


def test_verify_names_the_damaged_block_of_a_bag_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    _write(url, _bags())
    capsys.readouterr()
    assert main(["verify", url]) == 0
    _flip(url, 1, 2 * BLOCK_BYTES + 5)  # chunk 1, block 2: rows 768-895 of the split
    capsys.readouterr()
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "features/c/1/0: crc32c mismatch (flipped or truncated bytes) in block 2 (rows 768-895)" in out, out


def test_segments_of_a_writer_without_block_seals_are_sealed_at_commit(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    data = _bags()
    first = dict(list(data.items())[:4])
    with writers_without_block_seals():
        _write(url, first, close_only=True)  # an older writer's segment, resumed below
    _write(url, data, resume=True)
    _flip(url, 2, 10)  # chunk 2, block 0: rows 1024-1151, of b6 (1150-1199) and b5 (750-1149)
    bags = featurestore.open_store(url).open_bags(*TOP)
    for bag_id in ("b0", "b3", "b4"):
        np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], data[bag_id])
    with pytest.raises(CorruptChunk, match=r"block 0 \(rows 1024-1151\) of chunk 2 "):
        bags.read_numpy("b5")


@pytest.mark.usefixtures("unsealed_blocks")
def test_a_bag_split_without_block_seals_reads_and_verifies_by_whole_chunks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    data = _bags()
    _write(url, data)
    assert not Path(url).joinpath(*TOP, BLOCK_SEALS).exists()
    bags = featurestore.open_store(url).open_bags(*TOP)
    for bag_id, values in data.items():
        np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], values)
    assert main(["verify", url]) == 0
    _flip(url, 0, 3 * BLOCK_BYTES + 1)  # block 3 of chunk 0: b3's rows
    with pytest.raises(CorruptChunk, match="chunk 0 of"):  # b0, rows 0-99: the whole-chunk check
        featurestore.open_store(url).open_bags(*TOP).read_numpy("b0")
    capsys.readouterr()
    assert main(["verify", url]) == 1
    damaged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("DAMAGED")]
    assert len(damaged) == 1 and "block" not in damaged[0], damaged


def test_a_stale_block_seals_row_is_named_by_verify_and_reads_check_whole_chunks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = str(tmp_path / "store")
    data = _bags()
    _write(url, data)
    rows = Path(url).joinpath(*TOP, BLOCK_SEALS)
    (rows / "c" / "1" / "0").write_bytes((rows / "c" / "0" / "0").read_bytes())  # chunk 0's row at 1's place
    capsys.readouterr()
    assert main(["verify", url]) == 1
    out = capsys.readouterr().out
    assert "features/c/1/0: its crc32c is valid, but block 0 (rows 512-639) does not match its block seal" in out, out
    bags = featurestore.open_store(url).open_bags(*TOP)
    for bag_id, values in data.items():  # the table is not the commit's: whole-chunk checks, all served
        np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], values)
    assert bags.features._blocks is False


def test_once_every_block_is_checked_reads_skip_the_block_claims(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "store")
    data = _bags()
    _write(url, data)
    bags = featurestore.open_store(url).open_bags(*TOP)
    for bag_id in data:  # the first epoch checks every block
        bags.read_numpy(bag_id)

    def no_claims(*_: object) -> None:
        raise AssertionError("a read after the first epoch claimed blocks")

    monkeypatch.setattr(type(bags.features), "_read_blocks", no_claims)
    for bag_id, values in data.items():
        np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], values)
