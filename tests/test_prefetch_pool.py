"""The prefetch threads' process-wide pool: reused across epochs and loaders, safe across a fork,
never in the way of the interpreter's exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from _loader_fixtures import DATASET, ENCODER, NUM_SAMPLES, local_store, reference  # noqa: F401

from client import FeatureDataset, FeatureLoader
from client import prefetch
from client.prefetch import worker_pool


def _recording(ds: FeatureDataset, seen: list[threading.Thread], monkeypatch: pytest.MonkeyPatch) -> None:
    real = ds.read_into

    def read_into(index: np.ndarray, features: np.ndarray, labels: Any = None) -> None:
        seen.append(threading.current_thread())  # the object, kept: a new thread is a new object
        real(index, features, labels)

    monkeypatch.setattr(ds, "read_into", read_into)


def test_prefetch_threads_are_reused_across_epochs_and_loaders(local_store: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ds = FeatureDataset(local_store, DATASET, ENCODER, "f32")
    seen: list[threading.Thread] = []
    _recording(ds, seen, monkeypatch)
    expected = torch.from_numpy(reference()[0])
    alive = set(threading.enumerate())  # other tests of this process may have left idle pool threads
    pool_threads = worker_pool().threads
    first = FeatureLoader(ds, batch_size=8, shuffle=False, device="cpu", num_threads=2, prefetch=2)
    for epoch in range(3):
        first.set_epoch(epoch)
        assert torch.equal(torch.cat([f for f, _ in first]), expected)
    second = FeatureLoader(ds, batch_size=4, shuffle=False, device="cpu", num_threads=2, prefetch=2)
    assert torch.equal(torch.cat([f for f, _ in second]), expected)
    producers = {t for t in seen if t is not threading.current_thread()}
    # Before the pool: two new threads per epoch (8 over these four epochs). Any idle pool thread
    # may take an epoch's loop, so count the threads this test started, not the ones it used.
    started = producers - alive
    assert producers and len(started) <= 2, (len(producers), len(started))
    assert worker_pool().threads <= pool_threads + 2
    assert not [t for t in threading.enumerate() if t.name.startswith("featurestore-prefetch")]


def test_a_forked_child_reads_with_its_own_pool(local_store: str) -> None:
    ds = FeatureDataset(local_store, DATASET, ENCODER, "f32")
    loader = FeatureLoader(ds, batch_size=8, shuffle=False, device="cpu", num_threads=2)
    total = sum(len(f) for f, _ in loader)  # the parent's pool threads exist now
    assert total == NUM_SAMPLES and worker_pool().threads >= 1
    pid = os.fork()
    if pid == 0:  # the child: the parent's threads are not here; its loader must start its own
        code = 1
        try:
            # numpy, not torch ops, in the forked child (an OpenMP pool does not survive a fork)
            ok = np.array_equal(np.concatenate([f.numpy() for f, _ in loader]), reference()[0])
            code = 0 if ok and worker_pool().threads >= 1 else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung reading through the prefetch pool")
    assert os.waitstatus_to_exitcode(status) == 0


_EXIT_SCRIPT = """
import sys, time
from client import FeatureDataset, FeatureLoader
ds = FeatureDataset(sys.argv[1], {dataset!r}, {encoder!r}, "f32")
loader = FeatureLoader(ds, batch_size=4, device="cpu", num_threads=2, prefetch=2)
for _ in loader:  # a whole epoch: its threads go back to the pool, idle
    pass
held = iter(FeatureLoader(ds, batch_size=4, device="cpu", num_threads=2, prefetch=2))
next(held)  # an epoch left in flight: its loops block on their read-ahead tokens
print("done", flush=True)
"""


def test_the_pool_never_keeps_the_interpreter_from_exiting(local_store: str) -> None:
    script = _EXIT_SCRIPT.format(dataset=DATASET, encoder=ENCODER)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), local_store], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "error::ResourceWarning"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "done"
    assert "Fatal Python error" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-2000:]
    assert time.monotonic() - start < 60


def test_an_idle_pool_thread_does_not_keep_the_last_epoch_alive(local_store: str) -> None:
    """A pool thread waiting for its next loop must not hold the last one: it would keep that
    epoch's prefetcher, transfer and recycled batch buffers (a batch or more of host memory,
    per idle thread) alive until the thread ran another loop."""
    ds = FeatureDataset(local_store, DATASET, ENCODER, "f32")
    total, epoch = 0, []
    with FeatureLoader(ds, batch_size=8, shuffle=False, device="cpu", num_threads=2, prefetch=2) as loader:
        for features, _ in loader:
            total += len(features)
            if not epoch:  # while the epoch runs: its prefetcher (which holds the transfer and its buffers)
                epoch = [weakref.ref(p) for p in list(prefetch._LIVE)]
    assert total == NUM_SAMPLES and epoch
    del features, loader
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the loops return once the epoch is consumed
        gc.collect()
        alive = [r() for r in epoch if r() is not None]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive, [type(o).__name__ for o in alive]


_EXIT_MID_READ = """
import atexit, sys, threading, time

def report():  # registered before client's own hook, so it runs after it (atexit is last in, first out)
    busy = [t.name for t in threading.enumerate() if t.name.startswith("featurestore-prefetch")]
    print("still reading: " + ", ".join(busy) if busy else "finished", flush=True)

atexit.register(report)
import featurestore.core.reader as reader
from client import FeatureDataset, FeatureLoader

plain = reader.FeatureArray.read_numpy
calls = []

def slow(self, *args, **kwargs):  # every batch after the first takes 2 s to read
    calls.append(1)
    if len(calls) > 1:
        time.sleep(2)
    return plain(self, *args, **kwargs)

reader.FeatureArray.read_numpy = slow
ds = FeatureDataset(sys.argv[1], {dataset!r}, {encoder!r}, "f32")
held = iter(FeatureLoader(ds, batch_size=4, device="cpu", num_threads=1, prefetch=1, order="sequential"))
next(held)
while len(calls) < 2:  # the next batch's read has begun
    time.sleep(0.01)
"""


def test_a_batch_being_read_at_exit_is_finished_before_the_interpreter_finalizes(local_store: str) -> None:
    # A loop thread still in a read (torch, numba) when the interpreter finalizes is ended inside
    # C++ frames: the process aborts after the user's script is done.
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_EXIT_MID_READ.format(dataset=DATASET,
                          encoder=ENCODER)), local_store], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["finished"], proc.stdout
