"""Deprecated import path: the ``storage_options`` translation lives in
:mod:`featurestore.core.storage.options`."""

from featurestore.core.storage.options import (
    DEFAULT_COALESCE_GAP,
    DEFAULT_CONCURRENCY,
    FEATURESTORE_KEYS,
    SCHEMES,
    ObjectStoreSettings,
    StaticCredentials,
    translate,
)

__all__ = ["DEFAULT_COALESCE_GAP", "DEFAULT_CONCURRENCY", "FEATURESTORE_KEYS", "SCHEMES", "ObjectStoreSettings",
           "StaticCredentials", "translate"]
