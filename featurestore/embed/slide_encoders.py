"""Slide encoder specs of ``featurestore embed``: ``mean``, ``max`` and ``python:MODULE:FACTORY``.

``mean`` and ``max`` pool a row's patches in numpy (featurestore.embed.pooling); no torch.
``python:MODULE:FACTORY`` calls ``FACTORY()`` for a torch module, called as the field's slide
encoders are: ``forward(features [1, N, D] float32, coords [1, N, 2] int64, patch_size_level0=int)``
returning ``[1, E]`` or ``[E]``. It may declare what it needs of the bag split in a
``featurestore_requires`` attribute (``input_dim``, ``patch_size_level0``, ``magnification``,
``coords_unit``); :func:`check_requirements` refuses a bag split that differs, in one line.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption

POOLINGS = ("mean", "max")
REQUIREMENTS = ("input_dim", "patch_size_level0", "magnification", "coords_unit")
AUTOCAST = ("none", "bfloat16", "float16")
_SPEC_HELP = "use mean, max or python:MODULE:FACTORY (a torch module factory)"


class SlideEncoderError(InvalidOption):
    """A slide encoder spec that does not load, or one that returns something unusable."""


@dataclass
class SlideEncoder:
    spec: str
    pooling: str | None  # "mean" | "max" for the numpy poolings, None for a torch module
    module: Any = None
    weights_hash: str | None = None
    requires: dict[str, Any] | None = None

    def to_json(self, output_dim: int) -> dict[str, Any]:
        return {"spec": self.spec, "weights_hash": self.weights_hash, "output_dim": int(output_dim),
                "requires": self.requires}


def parse(spec: str) -> tuple[str, str | None, str | None]:
    """``(kind, module, factory)`` of a spec, checked for form only (nothing imported)."""
    if spec in POOLINGS:
        return spec, None, None
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == "python" and all(parts[1:]):
        return "python", parts[1], parts[2]
    raise SlideEncoderError(f"invalid slide encoder spec {spec!r}: {_SPEC_HELP}")


def load(spec: str) -> SlideEncoder:
    """The slide encoder of ``spec``: a pooling, or the module ``FACTORY()`` returns (eval mode)."""
    kind, module_name, factory_name = parse(spec)
    if kind in POOLINGS:
        return SlideEncoder(spec, kind)
    import torch

    from featurestore.extract.encoders import weights_hash

    try:
        module = importlib.import_module(module_name or "")
    except ImportError as error:
        raise SlideEncoderError(f"slide encoder {spec!r}: cannot import module {module_name!r} ({error}): "
                                "put it on PYTHONPATH") from None
    factory = getattr(module, factory_name or "", None)
    if not callable(factory):
        raise SlideEncoderError(f"slide encoder {spec!r}: module {module_name!r} has no callable {factory_name!r}")
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise SlideEncoderError(f"slide encoder {spec!r}: {factory_name}() returned {type(model).__name__}, "
                                "not a torch.nn.Module")
    model.eval()
    requires = getattr(model, "featurestore_requires", None)
    if requires is not None:
        if not isinstance(requires, dict) or set(requires) - set(REQUIREMENTS):
            raise SlideEncoderError(f"slide encoder {spec!r}: featurestore_requires must be a dict with keys among "
                                    f"{', '.join(REQUIREMENTS)}, got {requires!r}")
        requires = dict(requires)
    # No weights (a parameter-free module): nothing to hash, the spec names it.
    hashed = weights_hash(model, spec) if model.state_dict() else None
    return SlideEncoder(spec, None, model, hashed, requires)


def recorded_magnification(metadata: dict[str, Any]) -> Any:
    """The magnification a bag split records: slide extraction's target (its ``preprocessing``'s
    ``patching``; ``patching.target`` in a document written otherwise), or a ``magnification`` key."""
    preprocessing = metadata.get("preprocessing")
    patching = preprocessing.get("patching") if isinstance(preprocessing, dict) else None
    if isinstance(patching, dict) and patching.get("magnification") is not None:
        return patching["magnification"]
    patching = metadata.get("patching")
    if isinstance(patching, dict) and isinstance(patching.get("target"), dict):
        value = patching["target"].get("magnification")
        if value is not None:
            return value
    return metadata.get("magnification")


def check_requirements(encoder: SlideEncoder, bags: Any, key: str) -> None:
    """Refuse a bag split that differs from what the encoder declares it needs (one line naming
    both values)."""
    have = {"input_dim": bags.dim, "patch_size_level0": recorded_patch_size(bags),
            "magnification": recorded_magnification(bags.metadata), "coords_unit": bags.coords_unit}
    for name, wanted in (encoder.requires or {}).items():
        value = have[name]
        same = value == wanted or (isinstance(value, (int, float)) and isinstance(wanted, (int, float))
                                   and math.isclose(value, wanted))
        if not same:
            recorded = "none" if value is None else repr(value) if not isinstance(value, tuple) else (
                " and ".join(map(str, value)) + " (per slide)")
            raise SlideEncoderError(
                f"slide encoder {encoder.spec} requires {name} {wanted!r}, the bag split {key} records "
                f"{recorded}: use the bag split extracted for this slide encoder")


def check_inputs(encoder: SlideEncoder, bags: Any, key: str) -> None:
    """What a torch slide encoder is called with must exist in the bag split."""
    if encoder.pooling is not None:
        return
    if np.dtype(bags.coords_dtype).kind != "i":
        raise SlideEncoderError(
            f"bag split {key} stores {bags.coords_dtype} coordinates (unit {bags.coords_unit}); python slide "
            "encoders take int64 level-0 pixel coordinates: import the slides with pixel coordinates")
    missing = next((i for i, size in enumerate(bags.patch_sizes()) if size is None), None)
    if missing is not None:
        raise SlideEncoderError(
            f"bag {bags.ids[missing]!r} of {key} records no patch_size_level0 (the split's or its own); python "
            "slide encoders are called with it: import or extract the slides with their patch size recorded")


def recorded_patch_size(bags: Any) -> Any:
    """The split's ``patch_size_level0``, else the one its bags record alike (slide extraction
    records it per slide); a tuple of the sizes when its slides differ, None when none records one."""
    if bags.patch_size_level0 is not None or not len(bags):
        return bags.patch_size_level0
    sizes = set(bags.patch_sizes())
    if None in sizes:
        return None
    return sizes.pop() if len(sizes) == 1 else tuple(sorted(sizes))


def row_patch_size(bags: Any, row: Any, spec: str) -> int:
    """The one level-0 patch side of a row's slides, what a python slide encoder is called with."""
    sizes = sorted({bags.patch_size_of(b) or 0 for b in row.bags})
    if len(sizes) != 1:
        raise SlideEncoderError(f"the slides of {row.id!r} have level-0 patch sizes {', '.join(map(str, sizes))}: "
                                f"slide encoder {spec} is called with one; embed slides one by one (no --group-by), "
                                "or group slides scanned alike")
    return sizes[0]


