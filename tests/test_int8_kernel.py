"""The int8 writer's one-pass numba kernel (core.int8_kernel) gives the bits of the numpy path
(format.int8.encode / decode and format.stats.row_stats_numpy): codes, scales, saturation and
every statistics figure, for chunks (scales per token and channel) and bags (per channel)."""

from __future__ import annotations

import numpy as np
import pytest

from featurestore.core import fused_stats, quantize_int8
from featurestore.format import int8
from featurestore.format.stats import ROW_FIELDS, row_stats_numpy

pytestmark = pytest.mark.skipif(not fused_stats.available(), reason="numba is not installed: no kernel to compare")


def _numpy_path(values: np.ndarray, samples: tuple[int, int, int]) -> tuple:
    codes, scales, saturated = int8.encode(values)
    back = int8.decode(codes, scales)
    return codes, scales, saturated, row_stats_numpy(values.reshape(samples), back.reshape(samples),
                                                     "float32", False, samples[2])


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    x[..., 1] *= 1000.0  # massive activations
    x[..., 2] = 0.0  # a zero channel: scale 0
    x[:3, ..., 3] = 1e-41  # subnormal: the smallest normal scale
    x[..., 4] *= 1e-6
    x[..., 5] = -1e-3  # rounds to -0.0 beside a large value: the code's value back is +0.0
    x[0, ..., 5] = 100.0
    x[1, ..., 6] = -0.0
    return x


@pytest.mark.parametrize(("shape", "bag"), [((40, 37, 24), False), ((128, 48, 16), False), ((9, 3, 2, 8), False),
                                            ((33, 16), True), ((2, 8), True)])
def test_the_kernel_gives_the_numpy_paths_bits(shape: tuple[int, ...], bag: bool) -> None:
    values = _values(shape, len(shape))
    samples = (1, shape[0], shape[-1]) if bag else (shape[0], int(np.prod(shape[1:-1])), shape[-1])
    fast, slow = quantize_int8._encode_measured(values, samples), _numpy_path(values, samples)
    assert fast[0].tobytes() == slow[0].tobytes() and fast[0].shape == slow[0].shape
    assert fast[1].tobytes() == slow[1].tobytes() and fast[1].shape == slow[1].shape
    assert fast[2] == slow[2]
    for name in ROW_FIELDS:
        if name != "abs_max":  # the caller's (measured on the way in)
            assert getattr(fast[3], name).tobytes() == getattr(slow[3], name).tobytes(), name
