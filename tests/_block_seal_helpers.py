"""What the block seals tests of both kinds share: writers as before block seals, and the bytes
this process has read from the device."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from featurestore.core import block_seals


@contextmanager
def writers_without_block_seals() -> Iterator[None]:
    """Writers as before block seals existed, inside the block."""
    enabled, block_seals.ENABLED = block_seals.ENABLED, False
    try:
        yield
    finally:
        block_seals.ENABLED = enabled


@pytest.fixture
def unsealed_blocks() -> Iterator[None]:
    """Writers as before block seals existed, for the whole test."""
    with writers_without_block_seals():
        yield


def read_bytes() -> int:
    """Bytes this process has read from the device (not the page cache) so far."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")
