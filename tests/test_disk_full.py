"""A real full disk (a size-limited tmpfs, mounted as root): ``featurestore extract`` stops with one
line naming the store and ``--resume``, the split stays ``writing``, and after space is freed
``--resume`` finishes it with the bytes of an uninterrupted run."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from _core_helpers import comparable_chunk_file
from test_extract import cli_env, run_cli

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke
from featurestore.errors import StorageFull

SPLIT = ("pannuke", "logged_tiny_vit", "fold1")
KIB = 1024


def _files(root: Path) -> dict[str, bytes]:
    split = root.joinpath(*SPLIT)
    return {str(p.relative_to(split)): comparable_chunk_file(str(p.relative_to(split)), p.read_bytes())
            for p in sorted(split.rglob("*"))
            if p.is_file() and p.name != "zarr.json" and not p.name.endswith(".tmp")}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 512 KiB tmpfs: room for a whole split, until the ballast the tests add fills it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={512 * KIB}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_then_resume_is_byte_identical(tmp_path: Path, small_disk: Path) -> None:
    fold = make_synthetic_pannuke(tmp_path / "fold", 96, size=32, seed=7)
    # [4, 128] float16 samples (1 KiB), 8 per chunk: 12 chunks of 8 KiB (+ labels and statistics).
    common = ["--images", f"pannuke:{fold}", "--encoder", "python:test_extract:logged_tiny_vit",
              "--dataset", SPLIT[0], "--split", SPLIT[2], "--batch-size", "4", "--num-workers", "0",
              "--chunk-mb", str(8 * KIB / 2**20), "--no-progress"]
    env = cli_env(FSX_LOG=str(tmp_path / "log"))
    reference = tmp_path / "reference"
    done = run_cli("extract", *common, "--store", str(reference), env=env)
    assert done.returncode == 0, done.stderr
    # fill the disk up to a few chunks' worth, so the run fails part-way
    store = small_disk / "store"
    (small_disk / "ballast").write_bytes(b"\0" * (400 * KIB))
    full = run_cli("extract", *common, "--store", str(store), env=env)
    assert full.returncode == 1
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr
    assert "no space left" in lines[0] and str(store) in lines[0] and "--resume" in lines[0]
    assert featurestore.open_store(str(store)).split_status(*SPLIT) == "writing"

    os.unlink(small_disk / "ballast")  # free the space
    resumed = run_cli("extract", *common, "--store", str(store), "--resume", env=env)
    assert resumed.returncode == 0, resumed.stderr
    assert featurestore.open_store(str(store)).split_status(*SPLIT) == "complete"
    assert _files(store) == _files(reference)


def test_writer_raises_storage_full_and_resumes(tmp_path: Path, small_disk: Path) -> None:
    """The library API: StorageFull from write/commit, nothing marked complete, resume finishes."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((64, 8, 128)).astype(np.float32)
    store = featurestore.open_store(str(small_disk / "store"), mode="a")
    (small_disk / "ballast").write_bytes(b"\0" * (400 * KIB))
    w = store.create_split("d", "e", "s", num_samples=64, sample_shape=(8, 128), dtype="float16",
                           chunk_bytes=4 * 8 * 128 * 2)
    with pytest.raises(StorageFull, match="no space left .*--resume"):
        for lo in range(0, 64, 4):
            w.write(lo, x[lo:lo + 4])
        w.commit()
    assert store.split_status("d", "e", "s") == "writing"
    os.unlink(small_disk / "ballast")
    w = store.create_split("d", "e", "s", num_samples=64, sample_shape=(8, 128), dtype="float16",
                           chunk_bytes=4 * 8 * 128 * 2, resume=True)
    assert 0 < len(w.pending_chunks()) < w.num_chunks
    for lo in range(0, 64, 4):
        w.write(lo, x[lo:lo + 4])
    w.commit()
    got = store.open("d", "e", "s").read_numpy(np.arange(64))
    assert got.tobytes() == x.astype(np.float16).tobytes()


def test_a_store_remounted_read_only_mid_write_is_one_error_then_resumes(tmp_path: Path, small_disk: Path) -> None:
    """A file system gone read-only under a writer raised a bare OSError (EROFS) from the library;
    now ReadOnlyStore naming the store, the chunk and the resume, and the resume finishes."""
    import numpy as np

    from featurestore.errors import ReadOnlyStore

    x = np.random.default_rng(1).standard_normal((32, 8, 128)).astype(np.float32)
    store = featurestore.open_store(str(small_disk / "store"), mode="a")
    make = dict(num_samples=32, sample_shape=(8, 128), dtype="float16", chunk_bytes=4 * 8 * 128 * 2)
    w = store.create_split("d", "e", "s", **make)
    w.write(0, x[:8])
    w.flush()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with pytest.raises(ReadOnlyStore, match=r"refused the write of chunk \d+ of d/e/s .*--resume"):
            for lo in range(8, 32, 4):
                w.write(lo, x[lo:lo + 4])
            w.commit()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)
    w = store.create_split("d", "e", "s", resume=True, **make)
    for lo in range(0, 32, 4):
        w.write(lo, x[lo:lo + 4])
    w.commit()
    assert store.open("d", "e", "s").read_numpy(np.arange(32)).tobytes() == x.astype(np.float16).tobytes()
