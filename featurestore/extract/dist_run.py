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

A *job* (a :class:`SplitJob`) supplies the kind-specific parts. A single process is rank 0
of 1 (``dist.Coordinator``), and every step still runs in the same order.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any, Protocol, TypeVar

from featurestore.errors import DatasetNotFound, EncoderNotFound, SplitExists, SplitNotFound
from featurestore.extract.dist import Coordinator

U = TypeVar("U")  # a unit of work: a chunk index, a slide


class UnitShare(Protocol):
    """Which of the pending units this process does. Every process of a run must pick a
    disjoint share, and the shares together must cover every unit the commit needs. A share may
    also take over steps of the run with methods of the same names as :class:`SplitJob`'s:
    ``prepare(job)`` (open the store waiting out an outage), ``open(job)``, ``work(job, writer)``
    (pick units as it goes) and ``commit(job, writer, progress)`` (the claim-based share of
    ``--worker`` does: extract.workers_share)."""

    def select(self, units: Iterable[tuple[int, U]]) -> list[U]:
        """``units``: (position in the whole run, unit) of every unit still pending."""
        ...


class RankShare:
    """The unit at position ``i`` is rank ``i % world_size``'s: the same partition on every resume."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def select(self, units: Iterable[tuple[int, U]]) -> list[U]:
        return [unit for position, unit in units if self.coord.owns(position)]


class SplitJob:
    """The parts of a run that depend on its kind, called by :func:`run_split` in the order below.
    Defaults fit a dense split (units are its chunks) written by one session per process;
    ``opts`` has ``store``, ``storage_options``, ``dataset``, ``encoder_name``, ``split``, ``resume``
    and ``overwrite``; an extraction sets ``encoder_name`` in :meth:`load` (the encoder's default)."""

    def __init__(self, opts: Any) -> None:
        self.opts = opts
        self.encoder_name: str = opts.encoder_name or "?"
        self.store: Any = None

    @property
    def key(self) -> str:
        return f"{self.opts.dataset}/{self.encoder_name}/{self.opts.split}"

    def load(self) -> None:
        """Every process: read what the run needs (source, encoder); nothing written yet."""

    def create(self, *, resume: bool, overwrite: bool) -> Any:
        """``store.create_split`` / ``create_bag_split`` with the job's settings: a writer."""
        raise NotImplementedError

    def check_kept(self, writer: Any) -> None:
        """On a resume or re-run: refuse inputs changed since what the split keeps was written."""

    def prepare(self) -> None:
        self.load()
        self.connect()

    def connect(self) -> None:
        """Open the store (``mode="a"``: its root group made if missing)."""
        from featurestore import open_store

        self.store = open_store(self.opts.store, mode="a", **self.opts.storage_options)

    def open(self) -> Any:
        """Rank 0: create, resume or overwrite the split (:func:`resume_existing`'s rules)."""
        resume = resume_existing(self.store, self.opts.dataset, self.encoder_name, self.opts.split,
                                 resume=self.opts.resume, overwrite=self.opts.overwrite)
        writer = self.create(resume=resume, overwrite=self.opts.overwrite)
        if resume:
            self.check_kept(writer)
        return writer

    def complete(self, writer: Any) -> dict[str, Any] | None:
        """Rank 0: the split's metadata when :meth:`open` found it complete and intact, else None.
        A complete split that lacks units of this run (same input, so the same cache key) was
        committed by another run while this one's units were still being added: refused, not
        reported as done."""
        if not writer.metadata.complete:
            return None
        meta = self.store.split_metadata(self.opts.dataset, self.encoder_name, self.opts.split)
        missing = [] if getattr(writer, "repair_ids", None) is not None else self.missing_from(writer, meta)
        if missing:
            raise SplitExists(
                f"split {self.key} is complete but lacks {len(missing)} of this run's inputs (first: {missing[0]!r}): "
                "another run of the same input committed it before they were added (two runs at once). Rerun "
                "with --overwrite to write them all")
        return meta

    def missing_from(self, writer: Any, meta: dict[str, Any]) -> list[str]:
        """The ids of this run's units that the complete split lacks and did not leave out on
        purpose (a dense split is complete only with every chunk: none)."""
        return []

    def attach(self) -> Any:
        """Ranks but 0: a writer session of their own on the split rank 0 opened."""
        return self.create(resume=True, overwrite=False)

    def units(self, writer: Any) -> list[tuple[int, Any]]:
        """The units still pending, each with its position in the whole run."""
        return [(chunk, chunk) for chunk in writer.pending_chunks()]

    def work(self, writer: Any, mine: list[Any]) -> Any:
        """Write ``mine``; what it did (gathered on every process)."""
        raise NotImplementedError

    def close(self, writer: Any, rank: int) -> None:
        """End this process's writing; rank 0 commits with its writer."""
        if rank != 0:
            writer.close()

    def commit(self, writer: Any, progress: list[Any]) -> dict[str, Any]:
        """Rank 0, once every process has closed: commit the split; its metadata."""
        return writer.commit()

    def result(self, progress: list[Any] | None, metadata: dict[str, Any], wall_seconds: float) -> Any:
        """The run's result from every process's progress; None: the split was complete before it."""
        raise NotImplementedError

    # What a claim-based share (extract.workers_share, ``--worker``) asks of a job of bags.
    def split_key(self) -> str:
        from featurestore.format import layout

        return layout.split_key(self.opts.dataset, self.encoder_name, self.opts.split)

    def split_exists(self) -> bool:
        try:
            self.store.split_info(self.opts.dataset, self.encoder_name, self.opts.split)
        except (DatasetNotFound, EncoderNotFound, SplitNotFound):
            return False
        return True

    def split_complete(self) -> bool:
        """Whether the split is committed: one read of its document (asked of every claim a worker takes)."""
        from featurestore.format import layout
        from featurestore.format.metadata import COMPLETE

        doc = layout.load_document(self.store.storage.read(f"{self.split_key()}/{layout.ZARR_JSON}"))
        return bool(((doc.get("attributes") or {}).get("featurestore") or {}).get("status") == COMPLETE)

    def unit_id(self, unit: Any) -> str:
        """The bag id a unit becomes (what its claim is named after)."""
        raise NotImplementedError

    def unit_record(self, part: Any) -> dict[str, Any]:
        """What a unit's done claim keeps of its progress (e.g. why a slide was skipped)."""
        return {}

    def merge(self, parts: list[Any]) -> Any:
        """One process's progress from its units' progress."""
        return sum(parts)


def run_split(job: SplitJob, coord: Coordinator | None = None, share: UnitShare | None = None) -> Any:
    """Run ``job`` on this process (one of ``coord``'s ranks); ``share`` picks its units
    (default: :class:`RankShare`). Raises the first failure of any process, on every process."""
    coord = coord or Coordinator()
    share = share or RankShare(coord)
    started = time.perf_counter()
    error: BaseException | None = None
    try:
        share.prepare(job) if hasattr(share, "prepare") else job.prepare()
    except BaseException as e:  # every rank must reach agree(), or the others would wait forever
        error = e
    coord.agree(error)
    writer: Any = None
    done: dict[str, Any] | None = None
    error = None
    if coord.rank == 0:
        try:
            writer = share.open(job) if hasattr(share, "open") else job.open()
            done = job.complete(writer)
        except BaseException as e:
            error = e
    done = coord.agree(error, payload=done)[0]
    if done is not None:
        return job.result(None, done, time.perf_counter() - started)
    error = None
    progress = None  # gathered only when every process got through
    try:
        if coord.rank != 0:
            writer = job.attach()
        if hasattr(share, "work"):
            progress = share.work(job, writer)
        else:
            progress = job.work(writer, share.select(job.units(writer)))
        job.close(writer, coord.rank)
    except BaseException as e:
        error = e
    gathered = coord.agree(error, payload=progress)
    metadata = coord.on_rank_zero(
        lambda: share.commit(job, writer, gathered) if hasattr(share, "commit") else job.commit(writer, gathered),
        default={})
    return job.result(gathered, metadata, time.perf_counter() - started)


def progress_bar(opts: Any, total: int, unit: str, desc: str, coord: Coordinator | None = None) -> Any:
    """The run's progress bar (``opts.progress``), on rank 0 only: one bar per job."""
    from tqdm import tqdm

    coord = coord or Coordinator()
    return tqdm(total=total, unit=unit, desc=f"{desc} r{coord.rank}" if coord.world_size > 1 else desc,
                # None: tqdm shows itself on a terminal only.
                disable=True if not opts.progress or coord.rank != 0 else None, file=sys.stderr,
                dynamic_ncols=True)


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


def left_out(meta: dict[str, Any]) -> set[str]:
    """The units a complete split records it left out: skipped (no tissue, not a slide) or failed
    (``--worker``: after ``--max-attempts``)."""
    return {s.get("id") for what in ("skipped", "failed") for s in meta.get(what) or [] if isinstance(s, dict)}


__all__ = ["RankShare", "SplitJob", "UnitShare", "left_out", "progress_bar", "resume_existing", "run_split"]
