"""The cyclic collector paused around a numba kernel module's load (featurestore.core.collector_pause)."""

from __future__ import annotations

import gc
import threading

import pytest

from featurestore.core import collector_pause
from featurestore.core.collector_pause import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored() -> None:
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_pause_restores_the_earlier_state() -> None:
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a user's own choice stays
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_nested_and_concurrent_pauses_end_together() -> None:
    gc.enable()
    inside, release = threading.Event(), threading.Event()

    def other() -> None:
        with collector_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with collector_paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause still runs
    release.set()
    thread.join(10)
    assert gc.isenabled() and collector_pause._DEPTH == 0


def test_an_error_inside_still_restores() -> None:
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a broken numba install")
    assert gc.isenabled()


def test_the_kernel_loads_run_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both numba loads (the writer's statistics kernel, the loaders' dequantize kernel) import
    their module with the collector off."""
    import importlib

    from client import dequantize
    from featurestore.core import fused_stats

    seen: list[tuple[str, bool]] = []
    real = importlib.import_module

    def watched(name: str, *args: object) -> object:
        if name.startswith("featurestore.core.") and name.endswith("kernel"):
            seen.append((name, gc.isenabled()))
        return real(name, *args)

    gc.enable()
    monkeypatch.setattr(importlib, "import_module", watched)
    fused_stats.available.cache_clear()
    monkeypatch.setattr(dequantize, "_STATE", {})
    assert fused_stats.available()
    assert dequantize.wait_warm(60)
    # (numba's cache loader imports the module by name again: every import, paused)
    assert set(seen) == {("featurestore.core.fused_kernel", False), ("featurestore.core.int8_dequant_kernel", False)}
    assert gc.isenabled()
