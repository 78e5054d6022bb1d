"""Whether a server a process started outlives that process when it is killed outright (SIGKILL:
no ``finally`` of it runs), for the launchers of ``featurestore.testing``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from featurestore.testing import running


def outlives_sigkilled_parent(script: str, *args: str, wait: float = 30.0) -> tuple[int, bool]:
    """Run Python ``script`` (it starts a server and prints the server's pid first on its first
    line, then sleeps) with ``args``, SIGKILL it, and give the server ``wait`` seconds to go:
    ``(server pid, whether it still runs)``. The server is killed here either way. Raises with the
    script's stderr when it printed no pid."""
    parent = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    server = 0
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        if not line.strip():
            _, err = parent.communicate(timeout=60)
            raise RuntimeError(f"the process starting the server failed (exit status {parent.returncode}): {err}")
        server = int(line.split()[0])
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and running(server):
            time.sleep(0.1)
        return server, running(server)
    finally:
        parent.kill()
        parent.wait(30)
        if server and running(server):  # not left behind for the rest of the session
            os.kill(server, signal.SIGKILL)
