"""Whether a derived split is stale: its lineage (featurestore.format.lineage) against its source
split's metadata as it is on storage now.

The one staleness check of ``verify``, ``ls``/``info``, the web page, the server's response
header, ``embed --resume`` and a probe's report: each calls :func:`stale_reason` with the derived
split's metadata (a probe over HTTP compares the lineage with the source's metadata the server
gives, :mod:`client.stale`).
"""

from __future__ import annotations

import warnings
from typing import Any

from featurestore.errors import DatasetNotFound, EncoderNotFound, FeatureStoreError, SplitNotFound, StaleSplitWarning
from featurestore.format import lineage


def source_metadata(store: Any, doc: dict[str, Any]) -> dict[str, Any] | None:
    """The current metadata of the source a lineage ``doc`` names, or None when it is gone."""
    source = doc["source"]
    try:
        return store.split_metadata(source["dataset"], source["encoder"], source["split"])
    except (DatasetNotFound, EncoderNotFound, SplitNotFound):
        return None


def stale_reason(store: Any, metadata: dict[str, Any]) -> str | None:
    """Why the split whose ``metadata`` is given no longer describes its source (one ASCII line),
    or None: current, or not a derived split. A damaged lineage or source document is a reason
    too (the derived rows cannot be vouched for)."""
    try:
        doc = lineage.of(metadata)
        if doc is None:
            return None
        return lineage.stale_reason(doc, source_metadata(store, doc))
    except FeatureStoreError as error:
        return " ".join(str(error).split()).encode("ascii", "replace").decode()


def warn_stale(name: str, reason: str, stacklevel: int) -> None:
    """The :class:`StaleSplitWarning` a client gives when it opens the stale split ``name``
    (``stacklevel``: counted from the caller of this function's caller, as ``warnings.warn``'s)."""
    warnings.warn(f"{name} is stale: {reason}; its rows describe the old source (compute it again: featurestore "
                  "embed ... --resume)", StaleSplitWarning, stacklevel=stacklevel + 1)
