"""The advised repair of a damaged bag split (core.bag_repair): the command that wrote it plus
``--resume --verify-chunks`` adds again exactly the bags of the damaged chunks, rewrites their
chunks only, and leaves the bytes of a fresh import; a repair cut short (a SIGKILL) goes on at
the next ``--resume``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_bags_import import DIM, run_import, trident_dir

import featurestore
from featurestore import open_store
from featurestore.cli import main
from featurestore.errors import CorruptChunk, IncompleteSplit, InputChanged, SplitExists

TOP = ("ds", "enc", "train")
ROWS = 8  # rows per features/coords chunk
CHUNK = ("--chunk-mb", str(ROWS * DIM * 2 / 2**20))
LENGTHS = {"a": 5, "b": 30, "c": 0, "d": 11, "e": 21, "f": 3}  # 70 rows: 9 chunks; b spans chunks 0-4


@pytest.fixture
def source(tmp_path: Path) -> Path:
    trident_dir(tmp_path / "h5", LENGTHS)
    return tmp_path / "h5"


@pytest.fixture
def reference(source: Path, tmp_path: Path) -> Path:
    assert run_import(source, tmp_path / "reference", *CHUNK) == 0
    return tmp_path / "reference"


def imported(source: Path, root: Path) -> Path:
    assert run_import(source, root, *CHUNK) == 0
    return root.joinpath(*TOP)


def comparable(root: Path) -> dict[str, bytes]:
    """Every file of the split but its zarr.json documents; the generation (each import draws its
    own) zeroed in the sealed statistics rows and the chunk seals, their crc32c trailer dropped."""
    split = root.joinpath(*TOP)
    generation = int(featurestore.open_store(str(root)).split_info(*TOP).generation, 16)
    out = {}
    for path in sorted(p for p in split.rglob("*") if p.is_file() and p.name != "zarr.json"):
        name, data = path.relative_to(split).as_posix(), path.read_bytes()
        if name.startswith("bag_stats/"):
            rows = np.frombuffer(data[:-4], "<f8").copy()
            data = np.where(rows == float(generation), 0.0, rows).tobytes()
        elif name.startswith("chunk_seals/"):
            table = np.frombuffer(data[:-4], "<u8").reshape(-1, 4).copy()
            table[:, 3] = 0
            data = table.tobytes()
        out[name] = data
    return out


def files(split: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file: which ones a repair wrote."""
    return {p.relative_to(split).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in split.rglob("*") if p.is_file()}


def chunk(split: Path, name: str, index: int) -> Path:
    return split / name / "c" / str(index) / "0"


def flip(path: Path, at: int = 3) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def verify_ok(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    code = main(["verify", str(root)])
    out = capsys.readouterr().out
    assert code == 0 and "ds/enc/train: ok (" in out and "leftover" not in out, out


def chunks_of(bags: list[str], root: Path) -> set[int]:
    split = open_store(str(root)).open_bags(*TOP)
    out: set[int] = set()
    for bag in bags:
        rows = split.rows_of(bag)
        out |= set(range(int(rows[0]) // ROWS, int(rows[-1]) // ROWS + 1)) if len(rows) else set()
    return out


@pytest.mark.parametrize("array", ["features", "coords"])
def test_a_flipped_byte_is_repaired_by_the_advised_command(source: Path, reference: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str], array: str) -> None:
    """Chunk 4 holds the last rows of b and the first of d: both are imported again, and only
    their chunks (0-4 of b, 4-5 of d) are written; the rest keeps its files."""
    split = imported(source, tmp_path / "store")
    flip(chunk(split, array, 4))
    with pytest.raises(CorruptChunk, match="--resume --verify-chunks"):
        open_store(str(tmp_path / "store")).open_bags(*TOP).read_numpy("d")
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "store")]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED ds/enc/train/{array}/c/4/0" in out and "plus --resume --verify-chunks" in out, out
    before = files(split)
    # --resume alone checks sizes only (the chunk's size is right): nothing to do
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume") == 0
    assert "already complete" in capsys.readouterr().out and files(split) == before

    assert run_import(source, tmp_path / "store", *CHUNK, "--resume", "--verify-chunks") == 0
    assert "imported ds/enc/train: 6 bags, 70 patches" in capsys.readouterr().out
    verify_ok(tmp_path / "store", capsys)
    assert comparable(tmp_path / "store") == comparable(reference)
    after = files(split)
    written = {name for name in before if after.get(name) != before[name]}
    assert chunks_of(["b", "d"], tmp_path / "store") == {0, 1, 2, 3, 4, 5}
    assert written == {"zarr.json"} | {f"{a}/c/{i}/0" for a in ("features", "coords", "block_seals") for i in range(6)}
    assert set(after) == set(before)  # no segment left, no temporary file
    # a re-run finds it sound again
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume", "--verify-chunks") == 0
    assert "already complete" in capsys.readouterr().out


