"""``featurestore verify`` on a complete dense split (docs/FORMAT.md, "Guarantees").

Checked, every problem listed, each array through the one array checker
(featurestore.core.array_check): the ``features``, ``labels`` and ``chunk_stats`` documents
against the split metadata; every chunk present, of its size, with a valid crc32c; every
statistics row sealed with the split's generation and its own chunk index, and each features
chunk's row count and channel means against that row; the ``ids`` document; and, for a split
committed with ``chunk_seals``, every features, labels and int8 scales chunk's crc32c trailer
against the one the commit sealed for its place (scales only where the table seals them) (a labels chunk swapped with another keeps a valid crc32c and
has no statistics row to betray it: only the table does). A split committed before the table
existed has none and is checked as before (docs/FORMAT.md, "Chunk seals"). Where the split has
``block_seals``, each features chunk against them too: a damaged chunk's lines name its damaged
blocks (the rows a read would refuse), and a valid chunk whose blocks do not match is named.
"""

from __future__ import annotations

import numpy as np

from featurestore.core import block_verify
from featurestore.core.array_check import Expected, check_array, check_seals
from featurestore.core.split_kind import Findings
from featurestore.core.storage import Storage
from featurestore.format import dtypes, layout
from featurestore.format.chunk_checks import features_match_stats
from featurestore.format.metadata import SplitMetadata, seal_problem, stats_row_length
from featurestore.format.seals import CHUNK_SEALS, SEALED_ARRAYS, generation_of


def expected_arrays(meta: SplitMetadata) -> dict[str, Expected]:
    """A dense split's chunked arrays as its metadata describes them (statistics rows first:
    each features chunk is checked against its row)."""
    n, rows = meta.num_samples, meta.chunk_rows
    out = {
        layout.CHUNK_STATS: Expected([meta.num_chunks, stats_row_length(meta)], "float64", np.dtype(np.float64), 1),
        layout.FEATURES: Expected([n, *meta.sample_shape], dtypes.zarr_data_type(meta.logical_dtype),
                                  dtypes.storage_dtype(meta.logical_dtype), rows, meta.compressor is not None),
    }
    if meta.labels is not None:
        out[layout.LABELS] = Expected([n, *meta.labels.shape], meta.labels.dtype, np.dtype(meta.labels.dtype), rows)
    if dtypes.is_int8(meta.logical_dtype):  # one float32 scales row per chunk: its codes are nothing without it
        out[layout.SCALES] = Expected([meta.num_chunks, *meta.sample_shape], "float32", np.dtype(np.float32), 1)
    return out


def verify_dense(storage: Storage, key: str, meta: SplitMetadata, found: Findings) -> None:
    stats_rows: dict[int, np.ndarray] = {}
    blocks = block_verify.table(storage, key, meta, found)
    rows = block_verify.RowChecks(blocks, meta)

    def stats_row(index: int, raw: bytes) -> str | None:
        problem = seal_problem(raw, meta, index)
        if problem is None:
            stats_rows[index] = np.frombuffer(raw[: -layout.CRC_BYTES], np.float64)
        return problem

    def features_chunk(index: int, raw: bytes) -> str | None:
        problem = features_match_stats(raw, meta, index, stats_rows[index]) if index in stats_rows else None
        if problem is None:
            rows.check(index, raw)
        return problem

    checks = {layout.CHUNK_STATS: stats_row, layout.FEATURES: features_chunk}
    crcs: dict[str, list[int | None]] = {}
    expected = expected_arrays(meta)
    bad: set[int] = set()
    for name, spec in expected.items():
        check_array(storage, key, name, spec, found, crcs=crcs if name in SEALED_ARRAYS else None,
                    each=checks.get(name), bad=bad if name == layout.FEATURES else None)
    block_verify.name_damaged_blocks(storage, key, meta, found, blocks, bad)
    if meta.ids and not storage.exists(f"{key}/{layout.IDS}/{layout.ZARR_JSON}"):
        found.problems.append(f"{key}/{layout.IDS}/{layout.ZARR_JSON}: missing (the split metadata says it has ids)")
    # committed before chunk_seals existed: the statistics rows are its seal
    if storage.exists(f"{key}/{CHUNK_SEALS}/{layout.ZARR_JSON}") and all(
            name in crcs for name in expected if name in SEALED_ARRAYS):
        check_seals(storage, key, generation_of(meta), crcs, found, {name: len(e.shape) for name, e in expected.items()})
    rows.report(key, found)
