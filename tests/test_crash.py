"""Real processes: a writer killed with SIGKILL never leaves a complete split, ``resume=True``
in a new process finishes it with the bytes of an uninterrupted run, and two processes writing
disjoint chunks of one split equal one process."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import featurestore
from featurestore.core.storage import LocalStorage
from featurestore.errors import CacheKeyMismatch, IncompleteSplit, SplitNotFound
from featurestore.format import chunks, layout

from _core_helpers import comparable_chunk_file

# The writer under test. argv: root, mode (fresh | resume | rank | commit), rank, hold seconds.
# It prints one line per step and flushes, so the test can kill it at a known point; before
# commit it sleeps ``hold`` seconds, so a kill sent after any line lands before the commit.
WRITER = r"""
import json, os, sys, time
import numpy as np
import featurestore

root, mode, rank, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
N, ROWS, BATCH = 62, 4, 3
x = (np.random.default_rng(0).standard_normal((N, 4, 8)) * 3).astype(np.float32)
labels = np.arange(N) % 7
store = featurestore.open_store(root, mode="a", **json.loads(os.environ.get("FS_TEST_STORAGE_OPTIONS") or "{}"))
w = store.create_split("pannuke", "tiny-vit", "train", num_samples=N, sample_shape=(4, 8),
                       dtype="float16", chunk_bytes=ROWS * 64, label_dtype="int64",
                       metadata={"cache_key": "k1"}, resume=mode != "fresh")
print("pending", *w.pending_chunks(), flush=True)
if mode == "commit":
    w.commit()
    print("committed", flush=True)
    sys.exit(0)
if mode == "rank":  # chunk-ownership rule: this process holds the rows of chunks i % 2 == rank
    spans = [w.chunk_range(i) for i in range(w.num_chunks) if i % 2 == rank]
else:
    spans = [(0, N)]
step = 0
for lo, hi in spans:
    for start in range(lo, hi, BATCH):
        stop = min(start + BATCH, hi)
        w.write(start, x[start:stop], labels=labels[start:stop])
        print("progress", step, flush=True)
        step += 1
w.flush()  # write() hands whole chunks to the put threads; flush() waits until they are stored
print("written", flush=True)
time.sleep(hold)
if mode == "rank":
    w.close()
else:
    w.commit()
print("done", flush=True)
"""

SPLIT = ("pannuke", "tiny-vit", "train")
N = 62


def _start(root: Path | str, mode: str, rank: int = 0, hold: float = 0.0,
           options: dict[str, Any] | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FS_TEST_STORAGE_OPTIONS=json.dumps(options or {}))
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), mode, str(rank), str(hold)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def _wait_for(proc: subprocess.Popen[bytes], line: str, timeout: float = 60.0) -> list[str]:
    """Read the child's stdout until ``line`` (or ``line`` + " ...") appears; return the lines."""
    assert proc.stdout is not None
    fd, buffer, seen = proc.stdout.fileno(), b"", []
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            proc.kill()
            raise AssertionError(f"no {line!r} from the writer within {timeout}s; saw {seen}")
        # poll, not select(): the process may hold descriptors past 1024 (chunk maps are bounded
        # by a quarter of RLIMIT_NOFILE, 20000 here), which select() refuses
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(remaining * 1000):
            continue
        data = os.read(fd, 65536)
        if not data:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise AssertionError(f"writer exited before {line!r}; saw {seen}; stderr:\n{err}")
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        seen += [c.decode() for c in complete]
        if any(s == line or s.startswith(line + " ") for s in seen):
            return seen


