"""Bag splits with real processes: two writers of one split, SIGKILL while adding bags and while
committing, then resume; an overwrite taking the split over."""

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

from featurestore import open_store
from featurestore.errors import SplitExists, SplitTakenOver

DIM = 8
CHUNK_BYTES = 4 * DIM * 2  # 4 rows per chunk: many chunks, so a commit takes a while
BAGS = 40

_CHILD = """
import sys, numpy as np
from featurestore import open_store
root, mode, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(5)
bags = [(f"slide-{i:02d}", rng.standard_normal((3 + (i * 13) % 41, 8)).astype(np.float32)) for i in range(40)]
store = open_store(root, mode="a")
writer = store.create_bag_split("ds", "enc", "train", dim=8, chunk_bytes=4 * 8 * 2, resume=True)
order = bags[::-1] if mode in ("reverse", "commit") else bags
for i, (bag_id, features) in enumerate(order):
    if i % world != rank or bag_id in writer.done_ids:
        continue
    coords = np.arange(2 * len(features)).reshape(-1, 2)
    writer.add_bag(bag_id, features, coords=coords, label=None)
    print("added", bag_id, flush=True)
if mode == "commit":
    writer.close()  # every bag complete on storage; then the commit is what gets killed
    print("committing", flush=True)
    writer.commit()
else:
    writer.close()
print("done", flush=True)
"""


def expected() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {f"slide-{i:02d}": rng.standard_normal((3 + (i * 13) % 41, DIM)).astype(np.float32) for i in range(BAGS)}


def child(root: Path, mode: str, rank: int = 0, world: int = 1) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(root), mode, str(rank), str(world)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def create(root: Path) -> None:
    open_store(str(root), mode="a").create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=CHUNK_BYTES).close()


def commit(root: Path) -> dict[str, Any]:
    store = open_store(str(root), mode="a")
    return store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=CHUNK_BYTES, resume=True).commit()


def split_files(root: Path) -> dict[str, bytes]:
    top = root / "ds" / "enc" / "train"
    files = {str(p.relative_to(top)): p.read_bytes() for p in sorted(top.rglob("*")) if p.is_file()}
    # the split document, the sealed statistics and chunk seals carry the run's generation and timestamps
    return {name: raw for name, raw in files.items()
            if name != "zarr.json" and not name.startswith(("bag_stats", "chunk_seals"))}


def check_all(root: Path) -> None:
    bags = open_store(str(root)).open_bags("ds", "enc", "train")
    data = expected()
    assert bags.ids == sorted(data)
    for bag_id, features in data.items():
        np.testing.assert_array_equal(bags.read_numpy(bag_id)[0], features.astype(np.float16))


def test_two_writers_fill_one_split_with_the_bytes_of_one(tmp_path: Path) -> None:
    create(tmp_path / "one")
    create(tmp_path / "two")
    one = child(tmp_path / "one", "forward")
    ranks = [child(tmp_path / "two", "forward", rank, 2) for rank in range(2)]
    for proc in (one, *ranks):
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.endswith("done\n")
    commit(tmp_path / "one")
    commit(tmp_path / "two")
    assert split_files(tmp_path / "two") == split_files(tmp_path / "one")
    check_all(tmp_path / "two")


def _kill_after(proc: subprocess.Popen[str], line: str, count: int = 1) -> list[str]:
    """SIGKILL ``proc`` once it printed ``line`` ``count`` times; every line it printed before it
    died (it may have printed more between the last one read here and the signal)."""
    assert proc.stdout is not None
    seen = 0
    printed = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = proc.stdout.readline()
        assert text, "the child ended early"
        printed.append(text)
        if text.startswith(line):
            seen += 1
            if seen == count:
                break
    os.kill(proc.pid, signal.SIGKILL)
    printed.extend(proc.stdout.read().splitlines(keepends=True))
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return printed

def _two_sessions(root: Path) -> tuple[Any, Any, Any, Any, Any]:
    """Two sessions of one new bag split in two stores on ``root`` (A created it, B attached),
    one bag added by each, and B's record put held until ``go`` is set (``started`` when it is)."""
    import threading

    store_a, store_b = open_store(str(root), mode="a"), open_store(str(root), mode="a")
    a = store_a.create_bag_split("ds", "enc", "train", dim=DIM)
    b = store_b.create_bag_split("ds", "enc", "train", dim=DIM, resume=True)
    bags = expected()
    a.add_bag("slide-00", bags["slide-00"])
    b.add_bag("slide-01", bags["slide-01"])
    started, go = threading.Event(), threading.Event()
    put = store_b.storage.write_sealed

    def held(key: str, payload: Any) -> Any:
        if "/segments/" in key and "/records/" in key:
            started.set()
            go.wait(10)
        return put(key, payload)

    store_b.storage.write_sealed = held  # type: ignore[method-assign]
    return store_a, a, b, started, go


