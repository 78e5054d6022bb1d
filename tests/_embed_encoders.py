"""Slide encoders for tests/test_embed*.py (imported by ``python:_embed_encoders:FACTORY`` specs, also
in ``featurestore embed`` subprocesses: the tests directory is on their PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch import nn


class Recorder(nn.Module):
    """Records what each call got (dtype, shape, patch size, coords) in ``calls``, and returns the
    features' column sums plus the coords' sums, so the output shows what went in."""

    featurestore_output_dim = None

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.calls: list[dict[str, Any]] = []

    def forward(self, features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int) -> torch.Tensor:
        self.calls.append({"features_dtype": str(features.dtype), "features_shape": tuple(features.shape),
                           "coords_dtype": str(coords.dtype), "coords": coords[0].tolist(),
                           "patch_size_level0": patch_size_level0, "autocast": torch.is_autocast_enabled("cpu")})
        log = os.environ.get("FS_EMBED_LOG")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(self.calls[-1]) + "\n")
        delay = float(os.environ.get("FS_EMBED_SLEEP", "0"))
        if delay:
            time.sleep(delay)
        return (features.sum(dim=1) * self.scale)  # [1, D]


RECORDERS: list[Recorder] = []


def recorder() -> Recorder:
    module = Recorder()
    RECORDERS.append(module)
    return module


class Needy(Recorder):
    featurestore_requires = {"input_dim": 8, "patch_size_level0": 512}


def needy() -> Needy:
    return Needy()


def flat() -> nn.Module:
    """Returns [E] (not [1, E]): accepted too."""

    class Flat(nn.Module):
        def forward(self, features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int) -> torch.Tensor:
            return features[0].mean(dim=0)

    return Flat()


def not_a_module() -> Any:
    return lambda features, coords, patch_size_level0: features


class Faulty(nn.Module):
    """Fails on the bag with the most patches of the first rows: raises (``FS_EMBED_FAULT=raise``)
    or returns NaN (``nan``); as itself (its row sums) otherwise."""

    featurestore_output_dim = 8

    def forward(self, features: torch.Tensor, coords: torch.Tensor, patch_size_level0: int) -> torch.Tensor:
        if features.shape[1] == 30:  # bag s-b of tests/test_embed.py's BAGS
            if os.environ.get("FS_EMBED_FAULT") == "raise":
                raise RuntimeError("CUDA out of memory (simulated)\nsecond line")
            return torch.full((1, features.shape[2]), float("nan"))
        return features.sum(dim=1)


def faulty() -> Faulty:
    return Faulty()
