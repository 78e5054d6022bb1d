"""Chunk sizing for extraction: whole batches per chunk, so batches are never cut short."""

from __future__ import annotations

import pytest

from featurestore.extract.plan import chunk_rows_for


@pytest.mark.parametrize(
    ("shape", "dtype", "chunk_mb", "batch", "rows"),
    [
        ((256, 128), "float16", 8.0, 64, 128),  # 64 KiB samples: 128 fit, a multiple of 64
        ((256, 128), "float16", 8.0, 48, 96),  # 128 fit, rounded down to 2 batches of 48
        ((1024, 3072), "float16", 8.0, 64, 64),  # 6 MiB samples: grown to one batch
        ((1024, 3072), "float32", 8.0, 16, 16),
        ((384,), "bfloat16", 1.0, 1, 1365),  # batch 1: the byte target alone decides
    ],
)
def test_chunks_hold_whole_batches(shape: tuple[int, ...], dtype: str, chunk_mb: float, batch: int, rows: int) -> None:
    got = chunk_rows_for(shape, dtype, chunk_mb, batch)
    assert got == rows
    assert got % batch == 0