def _closing(session: Any, errors: list[BaseException]) -> Any:
    """A thread (not started) that closes ``session``, keeping what it raises in ``errors``."""
    import threading

    def close() -> None:
        try:
            session.close()
        except BaseException as error:  # noqa: BLE001 - checked by the caller
            errors.append(error)

    return threading.Thread(target=close)


def test_a_commit_while_another_session_closes_is_said_by_that_close(tmp_path: Path) -> None:
    """Session B is inside close(), its last record's put in flight, when session A commits and
    deletes the segments: B's put lands after, in no split. B's close() says so (its bag named)
    and leaves nothing under segments/; before, it returned as if its bag were kept."""
    root = tmp_path / "store"
    _, a, b, started, go = _two_sessions(root)
    errors: list[BaseException] = []
    closing = _closing(b, errors)
    closing.start()
    assert started.wait(10)
    a.commit()
    go.set()
    closing.join(30)
    assert len(errors) == 1 and isinstance(errors[0], SplitExists), errors
    assert "committed by another writer session" in str(errors[0]) and "'slide-01'" in str(errors[0])
    assert open_store(str(root)).open_bags("ds", "enc", "train").ids == ["slide-00"]
    segments = root / "ds" / "enc" / "train" / "segments"
    assert not [p for p in segments.rglob("*") if p.is_file()], list(segments.rglob("*"))  # B's record went


def test_a_bag_that_lands_during_the_commit_is_said_by_the_commit(tmp_path: Path) -> None:
    """Session B's last record lands after session A's commit listed the segments but before it
    marked the split complete: B's close() saw a split still writing and returned, and A's commit
    laid out the split without B's bag. A's commit says so (the bag named); before, nobody did."""
    root = tmp_path / "store"
    store_a, a, b, started, go = _two_sessions(root)
    errors: list[BaseException] = []
    closing = _closing(b, errors)
    write = store_a.storage.write

    def marking(key: str, *parts: Any) -> Any:  # A marks complete only once B's close has returned
        if key == "ds/enc/train/zarr.json" and started.is_set() and not go.is_set():
            go.set()
            closing.join(30)
        return write(key, *parts)

    store_a.storage.write = marking  # type: ignore[method-assign]
    closing.start()
    assert started.wait(10)
    with pytest.raises(SplitExists, match=r"1 bag\(s\) another writer session added while this commit ran .*'slide-01'"):
        a.commit()
    assert not closing.is_alive() and errors == []  # B could not tell: the split was still writing
    assert open_store(str(root)).open_bags("ds", "enc", "train").ids == ["slide-00"]
    segments = root / "ds" / "enc" / "train" / "segments"
    assert not [p for p in segments.rglob("*") if p.is_file()], list(segments.rglob("*"))


def test_a_session_whose_split_another_session_committed_keeps_the_commit(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(str(root), mode="a")
    first = store.create_bag_split("ds", "enc", "train", dim=DIM)
    late = store.create_bag_split("ds", "enc", "train", dim=DIM, resume=True)
    closed = store.create_bag_split("ds", "enc", "train", dim=DIM, resume=True)
    bags = expected()
    closed.add_bag("slide-00", bags["slide-00"])
    closed.close()  # on storage before the commit: the commit takes it
    for i in (1, 2, 3):
        first.add_bag(f"slide-{i:02d}", bags[f"slide-{i:02d}"])
    late.add_bag("slide-04", bags["slide-04"])  # held in its chunk buffer when the other commits
    assert first.commit()["bags"]["count"] == 4
    late.add_bag("slide-05", bags["slide-05"])
    # Its commit used to lay the split out again from what was left: only its own two bags.
    with pytest.raises(SplitExists, match="committed by another writer session.*2 of this session's 2 bags "
                                          "are not in it .first: 'slide-04'"):
        late.commit()
    split = open_store(str(root)).open_bags("ds", "enc", "train")
    assert sorted(split.ids) == [f"slide-{i:02d}" for i in range(4)]
    assert np.array_equal(split.read_numpy("slide-02")[0], bags["slide-02"].astype(np.float16))
    assert not (root / "ds" / "enc" / "train" / "segments").exists()  # the late session's segment went too
    assert closed.commit()["bags"]["count"] == 4  # every bag of it is in: nothing to do
    with pytest.raises(SplitExists, match="committing again would drop its bags"):
        from featurestore.core import bag_commit
        from featurestore.core.split_protocol import stored_metadata

        writing = stored_metadata(store.storage, "ds/enc/train").replace(status="writing")
        bag_commit.commit(store.storage, "ds/enc/train", writing)



@pytest.mark.parametrize("after", [1, 17, 39])
def test_sigkill_while_adding_bags_then_resume(tmp_path: Path, after: int) -> None:
    create(tmp_path)
    printed = _kill_after(child(tmp_path, "forward"), "added", after)
    added = {text.split()[1] for text in printed if text.startswith("added")}
    store = open_store(str(tmp_path), mode="a")
    assert store.split_status("ds", "enc", "train") == "writing"
    writer = store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=CHUNK_BYTES, resume=True)
    kept = writer.done_ids
    writer.close()
    assert kept <= added  # never a bag it had not finished adding (printed after add_bag returned)
    proc = child(tmp_path, "forward")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert not {line.split()[1] for line in out.splitlines() if line.startswith("added")} & kept  # no duplicates
    commit(tmp_path)
    check_all(tmp_path)