def _run(root: Path | str, mode: str, rank: int = 0, options: dict[str, Any] | None = None) -> list[str]:
    proc = _start(root, mode, rank, options=options)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    return out.decode().splitlines()


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the split except its group document (it holds timestamps), by path."""
    split = root.joinpath(*SPLIT)
    out = {}
    for path in sorted(split.rglob("*")):
        rel = path.relative_to(split).as_posix()
        if path.is_file() and rel != "zarr.json" and not path.name.endswith(".tmp"):
            out[rel] = comparable_chunk_file(rel, path.read_bytes())
    return out


def _metadata(root: Path) -> dict[str, Any]:
    meta = featurestore.open_store(str(root)).split_metadata(*SPLIT)
    return {k: v for k, v in meta.items() if k not in ("created", "completed", "generation")}


def _valid_chunks(root: Path, num_chunks: int) -> set[int]:
    """Chunks whose features, labels and statistics files are all present with a valid crc32c."""
    split = root.joinpath(*SPLIT)
    valid = set()
    for i in range(num_chunks):
        parts = [layout.chunk_key(f"{a}", i, nd) for a, nd in (("features", 3), ("labels", 1), ("chunk_stats", 2))]
        paths = [split / p for p in parts]
        if all(p.exists() for p in paths) and all(chunks.check(p.read_bytes(), None) is None for p in paths):
            valid.add(i)
    return valid


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run."""
    root = tmp_path_factory.mktemp("reference") / "store"
    lines = _run(root, "fresh")
    assert lines[-1] == "done"
    return root


def _assert_same_as_reference(root: Path, reference: Path) -> None:
    assert _files(root) == _files(reference)
    assert _metadata(root) == _metadata(reference)
    got = featurestore.open_store(str(root)).open(*SPLIT)
    want = featurestore.open_store(str(reference)).open(*SPLIT)
    index = np.random.default_rng(0).permutation(N)
    assert got.read_numpy(index).tobytes() == want.read_numpy(index).tobytes()
    assert got.labels.read_numpy(index).tobytes() == want.labels.read_numpy(index).tobytes()


