"""featurestore: a Zarr v3 on-disk feature store for frozen-encoder evaluation.

``featurestore.open_store(url, mode="r" | "a")`` is the entry point; see docs/CORE-API.md. The
public names below load on first use (PEP 562), so importing one layer (``featurestore.format``
in the server, say) does not import the layers above it; docs/ARCHITECTURE.md has the map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "FeatureArray": "featurestore.core.reader",
    "FeatureStore": "featurestore.core.store",
    "open_store": "featurestore.core.store",
    "SplitWriter": "featurestore.core.writer",
    "FeatureStoreError": "featurestore.errors",
}

__all__ = ["FeatureArray", "FeatureStore", "FeatureStoreError", "SplitWriter", "__version__", "open_store"]

if TYPE_CHECKING:
    from featurestore.core.reader import FeatureArray
    from featurestore.core.store import FeatureStore, open_store
    from featurestore.core.writer import SplitWriter
    from featurestore.errors import FeatureStoreError


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'featurestore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
