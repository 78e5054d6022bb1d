"""Refuse to resume or re-run a split whose input files changed after the split was created.

A split's cache key fingerprints its input cheaply: shapes, sizes and sampled bytes (18 row blocks
or files). That tells another cache from this one, but not an input rewritten in place with the
sampled rows kept: a resume then kept the chunks made from the old content, wrote the rest from
the new one, and called the mix complete. So before a resume or re-run keeps any chunk, every
input file that fed a kept chunk is checked here: modified after the split was created means its
rows on storage may be stale, and the run stops with :class:`~featurestore.errors.InputChanged`
naming the file and the fix (``--overwrite``). Files that fed only chunks still to be written may
change freely (fixing an unreadable sample and resuming is fine).

One ``stat`` per file, no read: the content of an unchanged file is trusted to its size and
mtime, as ``make`` and rsync do. A file replaced by an older one (``mv``, ``cp -p``) keeps an old
mtime: the sampled-content fingerprint in the cache key is what catches that. ``python:``
sources have no files to check; their factory's own fingerprint is all there is.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from featurestore.errors import InputChanged

# The split's `created` time has whole seconds: a file must be modified at least this long after
# it to count as changed (an input written in the same second as the split is not flagged).
_RESOLUTION_S = 1.0


def refuse_changed_inputs(files_of: Callable[[int, int], Iterable[str]], kept: Iterable[tuple[int, int]],
                          created: str | None, key: str) -> None:
    """Raise InputChanged when a file feeding a kept row range was modified after ``created``.

    ``files_of(start, stop)``: the input files of rows ``[start, stop)`` (a source's
    ``input_files``); ``kept``: the row ranges of the chunks the run keeps.
    """
    if not created:
        return  # a split without a creation time: nothing to compare with
    since = _dt.datetime.fromisoformat(created).timestamp() + _RESOLUTION_S
    seen: set[str] = set()
    for start, stop in kept:
        for path in files_of(start, stop):
            if path in seen:
                continue
            seen.add(path)
            try:
                modified = os.stat(path).st_mtime
            except FileNotFoundError:
                raise InputChanged(f"input file {path} is gone since split {key} was created ({created}); "
                                   "restore it, or rerun with --overwrite to redo the split from the new "
                                   "input") from None
            if modified >= since:
                when = _dt.datetime.fromtimestamp(modified, _dt.timezone.utc).isoformat(timespec="seconds")
                raise InputChanged(
                    f"input file {path} was modified at {when}, after split {key} was created ({created}): "
                    "rows already stored came from its old content, so the split cannot be resumed or "
                    "re-checked from it; rerun with --overwrite to redo the split from the new input")


def refuse_changed_files(paths: Sequence[str], ids: Sequence[str], writer: Any, key: str) -> None:
    """:func:`refuse_changed_inputs` for a run of one file per unit (a slide, a per-slide file):
    the files of the units whose bags a resumed ``writer`` keeps (``ids[i]`` is ``paths[i]``'s)."""
    kept = [(i, i + 1) for i, unit in enumerate(ids) if unit in writer.done_ids]
    refuse_changed_inputs(lambda a, b: paths[a:b], kept, writer.metadata.created, key)


def refuse_changed_inputs_of(writer: Any, files_of: Callable[[int, int], Iterable[str]], key: str) -> None:
    """:func:`refuse_changed_inputs` for the chunks a resumed ``writer`` keeps (those it will not
    write again), against the split's creation time."""
    pending = set(writer.pending_chunks())
    kept = [writer.chunk_range(c) for c in range(writer.num_chunks) if c not in pending]
    refuse_changed_inputs(files_of, kept, writer.metadata.created, key)