def _kill_after(proc: subprocess.Popen[bytes], line: str) -> None:
    """SIGKILL the writer child once it printed ``line``; it must die of that signal."""
    try:
        _wait_for(proc, line)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("kill_after", ["pending", "progress 0", "progress 6", "progress 15", "written"])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path: Path, reference: Path, kill_after: str) -> None:
    root = tmp_path / "store"
    # After "written" the child sleeps before committing; after any other line it is writing
    # chunks when the signal lands.
    _kill_after(_start(root, "fresh", hold=30.0), kill_after)

    store = featurestore.open_store(str(root))
    assert store.split_status(*SPLIT) == "writing"
    with pytest.raises(IncompleteSplit):
        store.open(*SPLIT)
    num_chunks = -(-N // 4)
    survived = _valid_chunks(root, num_chunks)
    if kill_after == "written":
        assert survived == set(range(num_chunks))

    lines = _run(root, "resume")
    pending = [int(v) for v in lines[0].split()[1:]]
    assert lines[0].startswith("pending")
    assert set(pending) == set(range(num_chunks)) - survived  # valid chunks are kept
    assert lines[-1] == "done"
    _assert_same_as_reference(root, reference)


def test_two_processes_writing_disjoint_chunks(tmp_path: Path, reference: Path) -> None:
    root = tmp_path / "store"
    # the split is created once, then the ranks attach with resume=True
    store = featurestore.open_store(str(root), mode="a")
    store.create_split(*SPLIT, num_samples=N, sample_shape=(4, 8), dtype="float16",
                       chunk_bytes=4 * 64, label_dtype="int64", metadata={"cache_key": "k1"}).close()
    ranks = [_start(root, "rank", rank=r) for r in (0, 1)]
    for proc in ranks:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()
    assert store.split_status(*SPLIT) == "writing"
    assert _valid_chunks(root, -(-N // 4)) == set(range(-(-N // 4)))
    lines = _run(root, "commit")  # a process that wrote nothing itself commits
    assert lines == ["pending", "committed"]
    _assert_same_as_reference(root, reference)


def test_chunk_cut_short_between_mkdir_and_rename(tmp_path: Path, reference: Path) -> None:
    """What SIGKILL leaves while chunk i is being written (its directories and a temp file, no
    chunk file) is a missing chunk: a commit-only process refuses, resume rewrites it."""
    root = tmp_path / "store"
    shutil.copytree(reference, root)
    split = root.joinpath(*SPLIT)
    document = split / "zarr.json"
    meta = json.loads(document.read_text())
    meta["attributes"]["featurestore"]["status"] = "writing"
    document.write_text(json.dumps(meta))
    chunk = split / "features" / "c" / "3" / "0" / "0"
    chunk.unlink()
    (chunk.parent / ".0.12345.0badc0de.tmp").write_bytes(b"\0" * 100)
    assert (split / "labels" / "c" / "3").exists() and (split / "chunk_stats" / "c" / "3" / "0").exists()

    proc = _start(root, "commit")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and b"MissingChunks" in err and b"chunk 3" in err
    with pytest.raises(IncompleteSplit):
        featurestore.open_store(str(root)).open(*SPLIT)
    lines = _run(root, "resume")
    assert lines[0] == "pending 3"
    _assert_same_as_reference(root, reference)


class _DiesWhileDeleting(LocalStorage):
    """A real local store whose process "dies" part-way through deleting a split: the chunks go
    first (as a recursive delete may well order them), then the process is gone."""

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(Path(self._path(prefix)) / "features" / "c")
        raise SystemExit("killed while deleting")


def test_overwrite_cut_short_never_leaves_a_complete_split(tmp_path: Path, reference: Path) -> None:
    root = tmp_path / "store"
    shutil.copytree(reference, root)
    dying = featurestore.FeatureStore(_DiesWhileDeleting(str(root)), mode="a")
    with pytest.raises(SystemExit):
        dying.create_split(*SPLIT, num_samples=N, sample_shape=(4, 8), dtype="float32",
                           overwrite=True)
    store = featurestore.open_store(str(root))
    with pytest.raises((IncompleteSplit, SplitNotFound)):
        store.open(*SPLIT)
    if (root.joinpath(*SPLIT) / "zarr.json").exists():
        assert store.split_status(*SPLIT) == "writing"
    # the stale split keeps its own cache key: resuming it as another run's split is refused
    with pytest.raises(CacheKeyMismatch):
        featurestore.open_store(str(root), mode="a").create_split(
            *SPLIT, num_samples=N, sample_shape=(4, 8), dtype="float16", chunk_bytes=4 * 64,
            label_dtype="int64", metadata={"cache_key": "another-encoder"}, resume=True)


# ---------------------------------------------------------------------- the same on a real S3 server
def _object_files(url: str, options: dict[str, Any], comparable: bool = True) -> dict[str, bytes]:
    """Every object of the split except its group document, by key (as ``_files`` for a directory)."""
    import obstore

    from featurestore.core.storage.obstore import ObjectStorage

    storage = ObjectStorage(url, options)
    prefix = "/".join(SPLIT)
    keys = [o["path"] for batch in obstore.list(storage._store, prefix + "/") for o in batch]
    keys = sorted(k[len(prefix) + 1:] for k in keys if k != f"{prefix}/zarr.json")
    raws = storage.read_many([f"{prefix}/{k}" for k in keys])
    return {k: comparable_chunk_file(k, bytes(b)) if comparable else bytes(b) for k, b in zip(keys, raws)}


@pytest.mark.parametrize("kill_after", ["progress 6", "written"])
def test_sigkill_then_resume_on_s3_equals_uninterrupted_run(seaweed_url: str, seaweed: Any, reference: Path,
                                                            kill_after: str) -> None:
    """SeaweedFS: a writer killed mid-split leaves only whole chunk objects; a resumed run in a
    new process ends with exactly the objects of the uninterrupted local run."""
    options = seaweed.storage_options
    _kill_after(_start(seaweed_url, "fresh", hold=30.0, options=options), kill_after)
    store = featurestore.open_store(seaweed_url, **options)
    assert store.split_status(*SPLIT) == "writing"
    with pytest.raises(IncompleteSplit):
        store.open(*SPLIT)
    before = _object_files(seaweed_url, options, comparable=False)
    assert all(chunks.check(raw, None) is None for key, raw in before.items() if "/c/" in key)  # none torn

    lines = _run(seaweed_url, "resume", options=options)
    assert lines[-1] == "done"
    assert _object_files(seaweed_url, options) == _files(reference)
    assert {k: v for k, v in store.split_metadata(*SPLIT).items() if k not in ("created", "completed", "generation")} \
        == _metadata(reference)
    index = np.random.default_rng(0).permutation(N)
    got, want = store.open(*SPLIT), featurestore.open_store(str(reference)).open(*SPLIT)
    assert got.read_numpy(index).tobytes() == want.read_numpy(index).tobytes()


# A writer that stops in the middle of a put: the first piece of its temporary file is written,
# then it says so and waits (to be SIGKILLed, or to stay alive while another process resumes).
PAUSED_WRITER = r"""
import sys, time
import numpy as np
import featurestore
from featurestore.core.storage import files

real_stream = files.stream_parts

def paused_stream(f, parts, *, seal, writeback):
    f.write(bytes(memoryview(parts[0]).cast("B")[:100]))
    f.flush()
    print("in-put", flush=True)
    time.sleep(600)

files.stream_parts = paused_stream
root = sys.argv[1]
store = featurestore.open_store(root, mode="a")
w = store.create_split("pannuke", "tiny-vit", "train", num_samples=62, sample_shape=(4, 8),
                       dtype="float16", chunk_bytes=4 * 64, label_dtype="int64",
                       metadata={"cache_key": "k1"}, resume=True)
w.write(0, np.ones((4, 4, 8), np.float32), labels=np.zeros(4, np.int64))
w.flush()
"""


def _paused_writer(root: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", PAUSED_WRITER, str(root)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    _wait_for(proc, "in-put")
    return proc


def _temp_files(root: Path) -> list[Path]:
    return sorted(root.joinpath(*SPLIT).rglob("*.tmp"))


def _age(paths: list[Path], minutes: float) -> None:
    then = time.time() - minutes * 60
    for path in paths:
        os.utime(path, (then, then))


def test_temp_files_of_killed_writers_are_reported_and_resume_removes_only_stale_ones(tmp_path: Path) -> None:
    """A writer SIGKILLed in the middle of a put leaves its temporary file, which
    neither resume removed nor verify reported. verify lists it (a leftover, not damage); a
    resume removes it once its writer is gone from this host and it is 10 minutes old, and
    never the temporary file of a writer that is still running."""
    root = tmp_path / "store"
    proc = _start(root, "fresh")
    _wait_for(proc, "pending")
    proc.kill()
    proc.wait()
    killed = _paused_writer(root)
    killed.send_signal(signal.SIGKILL)
    killed.wait()  # reaped: its pid is gone from this host
    leftover = _temp_files(root)
    assert len(leftover) == 1 and f".{killed.pid}." in leftover[0].name

    result = subprocess.run([sys.executable, "-m", "featurestore.cli", "verify", str(root)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr  # incomplete split, no damage
    lines = result.stdout.splitlines()
    rel = leftover[0].relative_to(root).as_posix()
    assert any(line.startswith(f"LEFTOVER {rel}: ") and "100 B" in line and "not running" in line
               for line in lines), lines
    assert "1 leftover temporary file(s), 100 B" in result.stdout

    store = featurestore.open_store(str(root), mode="a")

    def resume() -> None:
        store.create_split(*SPLIT, num_samples=N, sample_shape=(4, 8), dtype="float16", chunk_bytes=4 * 64,
                           label_dtype="int64", metadata={"cache_key": "k1"}, resume=True).close()

    resume()  # young: its writer may be on another host sharing the file system
    assert _temp_files(root) == leftover
    live = _paused_writer(root)  # a writer still running, its put in progress
    try:
        both = _temp_files(root)
        assert len(both) == 2
        _age(both, 11)
        resume()
        assert [p.name for p in _temp_files(root)] == [p.name for p in both if f".{live.pid}." in p.name]
    finally:
        live.kill()
        live.wait()
    lines = _run(root, "resume")  # the split still finishes with an uninterrupted run's bytes
    assert lines[-1] == "done"
