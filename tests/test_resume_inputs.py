"""A resume or re-run after the input changed kept the old rows and said complete.

The cache key fingerprints 18 sampled rows, so an input rewritten in place with those rows kept
passed it: ``import --resume`` finished the split from the new content on top of the chunks made
from the old one, ``verify`` was clean, and a re-run of the complete split said "nothing to do".
Now a kept chunk whose input file was modified after the split was created stops the run
(``InputChanged``, one line naming the file and ``--overwrite``). Real processes, a real SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_extract import cli_env, read_all, run_cli

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke

N, T, D = 4000, 16, 256  # 16 KiB float32 rows: a 64 MB cache, 80 chunks of 50 rows
SPLIT = ("ds", "enc", "s")
ROWS_PER_CHUNK = 50
IMPORT = ["--dataset", SPLIT[0], "--encoder-name", SPLIT[1], "--split", SPLIT[2], "--dtype", "float32",
          "--batch-size", "10", "--chunk-mb", str(ROWS_PER_CHUNK * T * D * 4 / 2**20), "--no-progress"]


def _sampled(n: int) -> set[int]:
    """The rows the cache fingerprint reads (caches.ArraySource.fingerprint)."""
    return {0, n - 1, *[n * k // 17 for k in range(1, 17)]}


def _rewrite_keeping_the_sampled_rows(path: Path) -> None:
    time.sleep(1.1)  # past the split's creation second (its `created` time has whole seconds)
    rows = np.load(path, mmap_mode="r+")
    keep = sorted(_sampled(len(rows)))
    saved = rows[keep].copy()
    rows[:] += 1.0
    rows[keep] = saved
    rows.flush()
    del rows


def _one_line(result: subprocess.CompletedProcess[str], *expected: str) -> None:
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def _chunks_on_storage(store: Path) -> int:
    directory = store.joinpath(*SPLIT, "features", "c")
    return len(os.listdir(directory)) if directory.is_dir() else 0


def test_resume_after_the_input_was_rewritten_in_place_is_refused(tmp_path: Path) -> None:
    source, store = tmp_path / "cache.npy", tmp_path / "store"
    np.save(source, np.random.default_rng(0).standard_normal((N, T, D), dtype=np.float32))
    proc = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "import", str(source), "--store", str(store),
                             *IMPORT], env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while _chunks_on_storage(store) < 4 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert proc.poll() is None, "the import finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    store_handle = featurestore.open_store(str(store))
    assert store_handle.split_status(*SPLIT) == "writing"

    _rewrite_keeping_the_sampled_rows(source)
    resumed = run_cli("import", str(source), "--store", str(store), *IMPORT, "--resume")
    _one_line(resumed, "was modified at", str(source), "--overwrite")
    assert store_handle.split_status(*SPLIT) == "writing"  # never called complete

    redone = run_cli("import", str(source), "--store", str(store), *IMPORT, "--overwrite")
    assert redone.returncode == 0, redone.stderr
    assert np.array_equal(read_all(str(store), SPLIT), np.load(source))


def test_rerun_of_a_complete_split_after_the_input_changed_is_refused(tmp_path: Path) -> None:
    source, store = tmp_path / "cache.npy", tmp_path / "store"
    np.save(source, np.random.default_rng(1).standard_normal((200, 4, 8), dtype=np.float32))
    assert run_cli("import", str(source), "--store", str(store), *IMPORT).returncode == 0
    again = run_cli("import", str(source), "--store", str(store), *IMPORT)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout  # unchanged: a no-op
    _rewrite_keeping_the_sampled_rows(source)
    _one_line(run_cli("import", str(source), "--store", str(store), *IMPORT), "was modified at", "--overwrite")
    _one_line(run_cli("import", str(source), "--store", str(store), *IMPORT, "--resume", "--verify-chunks"),
              "was modified at")


def _unsampled_image(path: Path) -> int:
    """An image whose bytes lie outside every window the source fingerprint reads
    (sources._file_fingerprint: head, tail and 16 strided 64 KiB windows)."""
    images = np.load(path, mmap_mode="r")
    size, window, first = path.stat().st_size, 1 << 16, images.offset
    per_image = images[0].nbytes
    starts = {0, max(0, size - window), *[size * k // 17 for k in range(1, 17)]}
    for index in range(len(images)):
        lo = first + index * per_image
        if all(lo + per_image <= s or lo >= s + window for s in starts):
            return index
    raise AssertionError("every image is fingerprinted: make the fold larger")


def test_extract_rerun_after_the_images_changed_is_refused(tmp_path: Path) -> None:
    fold = Path(make_synthetic_pannuke(tmp_path / "fold", 200, size=64, seed=3))
    store = tmp_path / "store"
    common = ["extract", "--images", f"pannuke:{fold}", "--encoder", "python:test_extract:patch_encoder",
              "--store", str(store), "--dataset", "p", "--split", "f", "--encoder-name", "e",
              "--batch-size", "50", "--num-workers", "0", "--no-progress"]
    assert run_cli(*common).returncode == 0
    time.sleep(1.1)
    victim = _unsampled_image(fold / "images.npy")
    images = np.load(fold / "images.npy", mmap_mode="r+")
    images[victim] = 255 - images[victim]  # the cache key (sampled bytes) cannot see this one
    images.flush()
    del images
    _one_line(run_cli(*common), "was modified at", "images.npy", "--overwrite")
    assert run_cli(*common, "--overwrite").returncode == 0


def test_a_file_that_fed_no_kept_chunk_may_change(tmp_path: Path) -> None:
    """Fixing an unreadable sample and resuming stays possible: only kept chunks' files count."""
    from featurestore.errors import InputChanged
    from featurestore.extract.input_check import refuse_changed_inputs

    old, new = tmp_path / "old.npy", tmp_path / "new.npy"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    past = time.time() - 3600
    os.utime(old, (past, past))
    created = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - 60))
    files = {0: str(old), 1: str(new)}
    refuse_changed_inputs(lambda a, b: [files[i] for i in range(a, b)], [(0, 1)], created, "d/e/s")
    with pytest.raises(InputChanged, match="new.npy was modified at"):
        refuse_changed_inputs(lambda a, b: [files[i] for i in range(a, b)], [(0, 2)], created, "d/e/s")


def test_a_run_with_a_cache_key_does_not_resume_a_split_written_without_one(tmp_path: Path) -> None:
    """A split a library writer made (no cache key) is not taken over by a keyed run (an extract or
    import --resume): nothing shows its rows came from that run's inputs. A resume without a key
    (the library vouching for its rows) still works and keeps the split's key."""
    from featurestore.errors import CacheKeyMismatch

    kw = dict(num_samples=8, sample_shape=(4,), dtype="float32", chunk_rows=4)
    store = featurestore.open_store(str(tmp_path / "store"), mode="a")
    writer = store.create_split(*SPLIT, **kw)
    writer.write(0, np.ones((4, 4), np.float32))
    writer.close()
    with pytest.raises(CacheKeyMismatch, match="written without a cache key, this run has 0123456789abcdef"):
        store.create_split(*SPLIT, **kw, metadata={"cache_key": "0123456789abcdef" * 4}, resume=True)
    writer = store.create_split(*SPLIT, **kw, resume=True)
    writer.write(4, np.full((4, 4), 2, np.float32))
    writer.commit()
    assert store.open(*SPLIT).read_numpy([0, 7])[:, 0].tolist() == [1.0, 2.0]
    assert store.split_metadata(*SPLIT).get("cache_key") is None
