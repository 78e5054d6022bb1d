"""A kind of split is a first-class concept: a third kind, defined here in a few lines, goes
through the one lifecycle (create, refuse, resume, overwrite, mark) and the one verify
dispatcher without copying either (featurestore.core.lifecycle, featurestore.core.kinds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from featurestore import open_store
from featurestore.core import kinds, lifecycle, seals
from featurestore.core.array_check import Expected, check_array, check_seals
from featurestore.core.split_kind import Findings, SplitKind
from featurestore.core.storage import Storage
from featurestore.core.verify import verify_store
from featurestore.errors import ReadOnlyStore, SplitExists, WrongSplitKind
from featurestore.format import layout, metadata
from featurestore.format.metadata import COMPLETE, SplitMetadata
from featurestore.format.seals import generation_of

KEY = "ds/enc/toy"


class ToyWriter:
    """Writes one int64 array as ``features`` and seals it at commit."""

    def __init__(self, storage: Storage, meta: SplitMetadata) -> None:
        self.storage, self.meta = storage, meta

    def put(self, values: np.ndarray) -> None:
        seals.put_array(self.storage, f"{KEY}/{layout.FEATURES}", values.astype(np.int64))

    def commit(self) -> SplitMetadata:
        seals.write_seals(self.storage, KEY, self.meta, (layout.FEATURES,))
        self.meta = self.meta.replace(status=COMPLETE)
        lifecycle.write_split_document(self.storage, KEY, self.meta)
        return self.meta


class ToyKind(SplitKind[ToyWriter]):
    name = "toy"

    def new_metadata(self, n: int) -> SplitMetadata:
        return SplitMetadata.new(dataset="ds", encoder_name="enc", split="toy", num_samples=n, sample_shape=(1,),
                                 logical_dtype="float32", chunk_rows=n).replace(kind=self.name)

    def check_resumable(self, meta: SplitMetadata, wanted: SplitMetadata, key: str) -> None:
        assert meta.num_samples == wanted.num_samples

    def create(self, storage: Storage, key: str, meta: SplitMetadata, **options: Any) -> ToyWriter:
        return ToyWriter(storage, meta)

    def resume(self, storage: Storage, key: str, meta: SplitMetadata, *, verify_chunks: bool,
               **options: Any) -> ToyWriter:
        return ToyWriter(storage, meta)

    def verify(self, storage: Storage, key: str, meta: SplitMetadata, found: Findings) -> None:
        crcs: dict[str, list[int | None]] = {}
        check_array(storage, key, layout.FEATURES, Expected([meta.num_samples], "int64", np.dtype(np.int64)),
                    found, crcs=crcs)
        if layout.FEATURES in crcs:
            check_seals(storage, key, generation_of(meta), crcs, found, {layout.FEATURES: 1})


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> ToyKind:
    kind = ToyKind()
    monkeypatch.setattr(metadata, "KINDS", (*metadata.KINDS, kind.name))
    monkeypatch.setitem(kinds.REGISTRY, kind.name, kind)
    return kind


def _open(store: Any, kind: ToyKind, n: int = 5, **flags: bool) -> ToyWriter:
    flags = {"resume": False, "overwrite": False, "verify_chunks": False, **flags}
    return lifecycle.open_writer(store.storage, store.url, store.mode, KEY, kind, kind.new_metadata(n), **flags)


def test_a_third_kind_goes_through_the_lifecycle_and_verify(tmp_path: Path, toy: ToyKind) -> None:
    store = open_store(str(tmp_path), mode="a")
    writer = _open(store, toy)
    assert store.split_info("ds", "enc", "toy").status == "writing"  # the group document went first
    writer.put(np.arange(5))
    first = writer.commit()
    assert store.split_kind("ds", "enc", "toy") == "toy" and store.split_status("ds", "enc", "toy") == "complete"
    with pytest.raises(SplitExists, match="pass resume=True"):
        _open(store, toy)
    assert _open(store, toy, resume=True).meta.generation == first.generation
    with pytest.raises(WrongSplitKind, match="is a 'toy' split, not a dense split"):
        store.create_split("ds", "enc", "toy", num_samples=5, sample_shape=(1,), resume=True)
    with pytest.raises(WrongSplitKind, match="open it with"):
        store.open("ds", "enc", "toy")
    check = verify_store(store)
    assert [(c.key, c.status, c.problems) for c in check.checks] == [(KEY, "complete", [])]
    chunk = tmp_path / KEY / "features" / "c" / "0"
    chunk.write_bytes(seals_swapped(chunk.read_bytes()))
    assert verify_store(store).checks[0].problems == [
        f"{KEY}/features/c/0: crc32c {int.from_bytes(chunk.read_bytes()[-4:], 'little'):08x}, but the commit "
        f"sealed {int(seals.read_table(store.storage, KEY)[0, 2]):08x} for it (a chunk rewritten with a valid "
        "crc32c or copied from another run of the split)"]
    replaced = _open(store, toy, overwrite=True)
    assert replaced.meta.generation != first.generation and not chunk.exists()
    with pytest.raises(ReadOnlyStore):
        _open(open_store(str(tmp_path)), toy, resume=True)


def seals_swapped(raw: bytes) -> bytes:
    """Another value with a valid crc32c of its own: only the seal says it is wrong."""
    from featurestore.format import chunks

    payload = np.frombuffer(raw[:-4], "<i8")[::-1].tobytes()
    return payload + chunks.crc_bytes(payload)
