"""The options and the result of ``featurestore import``, shared by its dispatcher
(extract.importer) and the two imports it dispatches to (extract.dense_import, extract.bag_import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ImportOptions:
    source: str
    store: str
    dataset: str
    encoder_name: str
    split: str
    dtype: str = "auto"
    labels: str | None = None
    key: str | None = None
    prefix_tokens: int = 0
    grid: tuple[int, int] | None = None
    batch_size: int = 256
    chunk_mb: float = 8.0
    resume: bool = False
    overwrite: bool = False
    storage_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    verify_chunks: bool = False  # re-read and check every chunk of an existing split (the repair)
    bags: bool = False  # read a directory of .pt files as one bag per file (CLAM pt_files under another name)
    label_column: str | None = None  # slide bags: the --labels CSV column stored as the label (None: "label")
    id_column: str | None = None  # slide bags: the CSV column naming the slides (None: "slide_id")
    worker: Any = None  # extract.workers_share.WorkerOptions: claim slides beside other workers (--worker)


@dataclass
class ImportResult:
    status: str  # "complete" | "already-complete"
    key: str
    num_samples: int
    imported: int = 0
    seconds: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # one line each: what the import left out, and why


__all__ = ["ImportOptions", "ImportResult"]
