"""ArrayReader: the one interface every reader of a stored array implements.

Implemented by :class:`featurestore.core.reader.FeatureArray` (local memory maps and positional
reads, object-storage ranged reads, zarr-decoded compressed arrays) and by
``client.remote.RemoteFeatureArray`` (HTTP). ``FeatureDataset`` and ``FeatureLoader`` use only
these members, so any reader that conforms works under them. ``tests/reader_contract.py`` holds
the one contract suite every implementation runs (every order, duplicates, empty, out of range,
labels, bfloat16).

Index semantics (all readers): ``indices`` is any 1-D integer sequence (list, tuple, numpy,
torch; a scalar counts as one row), any order, duplicates allowed, empty allowed; a non-integer
or multi-dimensional index raises :class:`~featurestore.errors.InvalidIndices`, an index outside
``[0, len)`` raises :class:`~featurestore.errors.IndexOutOfRange` naming it, and ``out`` of the
wrong shape or dtype raises :class:`~featurestore.errors.ShapeMismatch`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ArrayReader(Protocol):
    """Rows of one stored array (``features`` or ``labels``) of a split."""

    name: str
    """``"features"`` or ``"labels"``."""
    shape: tuple[int, ...]
    """``(num_samples, *sample_shape)``."""
    sample_shape: tuple[int, ...]
    dtype: str
    """The logical dtype (``"float16"``, ``"bfloat16"``, ``"float32"``, label dtypes)."""
    numpy_dtype: np.dtype[Any]
    """The dtype of ``read_numpy``'s output: uint16 bits for bfloat16."""
    sample_nbytes: int
    chunk_rows: int
    metadata: dict[str, Any]
    """The split's metadata document."""
    labels: ArrayReader | None
    """The split's labels reader (features readers only; None without labels)."""

    def __len__(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def ids(self) -> list[str] | None: ...

    def read(self, indices: Any) -> Any:
        """Rows as a torch tensor of the logical dtype (torch imported lazily)."""

    def read_numpy(self, indices: Any, out: np.ndarray | None = None) -> np.ndarray:
        """Rows in ``numpy_dtype``; into ``out`` (C-contiguous, exact shape and dtype) when given."""

    def read_range(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (``0 <= start <= stop <= len``) as ``read_numpy`` returns them."""


@runtime_checkable
class BagReader(Protocol):
    """The bags of one bag split (docs/FORMAT.md, "Slide bags").

    Implemented by :class:`featurestore.core.bag_array.BagArray` (local and object storage); an HTTP
    reader implements the same members, so a bag loader works on either. ``tests/bag_contract.py``
    is the contract suite. A bag is named by its position in ``ids`` (int) or its id (str); an
    unknown id raises :class:`~featurestore.errors.BagNotFound`, a position outside ``[0, len)``
    :class:`~featurestore.errors.IndexOutOfRange`.
    """

    ids: list[str]
    """Bag ids in stored (id) order."""
    lengths: np.ndarray
    """Rows (patches) per bag, int64 ``[len]``."""
    labels: np.ndarray | None
    dim: int
    dtype: str
    """The features' logical dtype."""
    metadata: dict[str, Any]

    def __len__(self) -> int: ...

    def index(self, bag_id: str) -> int: ...

    def attrs(self, i_or_id: int | str) -> dict[str, Any]: ...

    def read(self, i_or_id: int | str, rows: Any = None) -> tuple[Any, Any]:
        """``(features [n, dim] torch tensor of the logical dtype, coords [n, 2])``."""

    def read_numpy(self, i_or_id: int | str, rows: Any = None, out: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``(features, coords)`` in storage dtypes (bfloat16 as uint16 bits); ``rows``: positions
        within the bag; ``out``: a C-contiguous ``[len(rows) or n, dim]`` buffer for the features."""
