"""Output buffers of gathers start on a page boundary (copy speed; see reader.aligned_empty)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

import featurestore
from featurestore.core.reader import aligned_empty


@pytest.mark.parametrize("shape", [(64, 256, 384), (3, 5), (1,), (0, 7)])
def test_aligned_empty_is_page_aligned_and_contiguous(shape: tuple[int, ...]) -> None:
    out = aligned_empty(shape, np.float16)
    assert out.shape == shape and out.dtype == np.float16 and out.flags.c_contiguous
    if out.size:
        assert out.ctypes.data % mmap.PAGESIZE == 0
    out[...] = 1  # writable over its whole extent
    assert np.count_nonzero(out == 1) == out.size


def test_reads_allocate_aligned_output(tmp_path: object) -> None:
    store = featurestore.open_store(str(tmp_path), mode="a")
    writer = store.create_split("d", "e", "s", num_samples=10, sample_shape=(4, 8), dtype="float32")
    values = np.arange(10 * 4 * 8, dtype=np.float32).reshape(10, 4, 8)
    writer.write(0, values)
    writer.commit()
    out = store.open("d", "e", "s").read_numpy([9, 0, 0, 3])
    assert out.ctypes.data % mmap.PAGESIZE == 0
    assert np.array_equal(out, values[[9, 0, 0, 3]])
