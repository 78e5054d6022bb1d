"""Whether a split a client opens is a stale derived split (featurestore.core.lineage): an embedding
split whose source bags were rewritten or removed since ``featurestore embed`` computed it.

It still reads (a user may mean to compare), but never as current: :class:`client.FeatureDataset`
sets ``ds.stale`` and warns (:class:`featurestore.errors.StaleSplitWarning`), as
:meth:`client.FeatureClient.open` does for the array it returns (``arr.stale``), and a probe's report
ends with a WARNING line, as ``ls``, ``info``, ``verify``, the web page and the server's
``X-Featurestore-Stale`` header say. The one check (:func:`featurestore.core.lineage.stale_reason`)
decides on a store and over HTTP, where the source's metadata comes from the server's routes."""

from __future__ import annotations

from typing import Any

from featurestore.core.lineage import stale_reason
from featurestore.format import lineage

__all__ = ["stale_reason_of"]


def stale_reason_of(source: str, metadata: dict[str, Any], *, storage_options: dict[str, Any] | None = None,
                    token: str | None = None) -> str | None:
    """Why the split whose ``metadata`` was read from ``source`` (store path, fsspec URL or
    http(s) server) no longer describes its source, or None (current, or not derived)."""
    if lineage.KEY not in metadata:
        return None
    if not source.startswith(("http://", "https://")):
        import featurestore

        return stale_reason(featurestore.open_store(source, **(storage_options or {})), metadata)
    from client.http import FeatureClient, ServedSplits

    with FeatureClient(source, token=token) as client:
        return stale_reason(ServedSplits(client), metadata)
