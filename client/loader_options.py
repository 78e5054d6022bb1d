"""The options both loaders take, checked in one place (:class:`client.loader.FeatureLoader`,
:class:`client.bag_loader.BagLoader`): the same argument is refused with the same
:class:`~featurestore.errors.InvalidOption` line by either loader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from featurestore.core.device import resolve_device
from featurestore.errors import InvalidOption


def check_count(name: str, value: Any, low: int) -> int:
    """``value`` as an int if it is an integer >= ``low``, else :class:`InvalidOption` naming it."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise InvalidOption(f"`{name}` must be an integer >= {low}, but got: {value!r}")
    return int(value)


@dataclass(frozen=True)
class LoaderOptions:
    """What the shared checks resolve: the device, the batches' dtype, whether host slots are pinned."""

    device: torch.device
    dtype: torch.dtype
    pin_memory: bool


def check_loader_options(ds: Any, *, batch_size: Any, prefetch: Any, seed: Any, rank: Any, world_size: Any,
                         device: Any, dtype: Any, pin_memory: Any, num_threads: Any) -> LoaderOptions:
    """Check the options every loader shares; ``dtype=None`` resolves to ``ds.torch_dtype`` (the
    stored one; float32 for int8, whose codes are not values), ``pin_memory="auto"`` to pinned on
    CUDA only."""
    for name, value, low in (("batch_size", batch_size, 1), ("prefetch", prefetch, 1), ("seed", seed, 0),
                             ("world_size", world_size, 1), ("rank", rank, 0)):
        check_count(name, value, low)
    if rank >= world_size:
        raise InvalidOption(f"`rank` must be in [0, world_size={world_size}), but got: {rank!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        named = isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
        hint = f": pass torch.{dtype}, not the string" if named else ""
        raise InvalidOption(f"`dtype` must be a floating torch dtype or None (keep the stored dtype), but got: "
                            f"{dtype!r}{hint}")
    if pin_memory not in ("auto", True, False):
        raise InvalidOption(f"`pin_memory` must be 'auto', True or False, but got: {pin_memory!r}")
    if num_threads is not None and (not isinstance(num_threads, int) or isinstance(num_threads, bool)
                                    or num_threads < 1):  # fmt: skip
        raise InvalidOption(f"`num_threads` must be a positive integer or None, but got: {num_threads!r}")
    resolved = resolve_device(device)
    if resolved.type not in ("cuda", "cpu"):
        raise InvalidOption(f"`device` must be a CUDA device or 'cpu', but got: {str(device)!r}")
    pinned = resolved.type == "cuda" if pin_memory == "auto" else bool(pin_memory)
    return LoaderOptions(resolved, dtype if dtype is not None else ds.torch_dtype, pinned)
