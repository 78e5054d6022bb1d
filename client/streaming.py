"""What every streaming loader shares: epochs, the read-ahead threads' lifetime, resumable state.

:class:`StreamingLoader` is the base of :class:`client.loader.FeatureLoader` (rows of a dense
split) and :class:`client.bag_loader.BagLoader` (bags of a bag split). A subclass says which
batches an epoch has (:meth:`StreamingLoader._epoch_batches`), how one batch reaches the device (a
*producer* with ``produce(batch, staging)`` on a prefetch thread and ``finish(item)`` on the
consumer's, see :class:`client.prefetch.Prefetcher`), and which of its arguments a saved state
must match (:meth:`StreamingLoader._identity`). The base runs the epoch: at most ``prefetch``
batches read ahead, delivered in order, threads joined when the loop ends or breaks, and
``state_dict`` / ``load_state_dict`` counting the batches the consumer received.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from client import dequantize
from client.prefetch import Prefetcher
from client.readahead import ReadAhead, cached_fronts
from featurestore.errors import InvalidOption


def channel_normalization(ds: Any, normalize: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """``normalize=`` of both loaders: the split's stored ``(mean, std)`` per channel when asked
    (:class:`InvalidOption` naming the split when it has none), else None."""
    if not normalize:
        return None
    mean_std = ds.channel_stats()
    if mean_std is None:
        raise InvalidOption(f"normalize=True needs the split's channel_stats, and {ds.dataset}/{ds.encoder}/"
                            f"{ds.split} has none: pass normalize=False")
    return mean_std


class StreamingLoader:
    """The epoch machinery of a loader; subclasses set ``ds``, ``device``, ``dtype``, ``prefetch``
    and ``num_threads`` and call :meth:`_init_epochs` from their ``__init__``."""

    ds: Any
    device: torch.device
    dtype: torch.dtype
    prefetch: int
    num_threads: int

    def _init_epochs(self) -> None:
        self.epoch = 0
        self._resume_batch = 0  # batches of `epoch` already consumed (load_state_dict)
        self._consumed = 0
        self._active: Prefetcher | None = None
        self._producer: Any = None
        self._readahead: ReadAhead | None = None
        self.stats: dict[str, float] = {"batches": 0, "stall_s": 0.0}

    # ------------------------------------------------------------------ what subclasses provide
    def _epoch_batches(self, skip: int) -> Iterator[Any]:
        """The current epoch's batches after the first ``skip`` (which are not read)."""
        raise NotImplementedError

    def _make_producer(self) -> Any:
        """The object that turns one batch into device tensors (made once, reused across epochs)."""
        raise NotImplementedError

    def _identity(self) -> dict[str, Any]:
        """The arguments a saved state must match to be resumed by this loader."""
        raise NotImplementedError

    def _resumes(self, key: str, saved: Any) -> bool:
        """Whether a saved ``key`` that differs from this loader's still matches it (a state saved
        in an older form); none by default."""
        return False

    def _before_epoch(self, skip: int) -> None:
        """As an epoch starts, from batch ``skip`` on: an int8 split dequantized on the CPU starts
        the kernel's load now when the epoch is long enough to pay for it
        (:func:`client.dequantize.warm_up_for`)."""
        if self.ds.quantized and self.device.type == "cpu" and self.dtype in dequantize.NUMPY_OUT:
            values = self._epoch_values(skip)
            if values is not None:
                dequantize.warm_up_for(values)

    def _epoch_values(self, skip: int) -> int | None:
        """About how many values this rank's epoch reads from batch ``skip`` on (None: unknown)."""
        raise NotImplementedError

    def _start_stats(self) -> dict[str, float]:
        return {"batches": 0, "stall_s": 0.0}

    def _read_ahead(self, ds: Any, batch_chunks: Any, skip: int) -> None:
        """If ``ds`` reads through a chunk cache, start fetching the epoch's chunks ahead and keep
        what it still needs (``batch_chunks()``: the chunks of each batch from ``skip`` on, made
        only then); stopped by :meth:`_epoch_ended`."""
        fronts = cached_fronts(ds)
        if fronts:
            self._readahead = ReadAhead(fronts, batch_chunks(), skip, lambda: self._consumed)

    def _epoch_ended(self) -> None:
        """Release what the epoch in flight held besides its prefetch threads (a chunk cache's
        read-ahead); called when the epoch ends, breaks or is stopped."""
        if self._readahead is not None:
            self._readahead.close()
            self._readahead = None

    # ------------------------------------------------------------------ epochs
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields (call before each epoch)."""
        if not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool) or epoch < 0:
            raise InvalidOption(f"`epoch` must be a non-negative integer, but got: {epoch!r}")
        if int(epoch) != self.epoch:
            # Another epoch: the one in flight (a loop left with `break`, or still running) ends,
            # and neither a resume offset nor its count of batches belongs to the new one (a
            # state saved now would skip batches the new epoch never gave).
            self._stop_epoch()
            self._resume_batch = self._consumed = 0
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[Any]:
        self._stop_epoch()  # one epoch in flight per loader
        skip, self._resume_batch = self._resume_batch, 0
        batches = self._epoch_batches(skip)
        self._before_epoch(skip)
        if self._producer is None:  # the CUDA stream and pinned slots are reused across epochs
            self._producer = self._make_producer()
        self._consumed = skip
        self.stats = self._start_stats()
        return self._run(batches)

    def _run(self, batches: Iterator[Any]) -> Iterator[Any]:
        # A generator, so `break` out of the consumer's loop finalises it at once (CPython frees
        # it when the loop drops it) and the `finally` joins the threads: nothing leaks. The
        # threads start at the first next(): an iterator made and dropped unstarted (an error
        # between iter() and next()) never runs a `finally`, so it must hold none.
        prefetcher = Prefetcher(batches, self._producer, self.prefetch, self.num_threads)
        self._active = prefetcher
        try:
            for batch in prefetcher:
                self._consumed += 1
                self.stats["batches"] += 1
                self.stats["stall_s"] = prefetcher.stall_s
                yield batch
            self._consumed = 0  # the epoch is complete: a state saved now restarts it whole
        finally:
            prefetcher.close()
            if self._active is prefetcher:
                self._active = None
                self._epoch_ended()

    def _stop_epoch(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None
        self._epoch_ended()

    def close(self) -> None:
        """Stop the prefetch threads of the epoch in flight, if any, and the read threads (a
        later iteration starts them again). Iteration stops its own prefetch threads."""
        self._stop_epoch()
        if self._producer is not None:
            self._producer.shutdown()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Where the consumer is: the epoch and how many of its batches it has received."""
        return {"epoch": self.epoch, "batch": self._consumed, **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration yields exactly the batches the saved run had not received."""
        if not isinstance(state, dict):
            raise TypeError(f"load_state_dict takes the dict that state_dict() returned, but got: {type(state).__name__}")
        missing = [key for key in ("epoch", "batch") if key not in state]
        if missing:
            raise InvalidOption(f"cannot resume: the state lacks {', '.join(map(repr, missing))} (it has "
                                f"{sorted(state)}); pass the whole dict that loader.state_dict() returned")
        for key in ("epoch", "batch"):
            value = state[key]
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise InvalidOption(f"cannot resume: state[{key!r}] must be a non-negative integer, but got: {value!r}")
        for key, mine in self._identity().items():
            if key in state and state[key] != mine and not self._resumes(key, state[key]):
                raise InvalidOption(f"cannot resume: the state has {key}={state[key]!r}, this loader has "
                                    f"{key}={mine!r}; build the loader with the same arguments as the saved run")
        self.set_epoch(int(state["epoch"]))
        batch = int(state["batch"])
        # The loader's own plan has a length; a user's batch sampler may have none yet (it may
        # make its batches when the epoch starts).
        count = None if getattr(self, "batch_sampler", None) is not None else len(self)  # type: ignore[arg-type]
        if count is not None and batch > count:
            raise InvalidOption(f"cannot resume: state['batch'] is {batch}, but this loader's epochs have {count} "
                                "batches; pass the state of a loader built like this one")
        self._resume_batch = batch
        self._consumed = self._resume_batch
