"""Launching the CLI under torchrun in tests: two ranks, killed as a group if the run hangs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def torchrun_cli(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`featurestore.cli *args` on two standalone ranks."""
    return torchrun("--module", "featurestore.cli", *args, env=env, timeout=timeout)


def torchrun(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node 2 *args`` (a script, or ``--module M``); its own
    session so a timeout kills every rank."""
    process = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
