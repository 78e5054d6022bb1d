"""What a kind of split supplies to the one lifecycle (featurestore.core.lifecycle).

A kind (dense splits, bag splits; embedding splits derived from bags would be a third) differs
from the others only in its metadata (built by its own ``new_metadata``), the settings a resume
must share, its arrays, its resumable units (a dense split's done chunks, a bag split's complete
bags) and its writer, and its checks (``verify``). Everything else, from refusing an existing
split to marking one ``writing`` before it is rewritten, is the lifecycle's, written once.
Kinds are registered by their metadata ``kind`` name in featurestore.core.kinds.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from featurestore.core.storage import Storage
from featurestore.errors import InvalidOption
from featurestore.format.metadata import SplitMetadata

W = TypeVar("W", covariant=True)


class Findings(Protocol):
    """Where a check puts what it found (``verify``'s ``SplitCheck``, a repair's own record)."""

    problems: list[str]
    chunks_checked: int


class SplitKind(Generic[W]):
    """One kind of split; ``W`` is the type of its writer."""

    name: str = ""

    def check_resumable(self, meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
        """Refuse to continue ``meta`` with a run that asks for ``wanted`` (same kind and cache
        key are checked by the lifecycle already)."""
        raise NotImplementedError

    def create(self, storage: Storage, key: str, meta: SplitMetadata, **options: Any) -> W:
        """The kind's arrays of a new split whose document is written, and its writer."""
        raise NotImplementedError

    def resume(self, storage: Storage, key: str, meta: SplitMetadata, *, verify_chunks: bool,
               **options: Any) -> W:
        """The writer of an existing split: its done units found (and a complete split's damaged
        ones, to be written again: sizes checked, every chunk read with ``verify_chunks``)."""
        raise NotImplementedError

    def verify(self, storage: Storage, key: str, meta: SplitMetadata, found: Findings) -> None:
        """``featurestore verify`` on a complete split of this kind: every problem into ``found``."""
        raise NotImplementedError


def check_chunk_bytes(chunk_bytes: Any, default: int = 8 << 20) -> int:
    """The one ``chunk_bytes`` check of every kind (None: ``default``)."""
    chunk_bytes = default if chunk_bytes is None else chunk_bytes
    if not isinstance(chunk_bytes, (int, np.integer)) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
        raise InvalidOption(f"chunk_bytes must be a positive int (e.g. 8 << 20), got {chunk_bytes!r}")
    return int(chunk_bytes)