def test_sigkill_during_commit_then_commit_again(tmp_path: Path) -> None:
    """Bags added in reverse id order: the commit rewrites every chunk; killed midway, the split
    stays 'writing' with its segments, and a second commit gives the bytes of an unbroken one."""
    create(tmp_path / "ref")
    proc = child(tmp_path / "ref", "reverse")
    proc.communicate(timeout=120)
    commit(tmp_path / "ref")
    create(tmp_path / "cut")
    proc = child(tmp_path / "cut", "commit")
    _kill_after(proc, "committing")
    store = open_store(str(tmp_path / "cut"), mode="a")
    assert store.split_status("ds", "enc", "train") == "writing"
    commit(tmp_path / "cut")
    check_all(tmp_path / "cut")


def test_overwrite_takes_the_split_over(tmp_path: Path) -> None:
    store = open_store(str(tmp_path), mode="a")
    old = store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=CHUNK_BYTES)
    old.add_bag("a", np.zeros((3, DIM), np.float32))
    store.create_bag_split("ds", "enc", "train", dim=DIM, chunk_bytes=CHUNK_BYTES, overwrite=True)
    with pytest.raises(SplitTakenOver):
        old.add_bag("b", np.zeros((40, DIM), np.float32))  # its first full chunk checks the generation


# Commits the split and stops once its chunks are in place (features and coords linked from the
# segment, nothing of the index written yet), says so and waits to be SIGKILLed.
_COMMIT_PAUSED = """
import sys, time
from featurestore import open_store
from featurestore.core import bag_commit

def paused(*args, **kwargs):
    print("linked", flush=True)
    time.sleep(600)

bag_commit._write_index = paused
store = open_store(sys.argv[1], mode="a")
store.create_bag_split("ds", "enc", "train", dim=8, chunk_bytes=4 * 8 * 2, resume=True).commit()
"""


def test_sigkill_after_the_chunks_are_linked_then_resume_leaves_no_temporary_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bags added in id order: the commit links every segment chunk in place. Killed after that,
    the resumed commit links each chunk again onto the same file (a rename between two names of
    one inode does nothing), which left one temporary link per chunk inside the complete split."""
    from featurestore.cli import main

    create(tmp_path)
    proc = child(tmp_path, "forward")
    proc.communicate(timeout=120)
    assert proc.returncode == 0
    paused = subprocess.Popen([sys.executable, "-c", _COMMIT_PAUSED, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    _kill_after(paused, "linked")
    split = tmp_path / "ds" / "enc" / "train"
    linked = sorted(split.glob("features/c/*/*"))
    assert linked and all(p.stat().st_nlink == 2 for p in linked)  # the segment's files, linked
    assert not list(split.rglob("*.tmp"))
    commit(tmp_path)
    check_all(tmp_path)
    assert not list(split.rglob("*.tmp"))
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ds/enc/train: ok (" in out and "leftover" not in out.lower(), out


def test_string_arrays_never_write_their_parents_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """zarr.create_array on the store wrote each parent group's zarr.json "if absent": on an object
    store that ignores If-None-Match that replaced the root's, the dataset's, the encoder's and the
    split's documents with empty groups (the store was no longer a featurestore). Such a server
    is played here by a local zarr store whose create-if-absent always writes."""
    from zarr.storage import LocalStore

    async def always(self: Any, key: str, value: Any) -> None:
        await self.set(key, value)

    monkeypatch.setattr(LocalStore, "set_if_not_exists", always)
    root = tmp_path / "store"
    store = open_store(str(root), mode="a")
    dense = store.create_split("ds", "enc", "dense", num_samples=2, sample_shape=(DIM,), dtype="float16",
                               ids=["x", "y"])
    dense.write(0, np.zeros((2, DIM), np.float32))
    dense.commit()
    writer = store.create_bag_split("ds", "enc", "bags", dim=DIM)
    writer.add_bag("a", np.ones((3, DIM), np.float32))
    writer.commit()
    reopened = open_store(str(root))  # the root, dataset, encoder and split documents intact
    assert reopened.open("ds", "enc", "dense").ids == ["x", "y"]
    assert list(reopened.open_bags("ds", "enc", "bags").ids) == ["a"]