def test_chunks_swapped_with_valid_crcs_are_found_by_their_seals(source: Path, reference: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    split = imported(source, tmp_path / "store")
    a, b = chunk(split, "features", 1), chunk(split, "features", 7)  # of b; of e
    raw_a, raw_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(raw_b)
    b.write_bytes(raw_a)
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume", "--verify-chunks") == 0
    verify_ok(tmp_path / "store", capsys)
    assert comparable(tmp_path / "store") == comparable(reference)


def test_a_missing_chunk_is_repaired_by_resume_alone(source: Path, reference: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    split = imported(source, tmp_path / "store")
    chunk(split, "coords", 8).unlink()  # rows 64-69: of e (rows 46-66, chunks 5-8) and f
    before = files(split)
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume") == 0
    verify_ok(tmp_path / "store", capsys)
    assert comparable(tmp_path / "store") == comparable(reference)
    after = files(split)
    assert chunks_of(["e", "f"], tmp_path / "store") == {5, 6, 7, 8}
    assert {n for n in after if after[n] != before.get(n)} == {"zarr.json"} | {
        f"{a}/c/{i}/0" for a in ("features", "coords", "block_seals") for i in range(5, 9)}


def test_a_damaged_index_imports_every_bag_again(source: Path, reference: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Damaged offsets trace no chunk to its bags: every bag is imported again, in place."""
    split = imported(source, tmp_path / "store")
    flip(split / "offsets" / "c" / "0", at=9)
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume", "--verify-chunks") == 0
    assert "6 bags written" in capsys.readouterr().out
    verify_ok(tmp_path / "store", capsys)
    assert comparable(tmp_path / "store") == comparable(reference)


def test_a_repair_left_before_its_commit_goes_on_at_the_next_resume(source: Path, reference: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    split = imported(source, tmp_path / "store")
    flip(chunk(split, "features", 8))
    store = open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_bag_split(*TOP, dim=DIM, chunk_bytes=ROWS * DIM * 2, patch_size_level0=512, resume=True,
                                    verify_chunks=True)
    assert writer.repair_ids == {"e", "f"} and writer.done_ids == {"a", "b", "c", "d"}
    writer.close()  # the run stops here (a kill, a failed slide)
    assert store.split_status(*TOP) == "writing"
    with pytest.raises(IncompleteSplit):
        store.open_bags(*TOP)
    # a plain --resume (the chunk's size is right) still knows which bags are redone
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume") == 0
    verify_ok(tmp_path / "store", capsys)
    assert comparable(tmp_path / "store") == comparable(reference)


# Repairs the split and stops once the chunks of the damaged bags are written (seals and the
# split document not yet), says so and waits to be SIGKILLed.
_REPAIR_PAUSED = """
import sys, time
from featurestore import open_store
from featurestore.core import bag_repair

def paused(*args, **kwargs):
    print("written", flush=True)
    time.sleep(600)

bag_repair._reseal = paused
sys.exit(__import__("featurestore.cli", fromlist=["main"]).main(sys.argv[1:]))
"""


def test_sigkill_during_the_repair_commit_then_resume(source: Path, reference: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    split = imported(source, tmp_path / "store")
    flip(chunk(split, "features", 2))
    argv = ["import", str(source), "--store", str(tmp_path / "store"), "--dataset", "ds", "--encoder-name", "enc",
            "--split", "train", "--no-progress", *CHUNK, "--resume", "--verify-chunks"]
    proc = subprocess.Popen([sys.executable, "-c", _REPAIR_PAUSED, *argv], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.stdout.readline().strip() != "written":
        assert proc.poll() is None, "the repair ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert open_store(str(tmp_path / "store")).split_status(*TOP) == "writing"
    assert run_import(source, tmp_path / "store", *CHUNK, "--resume") == 0
    verify_ok(tmp_path / "store", capsys)
    assert comparable(tmp_path / "store") == comparable(reference)


def test_a_repair_adds_only_the_damaged_bags_and_each_as_it_was(tmp_path: Path) -> None:
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split(*TOP, dim=DIM, chunk_bytes=ROWS * DIM * 2)
    rng = np.random.default_rng(1)
    for bag, n in (("x", 12), ("y", 6)):
        writer.add_bag(bag, rng.standard_normal((n, DIM)).astype(np.float32), label=None)
    writer.commit()
    flip(chunk(tmp_path.joinpath(*TOP), "features", 1))  # rows 8-15: x's last and y's first
    repair: Any = store.create_bag_split(*TOP, dim=DIM, chunk_bytes=ROWS * DIM * 2, resume=True, verify_chunks=True)
    assert repair.repair_ids == {"x", "y"} and repair.done_ids == set()
    with pytest.raises(SplitExists, match="'z' is not in split ds/enc/train"):
        repair.add_bag("z", np.zeros((2, DIM), np.float32))
    repair.add_bag("x", np.zeros((12, DIM), np.float32))
    repair.add_bag("y", np.zeros((7, DIM), np.float32))  # another length: not the bag it replaces
    with pytest.raises(InputChanged, match="bag 'y' now has rows 7, the split holds 6"):
        repair.commit()
    assert store.split_status(*TOP) == "writing"


def test_a_repair_on_every_backend_rewrites_the_bags_chunks_with_their_bytes(store_url: str,
                                                                              store_options: dict[str, Any]) -> None:
    """The same repair through the storage interface on a local directory, memory://, S3 (moto)
    and SeaweedFS: a chunk overwritten with another one's bytes (valid crc32c, only the seal tells)
    gets back its own bytes, and every other chunk is the same object."""
    from featurestore.core.verify import verify_store

    rng = np.random.default_rng(2)
    data = {f"s{i}": rng.standard_normal((n, DIM)).astype(np.float32) for i, n in enumerate((9, 14, 0, 20))}

    def create(**kwargs: Any) -> Any:
        return open_store(store_url, mode="a", **store_options).create_bag_split(
            *TOP, dim=DIM, chunk_bytes=ROWS * DIM * 2, **kwargs)

    writer = create()
    for bag, features in data.items():
        writer.add_bag(bag, features, coords=np.arange(2 * len(features)).reshape(-1, 2))
    writer.commit()
    storage = open_store(store_url, **store_options).storage
    key = "/".join(TOP)
    names = [f"{key}/{a}/c/{i}/0" for a in ("features", "coords", "block_seals") for i in range(6)]
    original = dict(zip(names, storage.read_many(names)))
    storage.write(f"{key}/features/c/2/0", original[f"{key}/features/c/0/0"])  # rows 16-23: of s1 and s3
    repair = create(resume=True, verify_chunks=True)
    assert repair.repair_ids == {"s1", "s3"}
    for bag in sorted(repair.repair_ids):
        repair.add_bag(bag, data[bag], coords=np.arange(2 * len(data[bag])).reshape(-1, 2))
    repair.commit()
    assert dict(zip(names, storage.read_many(names))) == original
    checked = verify_store(open_store(store_url, **store_options))
    assert [(c.key, c.problems) for c in checked.checks] == [(key, [])]
    bags = open_store(store_url, **store_options).open_bags(*TOP)
    for bag, features in data.items():
        np.testing.assert_array_equal(bags.read_numpy(bag)[0], features.astype(np.float16))
