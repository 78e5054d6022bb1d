"""Process coordination for extraction: one process, or the ranks of a ``torchrun`` job.

Under ``torchrun --nproc-per-node K featurestore extract ...`` every rank runs the same command.
Rank 0 creates (or resumes) the split, the others attach to it with ``resume=True``; rank ``r``
encodes and writes the chunks ``i`` with ``i % K == r``; after every rank has closed its writer,
rank 0 commits (those steps are featurestore.extract.dist_run's; this module is how the ranks
agree). The split's quantization report and channel statistics are folded from per-chunk
rows on storage (``featurestore.format.stats``), so they come out the same as a one-process run's.

Each step ends with :meth:`Coordinator.agree`, an all-gather of every rank's outcome: a rank that
fails makes all ranks stop at the next step with its message, instead of the others waiting at a
barrier until the collective timeout. The process group uses gloo even on GPUs: only a few small
Python objects cross it, and gloo needs no device placement.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
from collections.abc import Callable, Iterator
from typing import Any

from featurestore.errors import FeatureStoreError


class RankFailed(FeatureStoreError, RuntimeError):
    """Another rank of the torchrun job failed; its message is carried here."""


class Coordinator:
    """A single process: rank 0 of 1, every collective is trivial."""

    rank = 0
    world_size = 1
    local_rank = 0

    def agree(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        if error is not None:
            raise error
        return [payload]

    def owns(self, chunk: int) -> bool:
        return chunk % self.world_size == self.rank

    def on_rank_zero(self, step: Callable[[], Any], default: Any = None) -> Any:
        """``step()`` on rank 0 only (the commit), then :meth:`agree` on its outcome, so that a
        failure there stops every rank. Its result on rank 0, ``default`` on the others."""
        error, result = None, default
        if self.rank == 0:
            try:
                result = step()
            except BaseException as e:
                error = e
        self.agree(error)
        return result

    def shutdown(self) -> None:
        pass


class TorchrunCoordinator(Coordinator):
    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._dist = dist
        self._own_group = not dist.is_initialized()
        if self._own_group:
            dist.init_process_group("gloo", timeout=_dt.timedelta(minutes=30))

    def agree(self, error: BaseException | None, payload: Any = None) -> list[Any]:
        """All-gather ``(error message, payload)``; raise if any rank failed, else the payloads."""
        message = None if error is None else (str(error) or type(error).__name__)
        gathered: list[Any] = [None] * self.world_size
        try:
            self._dist.all_gather_object(gathered, (message, payload))
        except RuntimeError as lost:  # gloo: a peer's connection closed (its process died, SIGKILL)
            if error is not None:
                raise error from None
            raise RankFailed(f"rank {self.rank} of {self.world_size} lost touch with the other ranks "
                             f"({str(lost).splitlines()[0][:200]}): another rank stopped, its own log says why; "
                             "the work done is kept: rerun with --resume") from None
        if error is not None:
            raise error
        for rank, (other, _) in enumerate(gathered):
            if other is not None:
                raise RankFailed(f"rank {rank} of {self.world_size} failed: {other}")
        return [p for _, p in gathered]

    def shutdown(self) -> None:
        if self._own_group and self._dist.is_initialized():
            self._dist.destroy_process_group()


def coordinator_from_env() -> Coordinator:
    """A :class:`TorchrunCoordinator` when started by torchrun with more than one rank."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return TorchrunCoordinator()
    return Coordinator()


@contextlib.contextmanager
def coordinated(coord: Coordinator | None) -> Iterator[Coordinator]:
    """``coord`` as given, or this process's own from the environment, shut down when the block
    ends however it ends: a torchrun rank that exits with its gloo process group alive can abort
    at exit ("terminate called without an active exception") after a run that succeeded."""
    if coord is not None:
        yield coord
        return
    own = coordinator_from_env()
    try:
        yield own
    finally:
        own.shutdown()
