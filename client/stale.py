"""Whether a split a client opens is a stale derived split (featurestore.core.lineage): an embedding
split whose source bags were rewritten or removed since ``featurestore embed`` computed it.

It still reads (a user may mean to compare), but never as current: :class:`client.FeatureDataset`
sets ``ds.stale`` and warns (:class:`featurestore.errors.StaleSplitWarning`), and a probe's report
ends with a WARNING line, as ``ls``, ``info``, ``verify``, the web page and the server's
``X-Featurestore-Stale`` header say. Over HTTP the lineage is compared with the source's metadata
the server's routes give."""

from __future__ import annotations

from typing import Any

from featurestore.errors import DatasetNotFound, EncoderNotFound, FeatureStoreError, SplitNotFound
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
        from featurestore.core.lineage import stale_reason

        return stale_reason(featurestore.open_store(source, **(storage_options or {})), metadata)
    from client.http import FeatureClient

    try:
        doc = lineage.of(metadata)
        assert doc is not None
        dataset, encoder, split = (doc["source"][k] for k in ("dataset", "encoder", "split"))
        with FeatureClient(source, token=token) as client:
            try:  # a bag split's metadata comes with its listing; a dense split's from its info route
                bags = client.split_kinds(dataset, encoder).get(split) == "bags"
                now = client.bags(dataset, encoder, split).metadata if bags else client.info(dataset, encoder, split)
            except (DatasetNotFound, EncoderNotFound, SplitNotFound):
                now = None
        return lineage.stale_reason(doc, now)
    except FeatureStoreError as error:  # a damaged lineage: its rows cannot be vouched for either
        return " ".join(str(error).split())
