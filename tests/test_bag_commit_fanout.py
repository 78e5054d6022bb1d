"""A bag split's commit asks the store about its segments many at a time: a ``--worker`` split
has a segment per slide, and each costs a few listings and reads (tens of milliseconds each on
an object store), which one after another made a 10,000-slide commit take most of an hour."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from featurestore import open_store
from featurestore.core import bag_commit, split_protocol
from featurestore.core.storage import LocalStorage


class SlowLists(LocalStorage):
    """Local storage whose listings take 5 ms, counting how many run at once."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.lock, self.now, self.most = threading.Lock(), 0, 0

    def listdir(self, prefix: str) -> list[str]:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(0.005)
            return super().listdir(prefix)
        finally:
            with self.lock:
                self.now -= 1


def test_a_commit_lists_its_segments_many_at_a_time_and_lays_out_the_same_bags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEATURESTORE_PUT_THREADS", "4")
    store = open_store(str(tmp_path), mode="a")
    writer = store.create_bag_split("ds", "enc", "s", dim=8, chunk_bytes=4 * 8 * 2)
    rng = np.random.default_rng(0)
    bags = {f"slide-{i:02d}": rng.standard_normal((1 + i % 7, 8)).astype(np.float32) for i in range(24)}
    for bag_id, features in reversed(bags.items()):  # a session per bag, as --worker writes them
        session = writer.session()
        session.add_bag(bag_id, features, coords=np.arange(2 * len(features)).reshape(-1, 2))
        session.close()
    slow = SlowLists(str(tmp_path))
    key = "ds/enc/s"
    found = bag_commit.collect(slow, key, split_protocol.stored_metadata(slow, key))
    assert sorted(found.records) == sorted(bags) and len(found.segments) == 24
    assert slow.most > 1, "the segments were listed one after another"
    slow.most = 0
    bag_commit.commit(slow, key, split_protocol.stored_metadata(slow, key))
    assert slow.most > 1
    split = store.open_bags("ds", "enc", "s")
    assert split.ids == sorted(bags)
    for bag_id, features in bags.items():
        np.testing.assert_array_equal(split.read_numpy(bag_id)[0], features.astype(np.float16))


def test_in_flight_keeps_the_order_bounds_what_waits_and_raises_where_an_item_failed() -> None:
    class Hinted:
        put_threads = 3

    started: list[int] = []

    def slow(i: int) -> Any:
        started.append(i)
        time.sleep(0.002 * (i % 4))
        if i == 9:
            raise ValueError("item 9")
        return i * i

    results = bag_commit.in_flight(Hinted(), slow, range(20))  # type: ignore[arg-type]
    assert [next(results) for _ in range(9)] == [i * i for i in range(9)]
    assert max(started) < 9 + 2 * 3 + 1  # no more than twice the workers ahead of the one taken
    with pytest.raises(ValueError, match="item 9"):
        next(results)
    ran = len(started)
    time.sleep(0.05)
    assert len(started) == ran <= 9 + 2 * 3 + 1  # nothing queued behind the failure starts after it
    assert list(bag_commit.in_flight(Hinted(), slow, [])) == []
