"""What every ``featurestore extract`` run takes, dense or whole-slide (the fields both share)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from featurestore.errors import InvalidOption
from featurestore.extract.plan import check_chunk_mb
from featurestore.format.names import validate_name


@dataclass
class RunOptions:
    """The options of an extraction run; see docs/EXTRACT.md for each. ``ExtractOptions``
    (extract.run) and ``SlideOptions`` (extract.wsi_run) add their source's own."""

    images: str
    encoder: str
    store: str
    dataset: str
    split: str
    encoder_name: str | None = None
    dtype: str = "auto"
    batch_size: int = 64
    device: str = "auto"
    resume: bool = False
    overwrite: bool = False
    chunk_mb: float = 8.0
    precision: str = "auto"
    tokens: str = "patch"
    prefix_tokens: int | None = None
    labels: str | None = None
    num_workers: int | None = None
    limit: int | None = None  # the first N samples (slides)
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    queue_size: int = 4
    progress: bool = True
    threads: int | None = None  # torch intra-op threads on the CPU; see docs/EXTRACT.md

    def check(self) -> None:
        """The checks every run makes before it opens anything: one line naming the bad value."""
        validate_name(self.dataset, "dataset")
        validate_name(self.split, "split")
        if self.batch_size < 1:
            raise InvalidOption(f"--batch-size must be a positive integer, but got: {self.batch_size}")
        check_chunk_mb(self.chunk_mb)
        if self.num_workers is not None and self.num_workers < 0:
            raise InvalidOption(f"--num-workers must be 0 (load in the main process) or more, but got: {self.num_workers}")
        if self.queue_size < 1:
            raise InvalidOption(f"--queue-size must be a positive integer, but got: {self.queue_size}")
        if self.prefix_tokens is not None and self.prefix_tokens < 0:
            raise InvalidOption(f"--prefix-tokens must be 0 or more (CLS + register tokens), but got: "
                                f"{self.prefix_tokens}")
        if self.resume and self.overwrite:
            raise InvalidOption("--resume and --overwrite exclude each other: choose one")


@contextlib.contextmanager
def torch_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to ``count`` for a run (None: left as they are), restored
    after it. CPU float sums can round differently with the thread count (docs/EXTRACT.md)."""
    if count is not None and count < 1:
        raise InvalidOption(f"--threads must be a positive integer, but got: {count}")
    import torch

    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["RunOptions", "torch_threads"]
