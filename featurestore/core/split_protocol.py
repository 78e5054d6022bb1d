"""The writing protocol's checks against storage, apart from the chunk assembly (core.writer).

What makes writers of one split safe with each other (docs/FORMAT.md, "Generation" and "Writing
protocol"): a writer re-reads the split's generation before each chunk and before its commit,
and stops with :class:`SplitTakenOver` once another run took the split over; a commit first
finds every chunk present on storage, then reads every statistics row, refuses any sealed by
another run or for another chunk, and folds them into the quantization report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from featurestore.core.present import present_chunks
from featurestore.core.storage import Storage
from featurestore.errors import SplitTakenOver
from featurestore.format import layout
from featurestore.format.metadata import COMPLETE, SplitMetadata, chunk_arrays, unseal
from featurestore.format.stats import SOURCE_NAMES, merge_rows, report

__all__ = ["SplitSession", "absent_chunks", "check_generation", "committed_elsewhere", "explain_put_failure", "sealed_report",
           "stored_metadata"]


def check_generation(storage: Storage, key: str, meta: SplitMetadata) -> str | None:
    """Refuse to go on when the split on storage is no longer ``meta``'s generation; the status
    stored with it (``writing``, or ``complete`` once a session committed it)."""
    try:
        doc = layout.load_document(storage.read(f"{key}/{layout.ZARR_JSON}"))
        stored = ((doc.get("attributes") or {}).get("featurestore") or {})
        current, status = stored.get("generation"), stored.get("status")
    except (FileNotFoundError, ValueError, AttributeError):
        current, status = None, None  # deleted or being rewritten: not ours any more either
    if meta.generation is None:
        return status if isinstance(status, str) else None  # a split written before generations existed
    if current != meta.generation:
        raise SplitTakenOver(
            f"split {key} was taken over by another writer (generation on storage "
            f"{current!r}, this writer's {meta.generation!r}: an --overwrite, or a second "
            "create of this new split, started after this run): this run stopped without writing "
            "further. Let the other run finish; a rerun with --resume then adds what it lacks "
            "(--overwrite would replace the other run's work)")
    return status if isinstance(status, str) else None


def stored_metadata(storage: Storage, key: str) -> SplitMetadata:
    """The split's metadata as its document on storage holds it now."""
    doc = layout.load_document(storage.read(f"{key}/{layout.ZARR_JSON}"))
    return SplitMetadata.from_json((doc.get("attributes") or {}).get("featurestore"), key)


def committed_elsewhere(storage: Storage, key: str, meta: SplitMetadata) -> bool:
    """Whether another session of ``meta``'s generation has marked the split complete since
    ``meta`` (still ``writing``) was read: a complete split takes no more chunks, and a second
    commit would lay it out again from what is left (raises SplitTakenOver as check_generation)."""
    return not meta.complete and check_generation(storage, key, meta) == COMPLETE


_Session = TypeVar("_Session", bound="SplitSession")


class SplitSession:
    """What the dense and the bag writer share: the split's metadata and generation, ``with``
    (closing on exit), and the generation check that stops a writer whose split an --overwrite
    has since taken over. A subclass sets ``_storage``, ``_key``, ``_meta``, ``_closed`` and
    defines ``close``."""

    _storage: Storage
    _key: str
    _meta: SplitMetadata
    _closed: bool

    @property
    def metadata(self) -> SplitMetadata:
        return self._meta

    @property
    def generation(self) -> str | None:
        """The split generation this writer writes (see docs/FORMAT.md, "Generation")."""
        return self._meta.generation

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Session) -> _Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_generation(self) -> None:
        """Refuse to go on when the split on storage is no longer this writer's generation, or
        when another session has committed it meanwhile (:meth:`_committed_elsewhere` says what
        this session had not stored)."""
        try:
            committed = committed_elsewhere(self._storage, self._key, self._meta)
        except SplitTakenOver:
            self._closed = True
            raise
        if committed:
            self._closed = True
            raise self._committed_elsewhere()

    def _committed_elsewhere(self) -> Exception:
        raise NotImplementedError


def explain_put_failure(check: Callable[[], None], generation_check: Callable[[], None]) -> None:
    """Run ``check`` (which raises the first failed put). A put can fail because another writer
    took the split over (its --overwrite deleted the directory under the put): then the takeover
    is the error to report, with the put's failure as its cause."""
    try:
        check()
    except SplitTakenOver:
        raise
    except Exception as error:
        try:
            generation_check()
        except SplitTakenOver as taken:
            raise taken from error
        raise


def absent_chunks(storage: Storage, key: str, meta: SplitMetadata, others: list[int]) -> list[int]:
    """Which of the chunks ``others`` (not put by this writer) are not done on storage: not all
    of their arrays present (core.present: locally, each file at its full size)."""
    if not others:
        return []
    present = present_chunks(storage, key, chunk_arrays(meta), among=others)
    return sorted(i for i in others if i not in present)


def sealed_report(storage: Storage, key: str, meta: SplitMetadata, indices: Iterable[int], *,
                  channels: int, written_dtype: str | None) -> dict[str, Any]:
    """The quantization report and channel statistics folded from the statistics rows of chunks
    ``indices``, each checked to carry ``meta``'s generation and its own index."""
    indices = list(indices)
    keys = [layout.chunk_key(f"{key}/{layout.CHUNK_STATS}", i, 2) for i in indices]
    rows = []
    for index, raw in zip(indices, storage.read_many(keys)):
        row, generation, at = unseal(np.frombuffer(raw[: -layout.CRC_BYTES], np.float64), meta)
        if generation != meta.generation_number or at != index:
            raise SplitTakenOver(
                f"cannot commit {key}: chunk {index} was written by another run of this "
                f"split (its statistics row has generation {int(generation or 0):x}, chunk {at}; "
                f"this writer's is {meta.generation}, chunk {index}). Resume the split "
                "(extract --resume) to rewrite such chunks, or --overwrite it")
        rows.append(row)
    total = merge_rows(rows, channels)
    # The chunks' own record comes before the metadata: a writer that wrote nothing itself
    # (it only commits) must not report the logical dtype as the source.
    source = written_dtype or SOURCE_NAMES.get(total.source_code) or meta.source_dtype or meta.logical_dtype
    out = report(total, source_dtype=source, logical_dtype=meta.logical_dtype)
    out["source_dtype"] = source
    return out
