"""Whether a derived split is stale: its lineage (featurestore.format.lineage) against its source
split's metadata as it is on storage now.

The one staleness check of ``verify``, ``ls``/``info``, ``status``, the web page, the server's response
header, ``embed --resume`` and a probe's report: each calls :func:`stale_reason` with the derived
split's metadata (a probe over HTTP compares the lineage with the source's metadata the server
gives, :mod:`client.stale`). :func:`stale_fix` is the one way forward they print.
"""

from __future__ import annotations

import warnings
from typing import Any

from featurestore.errors import DatasetNotFound, EncoderNotFound, FeatureStoreError, SplitNotFound, StaleSplitWarning
from featurestore.format import lineage
from featurestore.format.lineage import RECOMPUTE, RECOMPUTE_IT


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
    except FeatureStoreError as error:  # a damaged lineage: its fix is stale_fix's, not repeated here
        text = " ".join(str(error).split()).removesuffix(f": {RECOMPUTE_IT}")
        return text.encode("ascii", "replace").decode()


def stale_fix(reason: str, key: str | None = None, store: str | None = None) -> str:
    """The way forward for the derived split ``key`` (of ``store``) that is stale for ``reason``
    (:func:`stale_reason`): the one text of verify, status, info, export and the client's warning.
    The embed command that made it, run again (with ``--resume``), recomputes it whole; a source that
    is gone must be written again first (else that command fails: no such split), or the stale split
    removed."""
    gone = lineage.gone_source(reason)
    if gone is not None:
        dataset, encoder, split = (gone.split("/") + ["", "", ""])[:3]
        return (f"write {gone} again (featurestore import or extract ... --dataset {dataset} --encoder-name "
                f"{encoder} --split {split}), then compute this split again ({RECOMPUTE}); or remove this split "
                f"(featurestore rm {store or 'STORE'} {key or 'DATASET/ENCODER/SPLIT'})")
    if lineage.REWRITTEN in reason:
        return f"once its source is complete again, compute this split again ({RECOMPUTE})"
    return RECOMPUTE_IT


def warn_stale(name: str, reason: str, stacklevel: int) -> None:
    """The :class:`StaleSplitWarning` a client gives when it opens the stale split ``name``
    (``stacklevel``: counted from the caller of this function's caller, as ``warnings.warn``'s)."""
    warnings.warn(f"{name} is stale: {reason}; its rows describe the old source: {stale_fix(reason, name)}",
                  StaleSplitWarning, stacklevel=stacklevel + 1)
