"""Small process facts both the writers' leftovers and the chunk cache ask about."""

from __future__ import annotations

import functools
import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (in this pid namespace)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return True


@functools.lru_cache(maxsize=1)
def pid_space() -> str | None:
    """A name of this process's pid namespace that no other machine or container shares: the
    kernel's boot id (one per machine and boot) and the namespace's inode (one per container). A
    hostname is not enough: containers on one host may share it with pid namespaces of their own,
    and so may machines ("localhost"). None where /proc does not say (not Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None
