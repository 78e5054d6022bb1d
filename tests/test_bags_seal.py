"""``chunk_seals``: verify finds chunks of a bag split that keep a valid crc32c but are not where
the commit put them (docs/FORMAT.md, "Slide bags": verify).

Each damage here passed ``featurestore verify`` before the table existed: two features chunks
swapped inside one bag (the bag's statistics row sums the same rows), coords and labels (no
statistics at all), a chunk copied from another run of the split.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from featurestore import open_store
from featurestore.cli import main
from featurestore.format import chunks

DIM = 8
ROWS = 10  # rows per features/coords chunk
TOP = ("ds", "enc", "train")


def write(root: Path, *, reverse_big: bool = False, labels: tuple[int, int, int] = (0, 1, 2)) -> Path:
    """Bag "big" (45 rows: chunks 0 to 4) then two small bags; ``reverse_big`` reverses the big
    bag's rows inside each chunk: other bytes, the same rows per chunk, the same statistics row."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((45, DIM)).astype(np.float32)
    store = open_store(str(root), mode="a")
    writer = store.create_bag_split(*TOP, dim=DIM, dtype="float32", chunk_bytes=ROWS * DIM * 4, overwrite=True)
    coords = np.arange(90).reshape(45, 2)
    if reverse_big:
        order = np.concatenate([np.arange(lo, min(lo + ROWS, 45))[::-1] for lo in range(0, 45, ROWS)])
        big, coords = big[order], coords[order]
    writer.add_bag("big", big, coords=coords, label=labels[0])
    writer.add_bag("small", np.ones((3, DIM), np.float32), coords=np.zeros((3, 2), np.int64), label=labels[1])
    writer.add_bag("tiny", np.full((2, DIM), 2, np.float32), coords=np.ones((2, 2), np.int64), label=labels[2])
    writer.commit()
    return root.joinpath(*TOP)


def verify(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["verify", str(root)])
    captured = capsys.readouterr()
    return code, [line for line in (captured.out + captured.err).splitlines() if line.strip()]


def swap(a: Path, b: Path) -> None:
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)


def test_an_untouched_split_verifies_clean_and_its_table_reads_in_zarr(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    code, lines = verify(tmp_path, capsys)
    assert code == 0 and any("ds/enc/train: ok" in line for line in lines), lines
    table = zarr.open_array(str(top / "chunk_seals"), mode="r")[:]
    # 50 rows: features 5 chunks, coords 5, offsets 1, labels 1; columns: array, chunk, crc32c, generation
    assert table.shape == (12, 4) and table.dtype == np.uint64
    assert list(table[:, 0]) == [0] * 5 + [1] * 5 + [2, 3] and list(table[:5, 1]) == list(range(5))
    raw = (top / "features" / "c" / "2" / "0").read_bytes()
    assert int(table[2, 2]) == int.from_bytes(raw[-4:], "little")
    generation = open_store(str(tmp_path)).split_info(*TOP).generation
    assert set(table[:, 3].tolist()) == {int(generation, 16)}


def test_two_features_chunks_swapped_inside_one_bag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    swap(top / "features" / "c" / "1" / "0", top / "features" / "c" / "3" / "0")
    code, lines = verify(tmp_path, capsys)
    assert code == 1
    problems = [line for line in lines if "crc32c" in line]
    assert len(problems) == 2, lines
    assert "features/c/1/0" in problems[0] and "features/c/3/0's bytes" in problems[0]
    assert "features/c/3/0" in problems[1] and "features/c/1/0's bytes" in problems[1]
    assert not any("Traceback" in line for line in lines)


def test_two_coords_chunks_swapped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    swap(top / "coords" / "c" / "0" / "0", top / "coords" / "c" / "1" / "0")
    code, lines = verify(tmp_path, capsys)
    assert code == 1
    assert [line for line in lines if "coords/c/" in line and "swapped" in line].__len__() == 2, lines


def test_a_labels_chunk_rewritten_with_a_valid_crc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    chunk = top / "labels" / "c" / "0"
    payload = np.frombuffer(chunk.read_bytes()[:-4], "<i8").copy()
    payload[1] = 7  # a plausible label, crc32c recomputed: nothing but the seal can tell
    chunk.write_bytes(payload.tobytes() + chunks.crc_bytes(payload.tobytes()))
    assert open_store(str(tmp_path)).open_bags(*TOP).label("small") == 7  # the damage is readable as data
    code, lines = verify(tmp_path, capsys)
    assert code == 1
    assert [line for line in lines if "labels/c/0" in line and "crc32c" in line].__len__() == 1, lines


def test_a_chunk_copied_from_another_run_of_the_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the first run stored chunk 2's rows of bag "big" in another order: the bag's statistics row
    # still matches after the copy, the crc32c is valid; only the seal says it is not this run's
    top = write(tmp_path, reverse_big=True)
    old_features = (top / "features" / "c" / "2" / "0").read_bytes()
    old_coords = (top / "coords" / "c" / "2" / "0").read_bytes()
    write(tmp_path)
    (top / "features" / "c" / "2" / "0").write_bytes(old_features)
    (top / "coords" / "c" / "2" / "0").write_bytes(old_coords)
    code, lines = verify(tmp_path, capsys)
    assert code == 1
    problems = [line for line in lines if "crc32c" in line]
    assert len(problems) == 2 and "features/c/2/0" in problems[0] and "coords/c/2/0" in problems[1], lines
    assert "another run" in problems[0]


def test_a_seal_table_from_another_run_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the table and the chunks it names copied together from an earlier run: the generation tells
    top = write(tmp_path, labels=(2, 1, 0))
    old = {p.relative_to(top): p.read_bytes() for p in top.rglob("*") if p.is_file() and "zarr.json" not in p.name}
    write(tmp_path)
    for rel, raw in old.items():
        if rel.parts[0] in ("labels", "chunk_seals"):
            (top / rel).write_bytes(raw)
    code, lines = verify(tmp_path, capsys)
    assert code == 1
    assert any("chunk_seals" in line and "generation" in line for line in lines), lines
