"""Real processes: DataLoader workers die with their parent (featurestore.extract.workers).

Without the hook a SIGKILLed ``featurestore extract`` left its image workers behind, reparented
to init and blocked on a pipe write for good; each resume of a preempted job added more.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil
import pytest
from test_extract import cli_env, run_cli

import featurestore
from featurestore.demo.synthetic import make_synthetic_pannuke

SPLIT = ("pannuke", "logged_tiny_vit", "fold1")
DEATH_DEADLINE = 10.0  # seconds; torch's own 5 s check of the parent must not be what passes the test


def _alive(pids: Iterable[int]) -> list[int]:
    """The pids still running (an exited orphan may linger as a zombie until init reaps it)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _wait_dead(pids: list[int], timeout: float = DEATH_DEADLINE) -> list[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pids)


def _children(pid: int) -> list[int]:
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _start(args: list[str], output: Path, **env: str) -> subprocess.Popen[bytes]:
    """Output to a file, not a pipe: orphans holding a pipe's write end would hang the reader."""
    with output.open("wb") as sink:
        return subprocess.Popen([sys.executable, *args], env=cli_env(**env), stdout=sink, stderr=subprocess.STDOUT)


def _kill_all(process: subprocess.Popen[bytes], pids: Iterable[int]) -> None:
    """Kill the process and its (known) children: a failing test must not leave orphans behind."""
    pids = [*pids, *_children(process.pid)]
    process.kill()
    for pid in _alive(pids):
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass
    process.wait()


def _await(condition: Callable[[], bool], what: str, process: subprocess.Popen[bytes], output: Path,
           timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the process ended before {what}: {output.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def test_sigkilled_extract_takes_its_workers_along_and_resumes(tmp_path: Path) -> None:
    # Labels travel through the workers' one result pipe (images go by shared memory): a batch's
    # 32 uint8 64x64 class maps are 128 KiB, so a few batches in flight fill the 64 KiB pipe and
    # the workers' feeder threads block writing into it, as they did in the reported runs.
    fold = make_synthetic_pannuke(tmp_path / "fold", 320, size=64, seed=3)
    store, log = tmp_path / "store", tmp_path / "encoded.log"
    common = ["--images", f"pannuke:{fold}", "--encoder", "python:test_extract:logged_tiny_vit",
              "--store", str(store), "--dataset", SPLIT[0], "--split", SPLIT[2], "--batch-size", "32",
              "--chunk-mb", "1", "--threads", "1", "--num-workers", "2"]
    # A slow encoder: the workers fill their prefetch queues and then wait on the main process.
    output = tmp_path / "output.txt"
    process = _start(["-m", "featurestore.cli", "extract", *common], output, FSX_SLEEP="0.3", FSX_LOG=str(log))
    parent = psutil.Process(process.pid)
    workers: list[int] = []
    try:
        _await(lambda: len(parent.children()) >= 2, "2 image workers", process, output)
        # Batches in flight: the probe sample plus 2 batches encoded, more queued behind them.
        _await(lambda: log.is_file() and len(log.read_text().split()) >= 3, "2 encoded batches", process, output)
        workers = [child.pid for child in parent.children(recursive=True)]
        assert len(workers) >= 2
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert process.returncode == -signal.SIGKILL
        left = _wait_dead(workers)
        assert not left, f"workers {left} outlived the SIGKILLed extract by {DEATH_DEADLINE} s"
    finally:
        _kill_all(process, workers)
    assert featurestore.open_store(str(store)).split_status(*SPLIT) == "writing"
    resumed = run_cli("extract", *common, "--resume", env=cli_env())
    assert resumed.returncode == 0, resumed.stderr
    assert featurestore.open_store(str(store)).split_status(*SPLIT) == "complete"


# A parent process whose DataLoader workers (or a raw forked child) report their pids.
PARENT = r"""
import os, sys, threading, time
import torch
from featurestore.extract.workers import DieWithParent, die_with_parent

mode, marks = sys.argv[1], sys.argv[2]

class Endless(torch.utils.data.Dataset):
    def __len__(self):
        return 10**9
    def __getitem__(self, i):  # pickled into the result pipe: a few fill it, as labels do in extract
        return bytes(65536)

def mark(worker_id):  # the caller's own init, composed after the hook
    with open(os.path.join(marks, str(os.getpid())), "w") as f:
        f.write(str(worker_id))

def await_marks(n):  # the hook (and the init after it) ran in n workers
    while len(os.listdir(marks)) < n:
        time.sleep(0.01)

def loader():
    return torch.utils.data.DataLoader(Endless(), batch_size=4, num_workers=2, worker_init_fn=DieWithParent(mark))

if mode == "main":
    batches = iter(loader())
    await_marks(2)
elif mode == "thread":
    # The workers fork on a short-lived thread; they must outlive it and still serve batches.
    # It lives until the hook ran in both: a PR_SET_PDEATHSIG set after its exit would never fire.
    box = []
    def fork_workers():
        box.append(iter(loader()))
        await_marks(2)
    forker = threading.Thread(target=fork_workers)
    forker.start()
    forker.join()
    time.sleep(1.0)  # PR_SET_PDEATHSIG would fire as the forking thread exits
    batches = box[0]
    for _ in range(20):
        next(batches)
elif mode == "late":
    # The parent dies before the child calls the hook: the child must not stay behind.
    me = os.getpid()
    child = os.fork()
    if child == 0:
        while os.getppid() == me:
            time.sleep(0.01)
        die_with_parent()
        time.sleep(600)
        os._exit(0)
    open(os.path.join(marks, str(child)), "w").close()
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["main", "thread", "late"])
def test_forked_worker_dies_when_its_parent_is_sigkilled(tmp_path: Path, mode: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    output = tmp_path / "output.txt"
    process = _start(["-c", PARENT, mode, str(marks)], output)
    children: list[int] = []
    try:
        _await(lambda: output.read_text().startswith("ready"), "ready", process, output, timeout=60)
        children = [int(p.name) for p in marks.iterdir()]
        assert len(children) == (1 if mode == "late" else 2)  # the composed init ran in each worker
        assert not set(children) - set(_alive(children)), "a worker died while its parent lived"
        process.send_signal(signal.SIGKILL)
        process.wait()
        left = _wait_dead(children)
        assert not left, f"children {left} outlived their SIGKILLed parent by {DEATH_DEADLINE} s"
    finally:
        _kill_all(process, children)
