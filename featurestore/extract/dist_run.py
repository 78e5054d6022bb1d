"""One run of a split shared by processes: the steps every extraction and import takes.

Image extraction (extract.run), slide extraction (extract.wsi_run), the dense import
(extract.dense_import) and the bag import (extract.bag_import) differ in what they read and how
they encode it, not in how a run holds a split. :func:`run_split` is that one lifecycle:

1. every process prepares (its source, encoder, store); they agree on the outcome, so one
   process's bad input stops them all with its message (featurestore.extract.dist);
2. rank 0 creates the split, resumes it or finds it complete (:func:`resume_existing`: an
   incomplete split needs ``--resume`` or ``--overwrite``); the others attach to it after they
   agree, each with a writer session of its own;
3. each process works through the units it owns (chunks, slides), chosen by a
   :class:`UnitShare` from the units still pending, and closes its writer;
4. they agree on the outcomes, rank 0 commits, they agree once more; every process returns the
   job's result, built from every process's progress.

A *job* supplies the kind-specific parts (the :class:`Job` protocol). A single process is rank 0
of 1 (``dist.Coordinator``), and every step still runs in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

from featurestore.errors import DatasetNotFound, EncoderNotFound, SplitExists, SplitNotFound
from featurestore.extract.dist import Coordinator

U = TypeVar("U")  # a unit of work: a chunk index, a slide
W = TypeVar("W")  # the job's writer
P = TypeVar("P")  # one process's progress, gathered on every process
R = TypeVar("R", covariant=True)  # the run's result


class UnitShare(Protocol):
    """Which of the pending units this process does. Every process of a run must pick a
    disjoint share, and the shares together must cover every unit the commit needs."""

    def select(self, units: Iterable[tuple[int, U]]) -> list[U]:
        """``units``: (position in the whole run, unit) of every unit still pending."""
        ...


class RankShare:
    """The unit at position ``i`` is rank ``i % world_size``'s: the same partition on every resume."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def select(self, units: Iterable[tuple[int, U]]) -> list[U]:
        return [unit for position, unit in units if self.coord.owns(position)]


class Job(Protocol[W, P, R]):
    """The parts of a run that depend on its kind, called by :func:`run_split` in this order."""

    def prepare(self) -> None:
        """Every process: read what the run needs and open the store; nothing written yet."""

    def open(self) -> W:
        """Rank 0: create, resume or overwrite the split (:func:`resume_existing`'s rules)."""

    def complete(self, writer: W) -> dict[str, Any] | None:
        """Rank 0: the split's metadata when :meth:`open` found it complete and intact, else None."""

    def attach(self) -> W:
        """Ranks but 0: a writer session of their own on the split rank 0 opened."""

    def units(self, writer: W) -> list[tuple[int, Any]]:
        """The units still pending, each with its position in the whole run."""

    def work(self, writer: W, mine: list[Any]) -> P:
        """Write ``mine``; what it did is gathered on every process."""

    def idle(self) -> P:
        """The progress of a process that failed before :meth:`work` returned."""

    def close(self, writer: W, rank: int) -> None:
        """End this process's writing (rank 0 keeps a writer able to commit)."""

    def commit(self, writer: W, progress: list[P]) -> dict[str, Any]:
        """Rank 0, once every process has closed: commit the split; its metadata."""

    def already_complete(self, metadata: dict[str, Any]) -> R:
        """The result when the split was complete before the run."""

    def result(self, progress: list[P], metadata: dict[str, Any], wall_seconds: float) -> R:
        """The result of a run that wrote and committed."""


def run_split(job: Job[Any, Any, R], coord: Coordinator | None = None, share: UnitShare | None = None) -> R:
    """Run ``job`` on this process (one of ``coord``'s ranks); ``share`` picks its units
    (default: :class:`RankShare`). Raises the first failure of any process, on every process."""
    coord = coord or Coordinator()
    share = share or RankShare(coord)
    started = time.perf_counter()
    error: BaseException | None = None
    try:
        job.prepare()
    except BaseException as e:  # every rank must reach agree(), or the others would wait forever
        error = e
    coord.agree(error)
    writer: Any = None
    done: dict[str, Any] | None = None
    error = None
    if coord.rank == 0:
        try:
            writer = job.open()
            done = job.complete(writer)
        except BaseException as e:
            error = e
    done = coord.agree(error, payload=done)[0]
    if done is not None:
        return job.already_complete(done)
    error = None
    progress = job.idle()
    try:
        if coord.rank != 0:
            writer = job.attach()
        progress = job.work(writer, share.select(job.units(writer)))
        job.close(writer, coord.rank)
    except BaseException as e:
        error = e
    gathered = coord.agree(error, payload=progress)
    error, metadata = None, {}
    if coord.rank == 0:
        try:
            metadata = job.commit(writer, gathered)
        except BaseException as e:
            error = e
    coord.agree(error)
    return job.result(gathered, metadata, time.perf_counter() - started)


class SplitJob:
    """What every job shares: the store opened after the job's own preparation, and create or
    attach by :func:`resume_existing`'s rules. A subclass implements :meth:`load` (setting
    ``encoder_name``), :meth:`create` and the rest of :class:`Job`; ``opts`` has ``store``,
    ``storage_options``, ``dataset``, ``split``, ``resume`` and ``overwrite``."""

    encoder_name: str = "?"

    def __init__(self, opts: Any) -> None:
        self.opts = opts
        self.store: Any = None

    @property
    def key(self) -> str:
        return f"{self.opts.dataset}/{self.encoder_name}/{self.opts.split}"

    def load(self) -> None:
        """Read what the run needs (source, encoder), before the store is opened."""

    def create(self, *, resume: bool, overwrite: bool) -> Any:
        """``store.create_split`` / ``create_bag_split`` with the job's settings."""
        raise NotImplementedError

    def check_kept(self, writer: Any) -> None:
        """On a resume or re-run: refuse inputs changed since what the split keeps was written."""

    def prepare(self) -> None:
        from featurestore import open_store

        self.load()
        self.store = open_store(self.opts.store, mode="a", **self.opts.storage_options)

    def open(self) -> Any:
        resume = resume_existing(self.store, self.opts.dataset, self.encoder_name, self.opts.split,
                                 resume=self.opts.resume, overwrite=self.opts.overwrite)
        writer = self.create(resume=resume, overwrite=self.opts.overwrite)
        if resume:
            self.check_kept(writer)
        return writer

    def attach(self) -> Any:
        return self.create(resume=True, overwrite=False)


def resume_existing(store: Any, dataset: str, encoder_name: str, split: str, *, resume: bool,
                    overwrite: bool) -> bool:
    """Whether the split is opened with ``resume=True``: asked for, or the split exists and is not
    being overwritten (a re-run of a complete split is then a check, not a refusal). An
    incomplete split needs ``--resume`` or ``--overwrite``. The writer (``create_split`` /
    ``create_bag_split`` with ``resume=True``) is the one place that compares cache keys and
    settings (CacheKeyMismatch for another input) and re-checks what it keeps."""
    if overwrite:
        return resume
    try:
        existing = store.split_info(dataset, encoder_name, split)
    except (DatasetNotFound, EncoderNotFound, SplitNotFound):
        return resume
    if not existing.complete and not resume:
        raise SplitExists(f"split {dataset}/{encoder_name}/{split} exists but is incomplete (status "
                          f"{existing.status!r}): pass --resume to continue it or --overwrite to start over")
    return True


__all__ = ["Job", "RankShare", "SplitJob", "UnitShare", "resume_existing", "run_split"]
