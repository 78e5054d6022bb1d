"""Temporary files left by killed writers: found (``verify`` reports them), removed by a resume.

A local put writes ``.<name>.<pid>.<hex>.tmp`` beside its target and renames it
(featurestore.core.storage.local); a writer killed between the two (SIGKILL, the OOM killer, a lost
node) leaves the temporary file. Nothing reads it (every listing skips ``*.tmp``), but it holds
disk space, up to a chunk per writer and kill. Object storage leaves none: a PUT (multipart
included) is atomic and creates no temporary object, so there is nothing to list there.

Which ones a resume may remove. Several processes write one split at once (torchrun ranks,
possibly on several hosts sharing one file system), so a temporary file may be a live writer's.
One is **stale**, and removed, only when both hold:

1. the pid in its name is not a live process on this host; and
2. it was last modified at least :data:`STALE_AFTER_S` seconds ago.

(1) alone is not enough: on a shared file system the writer may run on another host or in
another pid namespace (a container), where its pid means nothing here. (2) covers that case: a
writer streams its temporary file and renames it as soon as it is written (seconds for a chunk),
so one untouched for 10 minutes has no write in progress. A file whose pid is alive here is kept
whatever its age (a stopped local writer may go on). Should the rule still be wrong for a writer
stalled longer than that, removing its file makes its rename fail: that put raises, the chunk
counts as missing and a resume rewrites it; nothing already stored is touched.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from featurestore.core.storage import Storage
from featurestore.core.storage.process import pid_alive
from featurestore.format.names import TMP_SUFFIX, tmp_writer_pid

STALE_AFTER_S = 600.0


@dataclass(frozen=True)
class TempFile:
    key: str  # relative to the store root
    size: int
    age_s: float  # seconds since its last modification
    pid: int | None  # its writer's pid (None: not a name featurestore writes)

    @property
    def writer_alive(self) -> bool:
        return self.pid is not None and pid_alive(self.pid)

    def stale(self, after_s: float = STALE_AFTER_S) -> bool:
        """Safe to remove: no live writer on this host and untouched for ``after_s`` seconds."""
        return not self.writer_alive and self.age_s >= after_s


def find_temp_files(storage: Storage, prefix: str = "") -> list[TempFile]:
    """Every temporary file under ``prefix`` (recursively), sorted by key; [] off local disk."""
    top = storage.local_path(prefix)
    if top is None or not os.path.isdir(top):
        return []
    root = storage.local_path("")
    assert root is not None
    now = time.time()
    found = []
    for directory, _, files in os.walk(top):
        for name in files:
            if not name.endswith(TMP_SUFFIX):
                continue
            path = os.path.join(directory, name)
            try:
                info = os.stat(path)
            except FileNotFoundError:
                continue  # renamed by its (live) writer meanwhile
            key = os.path.relpath(path, root).replace(os.sep, "/")
            found.append(TempFile(key, info.st_size, max(0.0, now - info.st_mtime), tmp_writer_pid(name)))
    return sorted(found, key=lambda t: t.key)


def remove_stale_temp_files(storage: Storage, prefix: str, after_s: float = STALE_AFTER_S) -> list[TempFile]:
    """Remove the stale temporary files under ``prefix`` (see the module docstring); return them."""
    removed = []
    for temp in find_temp_files(storage, prefix):
        if not temp.stale(after_s):
            continue
        path = storage.local_path(temp.key)
        assert path is not None
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue  # another resuming rank removed it first
        removed.append(temp)
    return removed

