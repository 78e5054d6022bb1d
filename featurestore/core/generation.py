"""Whether a split is still the generation a reader opened: the one check every read path shares.

An overwrite (and a resume that repairs a complete split) rewrites the split's group document
(``zarr.json``: status "writing", then a new generation) *before* it deletes or writes any chunk,
and chunk files are never modified in place (atomic temp + rename puts). So a chunk file opened
(a descriptor, a map) or a ranged GET answered *before* a re-read of that document that still
shows the opened generation (complete, for a reader of a complete split) is the opened
generation's. Every read path asks :meth:`GenerationCheck.after` with the time its files were
opened or its ranges answered (docs/READS.md, "Generations"):

* local mmap/pread: once per read call that opened new maps or descriptors, after opening them;
  the document is replaced by rename, so an ``os.stat`` of it (device, inode, mtime, size) equal
  to the one last parsed is the whole check (a few microseconds);
* ranged object-storage reads: one document GET per read call, after its ranges were answered
  (concurrent calls share one in flight);
* the chunk cache: a fetched chunk before it is kept (one check shared by a wave of fetches).

A read that finds the split changed raises :class:`SplitChanged` naming the split: already-open
maps of the opened generation keep serving it, consistently, but nothing of another generation is
ever returned. One check object per (store, split, generation) in a process, shared by the split's
arrays (features and labels, or features and coords), so one document read covers them all.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from featurestore.errors import FeatureStoreError, SplitChanged
from featurestore.format import layout
from featurestore.format.metadata import COMPLETE


class GenerationCheck:
    """Whether the split ``split_key`` of ``storage`` is still generation ``generation`` (and
    complete, when ``complete``), asked of its group document."""

    def __init__(self, storage: Any, split_key: str, generation: str | None, complete: bool) -> None:
        self._storage, self._split_key = storage, split_key
        self.generation, self.complete = generation, complete
        self._doc_key = f"{split_key}/{layout.ZARR_JSON}"
        self._local = storage.local_path(self._doc_key)
        self._stat: tuple[int, ...] | None = None  # the local document last found right
        self._lock = threading.Lock()
        self._passed = float("-inf")  # monotonic time the last passed check was requested at
        self._pending: tuple[float, Future[None]] | None = None
        self._pid = os.getpid()

    def after(self, since: float) -> None:
        """Return once a check requested at or after ``since`` (monotonic) found the split
        unchanged; :class:`SplitChanged` if it changed. Checks in flight are shared; inside
        :meth:`deferred` (this thread) the check waits for the end of the block."""
        if self._passed >= since:  # the warm path: one comparison
            return
        deferred = getattr(_DEFERRED, "pending", None)
        if deferred is not None and self in deferred:
            deferred[self] = max(deferred[self], since)
            return
        self._after(since)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """The reads of this block (this thread) share one check at its end: a bag's features
        and coords, read by ranges, cost one document GET, not two."""
        pending = _DEFERRED.__dict__.setdefault("pending", {})
        if self in pending:  # nested: the outer block checks
            yield
            return
        pending[self] = float("-inf")
        try:
            yield
            since = pending.pop(self)
        except BaseException:
            pending.pop(self, None)
            raise
        self.after(since)

    def _after(self, since: float) -> None:
        if self._local is not None:  # a stat, mostly: cheaper than sharing it between threads
            self._check(time.monotonic())
            return
        if self._pid != os.getpid():  # forked: a lock a parent's thread held did not come along
            self._lock, self._pending, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._passed >= since:
                return
            pending = self._pending
            mine = pending is None or pending[0] < since or pending[1].done()
            if mine:
                requested = time.monotonic()
                pending = self._pending = (requested, Future())
        assert pending is not None
        if not mine:
            pending[1].result()
            return
        try:
            self._check(pending[0])
        except BaseException as error:
            pending[1].set_exception(error)
            raise
        finally:
            with self._lock:
                if self._pending is pending:
                    self._pending = None
        pending[1].set_result(None)

    def now(self) -> None:
        """A fresh check (:class:`SplitChanged` if the split changed)."""
        self.after(time.monotonic())

    def changed(self) -> SplitChanged | None:
        """The :class:`SplitChanged` a fresh check raises, or None: a read that found chunks
        missing or damaged asks it first, so an overwrite is never reported as a damaged store."""
        try:
            self._after(time.monotonic())
        except SplitChanged as error:
            return error
        except (OSError, FeatureStoreError):  # the document unreadable now: the read's own error stands
            return None
        return None

    # ------------------------------------------------------------------ the document
    def _check(self, requested: float) -> None:
        if self._local is not None:
            now = self._read_local()
            if now is _SAME:
                self._passed = max(self._passed, requested)  # (a race may keep an older time: rechecked)
                return
        else:
            try:
                now = _attributes(self._storage.read(self._doc_key))
            except FileNotFoundError:
                now = None
        self._compare(now)
        with self._lock:
            self._passed = max(self._passed, requested)

    def _read_local(self) -> dict[str, Any] | None:
        path = self._local
        assert path is not None
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        if _key(st) == self._stat:
            return _SAME
        try:  # the bytes parsed are those of the file stat-ed (fstat on the same descriptor)
            with open(path, "rb") as f:
                key, raw = _key(os.fstat(f.fileno())), f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        now = _attributes(raw)
        if self._matches(now):
            self._stat = key
        return now

    def _matches(self, now: dict[str, Any] | None) -> bool:
        return (now is not None and now.get("generation") == self.generation
                and (not self.complete or now.get("status") == COMPLETE))

    def _compare(self, now: dict[str, Any] | None) -> None:
        if self._matches(now):
            return
        where = f"split {self._split_key} at {self._storage.url}"
        if now is None:
            raise SplitChanged(f"{where} is gone (deleted or being overwritten) since this reader opened it: "
                               "open it again")
        if now.get("generation") != self.generation:
            raise SplitChanged(f"{where} is now another generation of the split ({now.get('generation')!r}, "
                               f"opened as {self.generation!r}): it was overwritten since this reader opened it; "
                               "open it again")
        raise SplitChanged(f"{where} is being rewritten (status {now.get('status')!r}) since this reader opened it: "
                           "open it again when it is complete")


_SAME: dict[str, Any] = {}  # the local document is the one last found right


def _key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


def _attributes(raw: bytes) -> dict[str, Any]:
    try:
        doc = layout.load_document(raw)
        return dict((doc.get("attributes") or {}).get("featurestore") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


_CHECKS: weakref.WeakValueDictionary[tuple[Any, ...], GenerationCheck] = weakref.WeakValueDictionary()
_CHECKS_LOCK = threading.Lock()


class _Unchecked(GenerationCheck):
    """An array with no generation to compare (a split written before generations existed, a
    bag writer's segment): nothing to check."""

    def __init__(self) -> None:
        pass

    def after(self, since: float) -> None:
        return None

    def _after(self, since: float) -> None:
        return None


_UNCHECKED = _Unchecked()
_DEFERRED = threading.local()


def for_split(storage: Any, split_key: str, metadata: dict[str, Any]) -> GenerationCheck:
    """The process's one check of ``split_key`` as opened with ``metadata`` (its generation; a
    reader of a complete split also requires it still complete, one opened incomplete with
    ``allow_incomplete=True`` only the same generation)."""
    generation, complete = metadata.get("generation"), metadata.get("status") == COMPLETE
    if generation is None:
        return _UNCHECKED
    key = (id(storage), split_key, generation, complete)  # the check reads through this storage
    with _CHECKS_LOCK:
        check = _CHECKS.get(key)
        if check is None:
            check = _CHECKS[key] = GenerationCheck(storage, split_key, generation, complete)
    return check


def _after_fork_in_child() -> None:
    global _CHECKS_LOCK
    _CHECKS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
