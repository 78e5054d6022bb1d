"""``chunk_seals`` on dense splits: the one seal model of every kind (docs/FORMAT.md, "Chunk seals").

A dense split's labels chunks have no statistics row: two of them swapped keep valid crc32c
trailers and passed ``featurestore verify`` and a ``--verify-chunks`` resume before the table
sealed them. A dense split committed before the table existed (the golden stores) still reads
and verifies with its statistics-row seals alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from featurestore import open_store
from featurestore.cli import main
from featurestore.core import seals
from featurestore.core.verify import verify_split
from featurestore.errors import CorruptChunk
from featurestore.format import layout

TOP = ("ds", "enc", "train")
N, ROWS = 12, 4
GOLDEN = Path(__file__).parent / "golden" / "v2-2026-11"


def write(root: Path, **create: object) -> Path:
    store = open_store(str(root), mode="a")
    writer = store.create_split(*TOP, num_samples=N, sample_shape=(2, 3), dtype="float32", chunk_rows=ROWS,
                                label_dtype="int64", **create)
    x = np.random.default_rng(0).standard_normal((N, 2, 3)).astype(np.float32)
    writer.write(0, x, labels=np.arange(N) % 3 + 10 * (np.arange(N) // ROWS))
    writer.commit()
    return root.joinpath(*TOP)


def verify(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(["verify", str(root)])
    return code, [line for line in capsys.readouterr().out.splitlines() if line.startswith("DAMAGED")]


def swap(a: Path, b: Path) -> None:
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)


def test_a_commit_seals_every_features_and_labels_chunk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    store = open_store(str(tmp_path))
    meta = store.split_info(*TOP)
    table = seals.read_table(store.storage, "/".join(TOP))
    assert table is not None and table.shape == (2 * meta.num_chunks, 4)
    assert table[:, 0].tolist() == [0] * 3 + [3] * 3  # features (code 0), then labels (code 3)
    for index in range(meta.num_chunks):
        raw = (top / "labels" / "c" / str(index)).read_bytes()
        want = int.from_bytes(raw[-4:], "little")
        assert seals.sealed_crc(store.storage, "/".join(TOP), meta, "labels", index) == want
    assert verify(tmp_path, capsys) == (0, [])


def test_swapped_labels_chunks_are_found_by_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    swap(top / "labels" / "c" / "0", top / "labels" / "c" / "2")
    code, lines = verify(tmp_path, capsys)
    assert code == 1 and len(lines) == 2, lines
    assert "labels/c/0: crc32c" in lines[0] and "labels/c/2's bytes" in lines[0]
    assert "labels/c/2: crc32c" in lines[1] and "labels/c/0's bytes" in lines[1]


def test_a_flipped_labels_chunk_is_one_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path)
    chunk = top / "labels" / "c" / "1"
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 1
    chunk.write_bytes(bytes(raw))
    code, lines = verify(tmp_path, capsys)
    assert code == 1 and lines == [f"DAMAGED {'/'.join(TOP)}/labels/c/1: crc32c mismatch (flipped or truncated bytes)"]


def test_a_labels_chunk_from_another_run_is_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path / "a")
    other = write(tmp_path / "b")  # same values, another generation
    shutil.copy(other / "chunk_seals" / "c" / "0" / "0", top / "chunk_seals" / "c" / "0" / "0")
    code, lines = verify(tmp_path / "a", capsys)
    assert code == 1 and lines and all("sealed for generation" in line for line in lines), lines


def test_a_verify_chunks_resume_rewrites_swapped_labels_even_after_a_kill(tmp_path: Path) -> None:
    top = write(tmp_path)
    expected = open_store(str(tmp_path)).open(*TOP).labels.read_numpy(np.arange(N))
    swap(top / "labels" / "c" / "0", top / "labels" / "c" / "2")
    store = open_store(str(tmp_path), mode="a")
    make = dict(num_samples=N, sample_shape=(2, 3), dtype="float32", chunk_rows=ROWS, label_dtype="int64")
    first = store.create_split(*TOP, resume=True, verify_chunks=True, **make)
    assert first.pending_chunks() == [0, 2]
    assert store.split_status(*TOP) == "writing"
    # Killed before writing anything: the next resume (without verify_chunks) still redoes them.
    again = store.create_split(*TOP, resume=True, **make)
    assert again.pending_chunks() == [0, 2]
    x = np.random.default_rng(0).standard_normal((N, 2, 3)).astype(np.float32)
    again.write(0, x, labels=expected)
    again.commit()
    assert np.array_equal(open_store(str(tmp_path)).open(*TOP).labels.read_numpy(np.arange(N)), expected)
    check = verify_split(open_store(str(tmp_path)), *TOP)
    assert check.status == "complete" and check.problems == []


def test_a_dense_split_without_chunk_seals_still_verifies(tmp_path: Path) -> None:
    """Golden dense splits were committed before the table: their statistics rows are the seal."""
    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN, copy)
    store = open_store(str(copy))
    split = "dense-float32"  # an encoder of the golden dataset, its split "train"
    key = f"golden/{split}/train"
    assert not (copy / key / "chunk_seals").exists()
    meta = store.split_info("golden", split, "train")
    assert seals.sealed_crc(store.storage, key, meta, "features", 0) is None
    check = verify_split(store, "golden", split, "train")
    assert check.status == "complete" and check.problems == [] and check.chunks_checked > 0
    # Its statistics-row seals still find a swapped features chunk.
    count = meta.num_chunks
    assert count >= 2
    ndim = 1 + len(meta.sample_shape)
    a, b = (copy / key / layout.chunk_key("features", i, ndim) for i in (0, 1))
    swap(a, b)
    problems = verify_split(store, "golden", split, "train").problems
    assert problems and all("features/c/" in p for p in problems), problems


def test_sealed_crc_refuses_a_table_without_the_chunk(tmp_path: Path) -> None:
    write(tmp_path)
    store = open_store(str(tmp_path))
    meta = store.split_info(*TOP)
    with pytest.raises(CorruptChunk, match="does not seal chunk 7 of labels"):
        seals.sealed_crc(store.storage, "/".join(TOP), meta, "labels", 7)


def test_a_compressed_split_is_sealed_by_its_stored_trailers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    top = write(tmp_path, compressor="zstd")
    store = open_store(str(tmp_path))
    meta = store.split_info(*TOP)
    for index in range(meta.num_chunks):
        raw = (top / "features" / "c" / str(index) / "0" / "0").read_bytes()
        assert seals.sealed_crc(store.storage, "/".join(TOP), meta, "features", index) == int.from_bytes(raw[-4:], "little")
    assert verify(tmp_path, capsys) == (0, [])
