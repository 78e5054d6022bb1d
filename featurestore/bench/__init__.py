"""The benchmarks behind ``featurestore bench``: one module per bench, named as its verb except
where another layer already has the name (``bench bags`` is :mod:`bag_reads`)."""

from __future__ import annotations

import importlib
from types import ModuleType

MODULE_OF = {"bags": "bag_reads"}


def bench_module(name: str) -> ModuleType:
    """The module of bench ``name`` (a verb of ``featurestore bench``, ``_`` for ``-``)."""
    return importlib.import_module(f"featurestore.bench.{MODULE_OF.get(name, name)}")
