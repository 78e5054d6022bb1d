"""Fault injection on the write side, on real processes.

Each test reproduces one reported failure: two ``featurestore extract`` processes racing on one
split, damaged documents and swapped chunk files under ``featurestore verify``, a damaged complete
split under ``--resume``, store URLs that need storage options, an overflow in the first batch and
CLI input that used to print tracebacks. Every test failed before its fix.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_extract import cli_env, read_all, run_cli

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke
from featurestore.errors import SplitExists, SplitTakenOver
from featurestore.format import layout

SPLIT = ("pannuke", "enc", "fold1")
N = 20
# patch_encoder: 17 tokens x 16 channels float16 = 544 bytes a sample; 4 samples (one batch) a chunk
ROWS = 4
COMMON = ["--dataset", SPLIT[0], "--split", SPLIT[2], "--encoder-name", SPLIT[1], "--batch-size", "4",
          "--num-workers", "0", "--no-progress", "--chunk-mb", str(ROWS * 17 * 16 * 2 / 2**20)]


@pytest.fixture(scope="module")
def fold(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(make_synthetic_pannuke(tmp_path_factory.mktemp("fold"), N, size=32, seed=3))


def _extract(fold: Path, store: Path, *extra: str, encoder: str = "patch_encoder",
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cli("extract", "--images", f"pannuke:{fold}", "--encoder", f"python:test_extract:{encoder}",
                   "--store", str(store), *COMMON, *extra, env=env)


@pytest.fixture(scope="module")
def reference(fold: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted extraction: the bytes every repaired split must equal."""
    store = tmp_path_factory.mktemp("reference") / "store"
    done = _extract(fold, store)
    assert done.returncode == 0, done.stderr
    return store


