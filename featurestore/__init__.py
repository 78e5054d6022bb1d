"""featurestore: a memory-mapped, on-disk Zarr v3 feature store for frozen-encoder evaluation.

``open_store(url)`` is the entry point; see docs/FORMAT.md for the layout and SPEC names.
Importing this package does not import torch, zarr or any network client.
"""

from __future__ import annotations

__version__ = "0.1.0"

from featurestore.core.reader import FeatureArray  # noqa: E402
from featurestore.core.store import FeatureStore, open_store  # noqa: E402
from featurestore.core.writer import SplitWriter  # noqa: E402
from featurestore.errors import FeatureStoreError  # noqa: E402

__all__ = ["FeatureArray", "FeatureStore", "FeatureStoreError", "SplitWriter", "__version__", "open_store"]
