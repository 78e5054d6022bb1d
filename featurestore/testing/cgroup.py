"""A memory cgroup for child processes, and page-cache eviction where none can be made: the
cold-cache primitive the tests (reads from the device) and the benches (``bench loader``, ``bench
cold``) share. cgroup v2 and v1 (``/sys/fs/cgroup/memory``) are both
handled; page cache a child reads is charged to its cgroup, so the limit bounds it too.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import time
from typing import Any

import numpy as np

from featurestore.core import pread
from featurestore.core.mapped_file import mincore_truthful


def files_under(*paths: str) -> list[str]:
    """Every file of ``paths``: a file itself, a directory's files at any depth (none if absent)."""
    return [f for p in paths for f in ([p] if os.path.isfile(p) else
                                       [os.path.join(d, n) for d, _, fs in os.walk(p) for n in fs])]


#: Right after a map of a file is dropped, the kernel may still hold some of its pages for a moment
#: (measured: a fifth of evictions right after ``del`` of an ``np.memmap`` left ~1 MiB cached on a
#: loaded 2-core VM, none after a 2 ms pause): pages still cached are dropped again after a pause.
_EVICT_RETRIES, _EVICT_PAUSE_S = 5, 0.002


def evict(*paths: str) -> None:
    """Drop the clean pages of every file under ``paths`` (files or directories) from the page
    cache, so the next reader reads them from the device. Dirty pages are written first. Pages a
    process still maps cannot be dropped: they stay (after :data:`_EVICT_RETRIES` tries)."""
    left = files_under(*paths)
    for attempt in range(_EVICT_RETRIES + 1):
        for name in left:
            fd = os.open(name, os.O_RDONLY)
            try:
                if attempt == 0:
                    os.fdatasync(fd)  # DONTNEED skips dirty pages
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        left = [name for name in left if _resident(name)]  # None (cannot tell): not retried
        if not left:
            return
        time.sleep(_EVICT_PAUSE_S)


def unmap() -> None:
    """Close this process's maps of chunk files (the reader's process-wide chunk maps): a page still
    mapped is not dropped by :func:`evict`."""
    from featurestore.core import chunk_maps

    chunk_maps.shared().clear()


def resident_bytes(*paths: str) -> int:
    """Bytes of the files under ``paths`` now in the page cache (``mincore`` over a map of each, as
    the reader asks it: core.pread): what :func:`evict` left behind, such as pages some process
    still maps, which it cannot drop. Refuses a file whose ``mincore`` answer is untruthful
    (core.mapped_file.mincore_truthful: one this process neither owns nor may write)."""
    total = 0
    for name in files_under(*paths):
        cached = _resident(name)
        if cached is None:
            raise PermissionError(f"{name}: mincore reports every page of a file this process neither owns nor "
                                  "may write as cached; ask as its owner or as root")
        total += cached
    return total


def _resident(name: str) -> int | None:
    """Bytes of the file in the page cache; None where ``mincore`` would not tell the truth."""
    with open(name, "rb") as f:
        st = os.fstat(f.fileno())
        if not st.st_size:
            return 0
        if not mincore_truthful(name, st.st_uid):
            return None
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # maps nothing in: mincore reads the cache
    try:
        view = np.frombuffer(mapped, np.uint8)
        pages = pread.resident_pages(view.ctypes.data, st.st_size)
        del view  # the map closes only with no view of it left
    finally:
        mapped.close()
    if pages is None:
        raise OSError(f"{name}: mincore could not say which pages are cached")
    return min(st.st_size, pages * mmap.PAGESIZE)


class CgroupUnavailable(RuntimeError):
    pass


class MemoryCgroup:
    """A memory cgroup with a hard limit for child processes, made from what this host allows.

    Tried in order: a child of this process's own cgroup (v2: ``memory.max``; v1:
    ``memory.limit_in_bytes``), then ``systemd-run --scope -p MemoryMax=`` (v2 with systemd).
    Swap is capped at zero where the knob exists, so "over the limit" means killed, not swapped.
    Raises :class:`CgroupUnavailable` with the reason when none works.
    """

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.path: str | None = None
        self.version = 0
        self.prefix: list[str] = []

    def __enter__(self) -> MemoryCgroup:
        reasons = []
        for own, version in _own_memory_cgroups():
            path = os.path.join(own, f"featurestore-bench-{os.getpid()}")
            if version == 2:  # children get a memory.max only if the parent delegates "memory"
                _write(os.path.join(own, "cgroup.subtree_control"), "+memory", optional=True)
            try:
                os.mkdir(path)
            except OSError as error:
                reasons.append(f"cannot create {path} ({error.strerror})")
                continue
            try:
                if version == 2:
                    _write(os.path.join(path, "memory.max"), str(self.limit))
                    _write(os.path.join(path, "memory.swap.max"), "0", optional=True)
                else:
                    _write(os.path.join(path, "memory.limit_in_bytes"), str(self.limit))
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(self.limit), optional=True)
            except OSError as error:
                os.rmdir(path)
                reasons.append(f"cannot set the limit in {path} ({error.strerror})")
                continue
            self.path, self.version = path, version
            return self
        if shutil.which("systemd-run") and os.path.isdir("/run/systemd/system"):
            self.prefix = ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={self.limit}", "-p", "MemorySwapMax=0"]
            return self
        raise CgroupUnavailable("; ".join(reasons) or "no memory cgroup controller is mounted under /sys/fs/cgroup")

    def run(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        procs = os.path.join(self.path, "cgroup.procs") if self.path else None

        def enter() -> None:  # in the child, before exec: everything it allocates is charged
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        return subprocess.run(self.prefix + command, capture_output=True, text=True, check=False,
                              preexec_fn=enter if procs else None)

    def oom_kills(self) -> int | None:
        if not self.path:
            return None
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            with open(os.path.join(self.path, name)) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def __exit__(self, *exc: Any) -> None:
        if self.path:
            for _ in range(50):  # the last child may still be exiting
                try:
                    os.rmdir(self.path)
                    return
                except OSError:
                    time.sleep(0.1)


def _own_memory_cgroups() -> list[tuple[str, int]]:
    """Directories of this process's memory cgroup: [(path, version)] (v2 first if mounted)."""
    found = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            found.append((os.path.join("/sys/fs/cgroup", path.lstrip("/")), 2))
        elif "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory"
            own = os.path.join(base, path.lstrip("/"))
            found.append((own if os.path.isdir(own) else base, 1))
    return found


def _write(path: str, value: str, optional: bool = False) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError:
        if not optional:
            raise