def _copy(reference: Path, tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(reference, store)
    return store


def _split_dir(store: Path) -> Path:
    return store.joinpath(*SPLIT)


def _verify(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("verify", str(store), *extra)


def _one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("featurestore: error: "), result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- 12.1 generation
def test_concurrent_overwrite_stops_the_writer_it_replaced(fold: Path, reference: Path, tmp_path: Path) -> None:
    """A slow extract A, then an --overwrite B with another encoder into the same split.
    Before: both exited 0 and the complete split mixed A's and B's rows, `verify` said ok."""
    store = tmp_path / "store"
    chunks = _split_dir(store) / "features" / "c"
    slow = subprocess.Popen(
        [sys.executable, "-m", "featurestore.cli", "extract", "--images", f"pannuke:{fold}",
         "--encoder", "python:test_extract:bf16_encoder", "--dtype", "float16", "--store", str(store), *COMMON],
        env=cli_env(FSX_SLEEP="5"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and slow.poll() is None and not (chunks / "0" / "0" / "0").is_file():
            time.sleep(0.05)
        assert slow.poll() is None, "A ended before B could start: slow its encoder down"
        overwrite = _extract(fold, store, "--overwrite")
        assert overwrite.returncode == 0, overwrite.stderr
        _, err = slow.communicate(timeout=120)
    finally:
        slow.kill()
    assert slow.returncode == 1, err
    assert "taken over" in err and "Traceback" not in err, err
    meta = featurestore.open_store(str(store)).split_metadata(*SPLIT)
    assert meta["status"] == "complete" and meta["encoder"]["spec"] == "python:test_extract:patch_encoder"
    assert np.array_equal(read_all(str(store), SPLIT), read_all(str(reference), SPLIT))  # only B's rows
    assert _verify(store).returncode == 0


def test_a_writer_whose_split_was_overwritten_refuses_to_write_or_commit(tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    make = dict(num_samples=8, sample_shape=(2, 3), dtype="float32", chunk_rows=2)
    first = store.create_split("d", "e", "s", **make)
    x = np.arange(48, dtype=np.float32).reshape(8, 2, 3)
    first.write(0, x[:2])
    second = store.create_split("d", "e", "s", overwrite=True, **make)
    assert second.generation != first.generation
    with pytest.raises(SplitTakenOver, match="taken over"):
        first.write(2, x[2:4])
    with pytest.raises(SplitTakenOver):
        first.commit()
    second.write(0, x)
    assert second.commit()["generation"] == second.generation
    resumed = store.create_split("d", "e", "s", resume=True, **make)
    assert resumed.generation == second.generation  # resume keeps it


def test_a_writer_whose_split_another_writer_committed_changes_nothing(tmp_path: Path) -> None:
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    make = dict(num_samples=8, sample_shape=(2, 3), dtype="float32", chunk_rows=2)
    first = store.create_split("d", "e", "s", **make)
    late = store.create_split("d", "e", "s", resume=True, **make)
    idle = store.create_split("d", "e", "s", resume=True, **make)
    x = np.arange(48, dtype=np.float32).reshape(8, 2, 3)
    first.write(0, x)
    committed = first.commit()
    # A late writer of the same rows would rewrite sealed chunks of a complete split.
    with pytest.raises(SplitExists, match="committed by another writer.*changing it"):
        late.write(0, -x[:2])
    assert np.array_equal(read_all(str(tmp_path / "s"), ("d", "e", "s")), x)
    # A writer holding nothing more: its commit changes nothing and returns the stored metadata.
    assert idle.commit()["completed"] == committed["completed"]
    assert _verify(tmp_path / "s").returncode == 0


def test_a_put_broken_by_an_overwrite_reports_the_takeover(tmp_path: Path) -> None:
    """An --overwrite that deletes the split under a put in flight: the old writer reports the
    takeover (the put's FileNotFoundError as its cause), not the symptom."""
    store = featurestore.open_store(str(tmp_path / "s"), mode="a")
    make = dict(num_samples=8, sample_shape=(2, 3), dtype="float32", chunk_rows=2)
    first = store.create_split("d", "e", "s", **make)
    overwritten = threading.Event()

    class DirectoryGone:  # the put lands after the overwrite removed its directory
        url = store.url

        def write_sealed(self, key: str, payload: Any) -> None:  # how chunk puts write
            overwritten.wait(30)
            raise FileNotFoundError(2, "No such file or directory", key)

    first._puts._storage = DirectoryGone()  # type: ignore[assignment]
    first.write(0, np.ones((2, 2, 3), np.float32))
    store.create_split("d", "e", "s", overwrite=True, **make)
    overwritten.set()
    with pytest.raises(SplitTakenOver, match="taken over") as taken:
        first.flush()
    assert isinstance(taken.value.__cause__, FileNotFoundError)


def test_verify_and_resume_reject_a_chunk_of_another_generation(fold: Path, reference: Path, tmp_path: Path) -> None:
    """A chunk left by another run of the split (its files copied in, crc32c valid)."""
    store = _copy(reference, tmp_path)
    other = tmp_path / "other"
    assert _extract(fold, other).returncode == 0  # same bytes, another generation
    for array in ("features", "labels", "chunk_stats"):
        shutil.copytree(_split_dir(other) / array / "c" / "1", _split_dir(store) / array / "c" / "1",
                        dirs_exist_ok=True)
    checked = _verify(store)
    assert checked.returncode == 1 and "another generation" in checked.stdout, checked.stdout
    repaired = _extract(fold, store, "--resume", "--verify-chunks")
    assert repaired.returncode == 0, repaired.stderr
    assert "4 samples encoded" in repaired.stdout, repaired.stdout
    assert _verify(store).returncode == 0


# ----------------------------------------------------------------------------- 12.3 verify
def _rewrite_json(path: Path, edit: Any) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _swap(a: Path, b: Path) -> None:
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def _make_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


DAMAGE = {
    "features document deleted": (lambda s: (s / "features" / "zarr.json").unlink(), "features/zarr.json: missing"),
    "labels document garbled": (lambda s: (s / "labels" / "zarr.json").write_text("{garbled"), "labels/zarr.json: not valid JSON"),
    "split document deleted": (lambda s: (s / "zarr.json").unlink(), "not found"),
    "dataset document deleted": (lambda s: (s.parent.parent / "zarr.json").unlink(), "dataset group has no zarr.json"),
    "features shape edited": (lambda s: _rewrite_json(s / "features" / "zarr.json", lambda d: d.update(shape=[N + 4, *d["shape"][1:]])),
                              "shape"),
    "num_samples edited": (lambda s: _rewrite_json(s / "zarr.json", lambda d: d["attributes"]["featurestore"].update(num_samples=N - 1)),
                           "but the split metadata says"),
    "features chunks swapped": (lambda s: _swap(s / "features/c/0/0/0", s / "features/c/1/0/0"), "channel means do not match"),
    "statistics rows swapped": (lambda s: _swap(s / "chunk_stats/c/0/0", s / "chunk_stats/c/1/0"), "holds the statistics of chunk"),
    "chunk path is a directory": (lambda s: _make_directory(s / "features/c/2/0/0"), "is a directory"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_verify_checks_documents_against_each_other_and_the_chunks(damage: str, reference: Path, tmp_path: Path) -> None:
    """Each of these passed `verify` (ok, or "0 checked", exit 0) or crashed it."""
    store = _copy(reference, tmp_path)
    assert _verify(store).returncode == 0
    apply, expected = DAMAGE[damage]
    apply(_split_dir(store))
    result = _verify(store)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "DAMAGED" in result.stdout and expected in result.stdout, result.stdout


def test_verify_lists_every_problem(reference: Path, tmp_path: Path) -> None:
    store = _copy(reference, tmp_path)
    split = _split_dir(store)
    (split / "features/c/3/0/0").unlink()
    next(p for p in (split / "labels/c/1").rglob("*") if p.is_file()).write_bytes(b"short")
    result = _verify(store)
    assert result.returncode == 1
    damaged = [line for line in result.stdout.splitlines() if line.startswith("DAMAGED")]
    assert any("features/c/3/0/0: missing" in line for line in damaged), damaged
    assert any("labels/c/1" in line and ": size" in line for line in damaged), damaged


# ----------------------------------------------------------------------------- 12.5 resume repair
def test_resume_repairs_a_damaged_complete_split(fold: Path, reference: Path, tmp_path: Path) -> None:
    """Before, `--resume` said "already complete ... nothing to do"."""
    store = _copy(reference, tmp_path)
    split = _split_dir(store)
    (split / "features/c/1/0/0").unlink()
    raw = (split / "features/c/3/0/0").read_bytes()
    (split / "features/c/3/0/0").write_bytes(raw[:-10])  # truncated: a size check finds it
    repaired = _extract(fold, store, "--resume")
    assert repaired.returncode == 0, repaired.stderr
    assert f"{2 * ROWS} samples encoded" in repaired.stdout, repaired.stdout  # chunks 1 and 3 only
    assert _verify(store).returncode == 0
    assert np.array_equal(read_all(str(store), SPLIT), read_all(str(reference), SPLIT))

    # A flipped byte keeps the size: only --verify-chunks (crc32c) finds it.
    path = split / "features/c/2/0/0"
    flipped = bytearray(path.read_bytes())
    flipped[5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    assert "nothing to do" in _extract(fold, store, "--resume").stdout
    repaired = _extract(fold, store, "--resume", "--verify-chunks")
    assert repaired.returncode == 0 and f"{ROWS} samples encoded" in repaired.stdout, repaired.stdout
    assert _verify(store).returncode == 0
    assert np.array_equal(read_all(str(store), SPLIT), read_all(str(reference), SPLIT))


def test_the_advised_repair_repairs_flipped_bytes_and_swapped_chunks(fold: Path, reference: Path, tmp_path: Path) -> None:
    """CorruptChunk advised "--resume", which said "nothing to do" on a complete split;
    and two swapped features chunks (each crc32c valid) survived every resume. The advice now names
    --resume --verify-chunks, which re-reads every chunk against its statistics row too."""
    from featurestore.errors import REPAIR_ADVICE, CorruptChunk

    store = _copy(reference, tmp_path)
    split = _split_dir(store)
    path = split / "features/c/2/0/0"
    flipped = bytearray(path.read_bytes())
    flipped[5] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptChunk) as damaged:
        featurestore.open_store(str(store)).open(*SPLIT).read(list(range(N)))
    assert REPAIR_ADVICE in str(damaged.value) and "--resume --verify-chunks" in REPAIR_ADVICE
    _swap(split / "features/c/0/0/0", split / "features/c/4/0/0")
    repaired = _extract(fold, store, "--resume", "--verify-chunks")
    assert repaired.returncode == 0, repaired.stderr
    assert f"{3 * ROWS} samples encoded" in repaired.stdout, repaired.stdout  # chunks 0, 2 and 4 only
    assert _verify(store).returncode == 0
    assert np.array_equal(read_all(str(store), SPLIT), read_all(str(reference), SPLIT))


# ----------------------------------------------------------------------------- 12.9 storage options
def test_every_store_verb_takes_storage_options(reference: Path, s3_bucket: str,
                                                s3_storage_options: dict[str, Any]) -> None:
    """ls/info/verify had no --storage-options and ignored the environment."""
    url = f"s3://{s3_bucket}/store"
    import fsspec

    fs = fsspec.filesystem("s3", **s3_storage_options)
    fs.put(str(reference), url, recursive=True)
    options = json.dumps(s3_storage_options)
    names = list(SPLIT)
    for verb in (["ls", url], ["info", url, *names], ["verify", url]):
        flag = run_cli(*verb, "--storage-options", options)
        assert flag.returncode == 0, flag.stderr
        env = run_cli(*verb, env=cli_env(FEATURESTORE_STORAGE_OPTIONS=options))
        assert env.returncode == 0 and env.stdout == flag.stdout, env.stderr
    assert "ok (" in flag.stdout
    for verb in ("extract", "serve", "probe", "import"):
        assert "--storage-options" in run_cli(verb, "--help").stdout

    bad = _one_line_error(run_cli("ls", url, "--storage-options", "{not json"))
    assert "--storage-options" in bad and "endpoint_url" in bad
    missing = _one_line_error(run_cli("ls", f"s3://{s3_bucket}-absent/store", "--storage-options", options))
    assert f"{s3_bucket}-absent" in missing


# ----------------------------------------------------------------------------- 12.10 first batch
def test_float16_overflow_in_the_first_batch_leaves_the_store_untouched(fold: Path, tmp_path: Path) -> None:
    """NaN in sample 0 left nothing behind, an overflow left a `writing` split."""
    store = tmp_path / "store"
    line = _one_line_error(_extract(fold, store, encoder="overflow_encoder"))
    assert "65504" in line and "--dtype bfloat16" in line
    assert not store.exists(), sorted(p.name for p in store.rglob("*"))


# ----------------------------------------------------------------------------- 12.11 CLI input
@pytest.mark.parametrize(("flag", "value"), [("--chunk-mb", "inf"), ("--chunk-mb", "nan"), ("--threads", "-2"),
                                             ("--num-workers", "-1")])
def test_bad_extract_numbers_are_one_line(fold: Path, tmp_path: Path, flag: str, value: str) -> None:
    line = _one_line_error(_extract(fold, tmp_path / "store", flag, value))
    assert flag in line and value in line
    assert not (tmp_path / "store").exists()


def test_info_json_into_a_closed_pipe_is_quiet(reference: Path, tmp_path: Path) -> None:
    store = _copy(reference, tmp_path)
    # Large enough metadata that the writer is still writing when the reader goes away.
    _rewrite_json(_split_dir(store) / "zarr.json",
                  lambda d: d["attributes"]["featurestore"].update(note=["x" * 100] * 5000))
    proc = subprocess.Popen([sys.executable, "-m", "featurestore.cli", "info", str(store), *SPLIT, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"{"
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and b"BrokenPipe" not in err and b"Exception" not in err, err


@pytest.mark.parametrize(("flag", "value", "setting"), [("--compressor", "zstd", "compressor"),
                                                        ("--chunk-mb", "1", "chunk_rows")])
def test_rerun_into_a_complete_split_with_other_settings_is_refused(fold: Path, reference: Path, tmp_path: Path,
                                                                    flag: str, value: str, setting: str) -> None:
    """Before, it printed "already complete ... nothing to do" and kept the old split."""
    store = _copy(reference, tmp_path)
    before = (_split_dir(store) / layout.ZARR_JSON).read_bytes()
    line = _one_line_error(_extract(fold, store, flag, value))
    assert setting in line and "--overwrite" in line
    assert (_split_dir(store) / layout.ZARR_JSON).read_bytes() == before
