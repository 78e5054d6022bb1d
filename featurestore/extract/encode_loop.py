"""What image and slide extraction share around the encoder: loading it on the rank's device,
precision, the first sample's checks, image workers, the progress bar, the loop that feeds the
writer thread and the base of their run_split jobs.

The loop (:func:`feed`) runs on the main thread: batches come from a DataLoader whose workers
fork when it is first iterated, the encoder runs under ``inference_mode``, and a writer thread
(extract.writer_thread) drains what ``step`` puts into the split writer. On any failure the
thread still writes what is queued (complete chunks and bags help a resume) and ends before the
error goes on.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from featurestore.core import fused_stats
from featurestore.core.device import resolve_device
from featurestore.errors import Float16Overflow, InvalidOption, NonFiniteValues
from featurestore.extract.dist import Coordinator
from featurestore.extract.dist_run import SplitJob
from featurestore.extract.encoders import Encoder, load_encoder
from featurestore.extract.plan import resolve_dtype
from featurestore.extract.writer_thread import WriterThread
from featurestore.format import dtypes
from featurestore.format.names import validate_name


def resolve_precision(choice: str, device: torch.device) -> str:
    """``bf16`` (autocast) or ``fp32``: bf16 by default on CUDA, float32 on the CPU."""
    if choice == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if choice not in ("bf16", "fp32"):
        raise InvalidOption(f"--precision {choice!r} is not one of auto, bf16, fp32")
    return choice


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def load_encoder_on(opts: Any, coord: Coordinator) -> tuple[Encoder, str, torch.device, str]:
    """The encoder on this rank's device, its name in the store and the precision it runs in."""
    encoder = load_encoder(opts.encoder)
    name = validate_name(opts.encoder_name or encoder.default_name, "encoder name")
    device = resolve_device(opts.device, coord.local_rank)
    encoder.to(device)
    return encoder, name, device, resolve_precision(opts.precision, device)


def first_sample_dtypes(sample: torch.Tensor, opts: Any, what: str, advice: str) -> tuple[str, str]:
    """The encoder's output dtype and the stored one (``--dtype``), once the first sample (``what``)
    is finite and fits the stored dtype: refused before the store is touched."""
    if not bool(torch.isfinite(sample).all()):
        raise NonFiniteValues(f"encoder {opts.encoder} returned NaN or Inf for {what}: featurestore does not store "
                              f"non-finite values. {advice}")
    output_dtype = str(sample.dtype).removeprefix("torch.")
    dtype = resolve_dtype(opts.dtype, output_dtype)
    _check_first_sample_fits(sample, dtype, opts.encoder)
    return output_dtype, dtype


def _check_first_sample_fits(sample: torch.Tensor, dtype: str, spec: str) -> None:
    """The writer's range rules, applied to sample 0 before the store is touched (like
    NaN): a run that cannot store its first sample must not leave a ``writing`` split behind."""
    abs_max = float(sample.detach().abs().max().float())
    if dtype == "float16" and abs_max > dtypes.FLOAT16_MAX:
        raise Float16Overflow(
            f"encoder {spec} returned values up to {abs_max:.6g} for sample 0, beyond float16's "
            "range +-65504; nothing was written. Use --dtype bfloat16 (float32's range, ~4e-3 "
            "relative error) or --dtype float32 (exact)")
    if dtype == "bfloat16" and abs_max >= dtypes.BFLOAT16_ROUNDS_TO_INF:
        raise NonFiniteValues(
            f"encoder {spec} returned values up to {abs_max:.6g} for sample 0, which round to Inf "
            "in bfloat16; nothing was written. Use --dtype float32 (exact)")


def default_num_workers(world_size: int = 1) -> int:
    """Image workers when ``--num-workers`` is not given: leave a core to the encoder; ranks
    share the machine's cores."""
    return min(4, max(0, (os.cpu_count() or 1) // world_size - 1))


def num_workers(opts: Any, coord: Coordinator) -> int:
    return opts.num_workers if opts.num_workers is not None else default_num_workers(coord.world_size)


def worker_init(_: int) -> None:
    # Workers only decode and resize one image at a time; intra-op threads would oversubscribe.
    torch.set_num_threads(1)


class EncodeJob(SplitJob):
    """What the image and the slide job share: this rank's preparation, ``prepare(opts, coord)``
    (source, encoder on the device, sample 0's checks), and :class:`Progress` as what each rank did."""

    def __init__(self, opts: Any, coord: Coordinator, prepare: Callable[[Any, Coordinator], Any]) -> None:
        super().__init__(opts)
        self.coord = coord
        self._prepare = prepare
        self.prep: Any = None

    def load(self) -> None:
        self.prep = self._prepare(self.opts, self.coord)
        self.encoder_name = self.prep.encoder_name


@dataclass
class Progress:
    """What one process's encode loop did; gathered from every rank into the run's result."""

    items: int = 0  # samples (images) or bags (slides)
    patches: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    waited: float = 0.0  # the encoder blocked on the writer (full queue, final drain)
    skipped: list[dict[str, str]] = field(default_factory=list)


def feed(loader: Any, thread: WriterThread, bar: Any, device: torch.device, warm: tuple[str, str],
         step: Callable[[Any], None], last: Callable[[], None] | None = None,
         done: Progress | None = None) -> Progress:
    """Run ``step`` on each batch of ``loader`` (it encodes and puts into ``thread``), then
    ``last``, then drain the thread; ``warm``: (source dtype, stored dtype) of the writer's
    fused kernel, loaded meanwhile for host batches. ``done`` (what the steps counted) comes
    back with the loop's time, bytes and waits."""
    thread.start()
    started = time.perf_counter()
    try:
        batches = iter(loader)  # image workers start (fork) here, before the warm-up thread exists
        if device.type == "cpu":
            fused_stats.warm_up_soon(*warm)
        with torch.inference_mode():
            for batch in batches:
                step(batch)
        if last is not None:
            last()
        thread.finish()
    except BaseException:
        # Let the thread write what is queued (complete chunks help a resume) and end.
        thread.queue.put(None)
        thread.join()
        raise
    finally:
        bar.close()
    done = done or Progress()
    done.bytes_written, done.seconds, done.waited = thread.bytes_written, time.perf_counter() - started, thread.waited
    return done


def gathered(progress: list[Progress], *, in_turn: bool = False) -> Progress:
    """Every rank's progress as one: counts summed, the slowest rank's seconds (ranks run side by
    side), skips sorted by id. ``in_turn``: parts one process ran one after another (a worker's
    slides): their seconds summed."""
    time = sum if in_turn else max
    return Progress(sum(p.items for p in progress), sum(p.patches for p in progress),
                    sum(p.bytes_written for p in progress), time(p.seconds for p in progress),
                    time(p.waited for p in progress),
                    sorted((s for p in progress for s in p.skipped), key=lambda s: s["id"]))


__all__ = ["EncodeJob", "Progress", "autocast", "default_num_workers", "feed", "first_sample_dtypes", "gathered",
           "load_encoder_on", "num_workers", "resolve_precision", "worker_init"]
