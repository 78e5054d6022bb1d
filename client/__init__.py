"""The consumer side of featurestore: HTTP client, PyTorch Dataset and streaming GPU loader.

Names are imported lazily so that ``import client`` stays cheap and never imports the server
stack (fastapi, uvicorn); only the object you use pulls in httpx or torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["BagDataset", "BagLoader", "ClientError", "FeatureClient", "FeatureDataset", "FeatureLoader",
           "RemoteFeatureArray"]

_WHERE = {
    "BagDataset": "client.bag_dataset",
    "BagLoader": "client.bag_loader",
    "FeatureClient": "client.http",
    "ClientError": "client.transport",
    "FeatureDataset": "client.dataset",
    "FeatureLoader": "client.loader",
    "RemoteFeatureArray": "client.remote",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
