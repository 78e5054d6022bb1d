"""The kinds of split this code reads and writes, by their metadata ``kind`` name.

``kind_of(meta)`` is how kind-independent code (``verify``, the lifecycle's callers) reaches a
split's own checks. A new kind is one module with a :class:`~featurestore.core.split_kind.SplitKind`
subclass, registered here (and named in featurestore.format.metadata.KINDS).
"""

from __future__ import annotations

from typing import Any

from featurestore.core.kind_bags import BAG_KIND, BagKind
from featurestore.core.kind_dense import DENSE_KIND, DenseKind
from featurestore.core.split_kind import SplitKind
from featurestore.errors import InvalidMetadata
from featurestore.format.metadata import SplitMetadata

__all__ = ["BAG_KIND", "DENSE_KIND", "BagKind", "DenseKind", "kind_of", "register"]

REGISTRY: dict[str, SplitKind[Any]] = {DENSE_KIND.name: DENSE_KIND, BAG_KIND.name: BAG_KIND}


def register(kind: SplitKind[Any]) -> None:
    """Make ``kind`` the one that handles splits whose metadata names ``kind.name``."""
    REGISTRY[kind.name] = kind


def kind_of(meta: SplitMetadata) -> SplitKind[Any]:
    try:
        return REGISTRY[meta.kind]
    except KeyError:
        raise InvalidMetadata(f"split {meta.dataset}/{meta.encoder_name}/{meta.split} is of kind {meta.kind!r}, "
                              f"which this featurestore does not know (it knows {', '.join(REGISTRY)}): upgrade "
                              "featurestore") from None
