"""featurestore: a memory-mapped, on-disk Zarr v3 feature store for frozen-encoder evaluation.

``open_store(url)`` is the entry point; see docs/FORMAT.md for the layout and SPEC names.
Importing this package does not import torch, zarr or any network client.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import FeatureStoreError  # noqa: E402
from .reader import FeatureArray  # noqa: E402
from .store import FeatureStore, open_store  # noqa: E402
from .writer import SplitWriter  # noqa: E402

__all__ = ["FeatureArray", "FeatureStore", "FeatureStoreError", "SplitWriter", "__version__", "open_store"]
