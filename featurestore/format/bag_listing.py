"""The listing of a bag split on the wire: what ``GET`` ``wire.BAGS`` answers (one page of its
bags, and what a client needs to read one), shared by the server's bag routes and the client."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from featurestore.format.dtypes import storage_dtype
from featurestore.format.wire import WireFormatError, json_safe, wire_dtype


@dataclass(frozen=True)
class BagsListing:
    """What ``GET`` :data:`BAGS` answers: a bag split's bags (one page of them) and what a client
    needs to read one (dtypes, dim, the byte cap) in one request.

    ``ids``, ``lengths`` (patches per bag, int64), ``labels`` (or None) and ``attrs`` (per-bag
    slide attributes, only when asked for with ``?attrs=true``) hold the bags
    ``offset .. offset + len(ids)`` of ``count``; :meth:`extend` joins pages.
    """

    ids: list[str]
    lengths: np.ndarray
    labels: list[Any] | None
    dim: int
    dtype: str
    coords_dtype: str
    coords_unit: str | None
    max_response_bytes: int
    count: int
    offset: int = 0
    attrs: list[dict[str, Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def generation(self) -> str | None:
        value = self.metadata.get("generation")
        return None if value is None else str(value)

    @property
    def next_offset(self) -> int | None:
        """Where the next page starts, or None on the last page."""
        end = self.offset + len(self.ids)
        return end if end < self.count else None

    @property
    def row_nbytes(self) -> int:
        """Bytes of one patch on the wire: its features and its coordinates."""
        return self.dim * storage_dtype(self.dtype).itemsize + 2 * storage_dtype(self.coords_dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        doc = {
            "count": self.count, "offset": self.offset, "next_offset": self.next_offset,
            "ids": list(self.ids), "lengths": [int(n) for n in self.lengths],
            "labels": None if self.labels is None else json_safe(list(self.labels)),
            "dim": self.dim, "dtype": self.dtype, "coords_dtype": self.coords_dtype,
            "coords_unit": self.coords_unit, "max_response_bytes": self.max_response_bytes,
            "generation": self.generation, "metadata": json_safe(self.metadata),
        }  # fmt: skip
        if self.attrs is not None:
            doc["attrs"] = json_safe(self.attrs)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BagsListing:
        try:
            ids = [str(i) for i in doc["ids"]]
            lengths = np.asarray(doc["lengths"], dtype=np.int64).reshape(-1)
            labels, attrs = doc.get("labels"), doc.get("attrs")
            listing = cls(
                ids=ids, lengths=lengths, labels=None if labels is None else list(labels),
                dim=int(doc["dim"]), dtype=str(doc["dtype"]), coords_dtype=str(doc["coords_dtype"]),
                coords_unit=None if doc.get("coords_unit") is None else str(doc["coords_unit"]),
                max_response_bytes=int(doc["max_response_bytes"]),
                count=int(doc["count"]), offset=int(doc.get("offset", 0)),
                attrs=None if attrs is None else [dict(a) for a in attrs],
                metadata=dict(doc.get("metadata") or {}),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as error:
            raise WireFormatError(f"bad bag listing: {error!r}") from error
        wire_dtype(listing.dtype)
        wire_dtype(listing.coords_dtype)
        sizes = {len(ids), len(lengths)} | ({len(listing.labels)} if listing.labels is not None else set())
        if len(sizes) != 1 or listing.offset + len(ids) > listing.count or (lengths < 0).any():
            raise WireFormatError("bad bag listing: ids, lengths and labels disagree in number")
        return listing

    def extend(self, page: BagsListing) -> BagsListing:
        """This listing followed by the next ``page`` (refused if the split changed meanwhile)."""
        if page.offset != self.offset + len(self.ids) or page.generation != self.generation:
            raise WireFormatError("the bag split changed between listing pages: list it again")
        labels = None if self.labels is None or page.labels is None else self.labels + page.labels
        attrs = None if self.attrs is None or page.attrs is None else self.attrs + page.attrs
        return replace(self, ids=self.ids + page.ids, lengths=np.concatenate([self.lengths, page.lengths]),
                       labels=labels, attrs=attrs)  # fmt: skip


__all__ = ["BagsListing"]
