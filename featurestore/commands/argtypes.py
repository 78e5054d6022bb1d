"""Argument types for the CLI's flags: a bad value is argparse's one usage line naming it."""

from __future__ import annotations

import argparse
import math


def positive_float(text: str) -> float:
    """A finite number > 0 (``--chunk-mb``): ``0``, ``-1``, ``nan`` and ``inf`` are refused."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, but got: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, but got: {text!r}")
    return value
