"""Fixtures shared by the probe tests (import them into a test module to use them there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Each test on one intra-op thread: probe steps are small ops, and on a loaded 2-core runner two
    OpenMP threads spin-wait on each other (measured: 24 s vs 0.3 s for the same ABMIL probe)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