def autocast_dtype(name: str) -> Any:
    """The torch dtype of ``--autocast`` (None for ``none``)."""
    if name not in AUTOCAST:
        raise InvalidOption(f"--autocast {name!r} is not one of {', '.join(AUTOCAST)}")
    if name == "none":
        return None
    import torch

    return getattr(torch, name)


def call(encoder: SlideEncoder, features: np.ndarray, coords: np.ndarray, patch_size: int,
         device: Any, autocast: Any, row_id: str) -> np.ndarray:
    """One row through a torch slide encoder: ``[E]`` float32 numpy."""
    import contextlib

    import torch

    x = torch.from_numpy(features)[None].to(device)
    c = torch.from_numpy(coords)[None].to(device)
    guard = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    try:
        with torch.inference_mode(), guard:
            out = encoder.module(x, c, patch_size_level0=int(patch_size))
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as error:  # noqa: BLE001 - the user's module: one line naming the row it failed on
        line = f"{type(error).__name__}: {error}".splitlines()[0]
        raise SlideEncoderError(f"slide encoder {encoder.spec} failed on {row_id!r} ({line}); what was "
                                "written before it is kept: fix the encoder, then run again with --resume") from error
    if not isinstance(out, torch.Tensor) or not (out.ndim == 1 or (out.ndim == 2 and out.shape[0] == 1)):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise SlideEncoderError(f"slide encoder {encoder.spec} returned {shape} for {row_id!r}: it must return "
                                "[1, E] or [E]")
    vector = out.reshape(-1).float().cpu().numpy()
    if not np.isfinite(vector).all():
        bad = int((~np.isfinite(vector)).sum())
        raise SlideEncoderError(f"slide encoder {encoder.spec} returned {bad} NaN/Inf values for {row_id!r}: "
                                "featurestore stores finite values only; check the encoder (under --autocast "
                                "float16, try --autocast bfloat16 or none), then run again with --resume")
    return vector
