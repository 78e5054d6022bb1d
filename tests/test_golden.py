"""Stores written by an earlier version of featurestore still read, bit for bit.

``tests/golden/v2-2026-11`` was written by ``tests/golden/make_golden.py`` with the code of that
day (dense and bag splits in float32, float16 and bfloat16; ids, labels, coords, attributes, an
empty bag, a channel with large activations). Whatever the code's layout becomes, these stores
are on users' disks: they must open, verify clean and give back exactly the values written.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import featurestore

HERE = Path(__file__).parent / "golden"
sys.path.insert(0, str(HERE))
import make_golden  # noqa: E402

GOLDEN = HERE / "v2-2026-11"


def _stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """The bits a writer stores for float32 ``values`` in ``dtype`` (bfloat16 as uint16 bits)."""
    if dtype == "bfloat16":
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)
    return values.astype(dtype)


@pytest.fixture(scope="module")
def store() -> featurestore.FeatureStore:
    return featurestore.open_store(str(GOLDEN), mode="r")


@pytest.mark.parametrize("dtype", make_golden.DTYPES)
def test_dense_split_reads_bit_identically(store, dtype: str) -> None:
    feats, labels, ids = make_golden.dense_values(dtype)
    arr = store.open("golden", f"dense-{dtype}", "train")
    assert arr.dtype == dtype and arr.shape == feats.shape and arr.ids == ids
    got = arr.read_numpy(np.arange(len(feats)))
    assert got.tobytes() == _stored(feats, dtype).tobytes()
    shuffled = np.random.default_rng(0).permutation(len(feats))
    assert arr.read_numpy(shuffled).tobytes() == _stored(feats, dtype)[shuffled].tobytes()
    assert np.array_equal(arr.labels.read_numpy(np.arange(len(feats))), labels)
    assert arr.metadata["cache_key"] == f"golden-dense-{dtype}"


@pytest.mark.parametrize("dtype", make_golden.DTYPES)
def test_bag_split_reads_bit_identically(store, dtype: str) -> None:
    expected = make_golden.bag_values(dtype)
    bags = store.open_bags("golden", f"bags-{dtype}", "train")
    assert bags.ids == sorted(b[0] for b in expected) and bags.dtype == dtype
    assert bags.patch_size_level0 == 256
    for bag_id, feats, coords, label, attrs in expected:
        f, c = bags.read_numpy(bag_id)
        assert f.tobytes() == _stored(feats, dtype).tobytes(), bag_id
        assert np.array_equal(c, coords) and c.dtype == np.int64
        assert bags.label(bag_id) == label
        assert {k: v for k, v in bags.attrs(bag_id).items() if k in attrs} == attrs


def test_golden_stores_verify_clean(tmp_path: Path) -> None:
    """``featurestore verify`` (every chunk against its seals) passes on a copy of the stores."""
    from featurestore.cli import main

    copy = tmp_path / "golden"
    shutil.copytree(GOLDEN, copy)
    assert main(["verify", str(copy)]) == 0


def _digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in GOLDEN.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(GOLDEN)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def test_golden_files_are_the_ones_written_then() -> None:
    """The stores were not rewritten by a later generator: a reader change must read these."""
    assert _digest() == (HERE / "v2-2026-11.sha256").read_text().split()[0]


if __name__ == "__main__":  # prints the digest, after a deliberate regeneration only
    print(_digest(), GOLDEN.name)
