"""A framed response body (arrays back to back, each described by its own shape and dtype
headers) copied into its output arrays: ``FeatureClient``'s data calls and ``read_ids`` share it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

__all__ = ["fill_views"]


def fill_views(chunks: Iterator[bytes], targets: list[memoryview]) -> None:
    """Copy a body arriving in ``chunks`` into ``targets`` back to back; exact length."""
    total = sum(t.nbytes for t in targets)
    which, filled, seen = 0, 0, 0
    for chunk in chunks:
        view = memoryview(chunk)
        seen += view.nbytes
        if seen > total:
            raise httpx.RemoteProtocolError("response body longer than its shape headers say")
        while view.nbytes:
            target = targets[which]
            take = min(view.nbytes, target.nbytes - filled)
            target[filled : filled + take] = view[:take]
            filled += take
            view = view[take:]
            if filled == target.nbytes and which + 1 < len(targets):
                which, filled = which + 1, 0
    if seen != total:
        raise httpx.RemoteProtocolError(f"body of {seen} bytes, expected {total}")
