"""A stop by signal that Python swallowed is raised again (featurestore.core.swallowed_stops).

A SIGTERM handled while a weakref callback runs raises its stop inside the callback, where Python
only prints it ("Exception ignored"). A ``--worker`` then went on encoding until the scheduler's
SIGKILL left its slide to the lease, and ``bench all`` ran on to its end (seen once in a loaded
test run). Both now raise the swallowed stop again, once, out of the callback."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = """
import os, signal, sys, time, weakref
from featurestore.errors import Stopped
from {module} import {stopper}
class Held: pass
def callback(_):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in here, its Stopped swallowed with the callback's
with {stopper}():
    held = Held()
    ref = weakref.ref(held, callback)
    try:
        del held
        time.sleep(20)
        print("ran on")
    except Stopped as stopped:
        print("stopped by", stopped.name)
print("after", sys.unraisablehook is sys.__unraisablehook__, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
"""


@pytest.mark.parametrize("module, stopper", [("featurestore.extract.worker_stop", "StopOnSignal"),
                                             ("featurestore.bench.report", "stop_on_sigterm")])
def test_a_stop_swallowed_in_a_weakref_callback_is_raised_again(module: str, stopper: str) -> None:
    child = CHILD.format(module=module, stopper=stopper)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    # stopped, then the hook and the handler as they were before
    assert done.stdout.split("\n")[:2] == ["stopped by SIGTERM", "after True True"], done.stdout + done.stderr
    assert "Exception ignored" in done.stderr  # the swallow happened, and Python still says so
