"""A split overwritten while a real ``featurestore serve`` process serves it, on a local
store and on S3 (the SeaweedFS fixture): raw readers see only 200 or the retryable 409 (never a
404 or a 500 "the store is damaged"), and ``FeatureClient`` reads straight through it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("uvicorn")

import featurestore  # noqa: E402
from featurestore.errors import SplitChanged
from client import FeatureClient  # noqa: E402
from featurestore.testing.serving import serve_subprocess  # noqa: E402
from featurestore.format import wire  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _server_fixtures import values  # noqa: E402

N, SHAPE, CHUNK_ROWS = 64, (16,), 8  # 8 chunks: an overwrite deletes and rewrites each
SPLIT = "/v1/features/pannuke/tiny/s"
SECONDS = 4.0


def _write(store: Any, generation: int) -> None:
    """Generation g holds row i = i + g + k/8 (exact in float32), so any row names its writer."""
    writer = store.create_split("pannuke", "tiny", "s", num_samples=N, sample_shape=SHAPE,
                                dtype="float32", chunk_rows=CHUNK_ROWS, overwrite=True)  # fmt: skip
    writer.write(0, values(N, SHAPE, offset=generation))
    writer.commit()


def _check_rows(rows: np.ndarray, index: np.ndarray) -> None:
    """Every row is row ``index`` of some whole generation (never torn, never another row)."""
    offsets = rows[:, 0] - index
    for row, i, offset in zip(rows, index, offsets, strict=True):
        np.testing.assert_array_equal(row, values(1, SHAPE, offset=int(i + offset))[0])


def _overwrite_while_reading(url: str, options: dict[str, Any], env: dict[str, str]) -> None:
    store = featurestore.open_store(url, mode="a", **options)
    _write(store, 0)
    stop = threading.Event()
    statuses: list[tuple[int, str]] = []
    client_reads: list[int] = []
    failures: list[BaseException] = []

    def raw_reader(served: str) -> None:
        index = np.arange(3, N, 5)
        with httpx.Client(base_url=served, timeout=30) as http:
            while not stop.is_set():
                for response in (
                    http.get(f"{SPLIT}/batch", params={"start": "0", "stop": str(N)}),
                    http.post(f"{SPLIT}/batch", content=wire.encode_indices(index),
                              headers={"Content-Type": wire.INDICES}),  # fmt: skip
                    http.get(f"{SPLIT}/items/7"),
                ):
                    status, detail = response.status_code, ""
                    if status != 200:
                        body = response.json()
                        detail = f"{body.get('error')}: {body.get('detail')}"
                        if status == 409 and response.headers.get("retry-after") != "1":
                            status = -409  # a 409 that does not say "retry": counted as bad
                    statuses.append((status, detail))

    def client_reader(served: str) -> None:
        index = np.arange(N)[::-3].copy()
        try:
            with FeatureClient(served, retries=0) as fc:
                while not stop.is_set():
                    try:
                        rows = fc.read_numpy("pannuke", "tiny", "s", index)
                    except SplitChanged:  # overwritten under each of its tries: the honest answer, never a mix
                        continue
                    _check_rows(rows, index)
                    client_reads.append(1)
        except BaseException as error:  # reported below, with the statuses
            failures.append(error)

    with serve_subprocess(url, env={"FEATURESTORE_STORAGE_OPTIONS": json.dumps(options), **env}) as (served, _):
        with FeatureClient(served) as fc:  # the server has served the split complete
            _check_rows(fc.read_numpy("pannuke", "tiny", "s", np.arange(N)), np.arange(N))
        threads = [threading.Thread(target=raw_reader, args=(served,)) for _ in range(2)]
        threads.append(threading.Thread(target=client_reader, args=(served,)))
        for thread in threads:
            thread.start()
        generation = 0
        deadline = time.monotonic() + SECONDS
        try:
            while time.monotonic() < deadline:
                generation += 1
                _write(store, generation % 100)
                time.sleep(0.02)  # room for reads of a complete split between overwrites
        finally:
            time.sleep(0.5)
            stop.set()
            for thread in threads:
                thread.join(timeout=120)
    bad = [s for s in statuses if s[0] not in (200, 409)]
    print(f"\n{generation} overwrites, {len(statuses)} raw reads "
          f"({sum(s == 409 for s, _ in statuses)} x 409), {len(client_reads)} FeatureClient reads")  # fmt: skip
    assert not bad, bad[:5]
    assert not failures, failures
    assert generation >= 2 and client_reads and any(s == 200 for s, _ in statuses)


def test_local_overwrite_is_200_or_retryable_409(tmp_path: Any) -> None:
    _overwrite_while_reading(str(tmp_path / "store"), {}, {})


def test_s3_overwrite_is_200_or_retryable_409(seaweed: Any, seaweed_url: str) -> None:
    _overwrite_while_reading(seaweed_url, dict(seaweed.storage_options), {})


def test_a_reader_of_a_split_overwritten_with_fewer_rows_gets_split_changed(tmp_path: Any) -> None:
    """An HTTP reader opened before an overwrite that shrank the split: its rows beyond the new
    end were answered 416, an IndexOutOfRange for indices it had checked (the 416 carries no
    generation); now SplitChanged, as for any other overwrite."""
    from fastapi.testclient import TestClient

    from server import Settings, create_app

    root = str(tmp_path / "store")
    _write(featurestore.open_store(root, mode="a"), 0)
    with TestClient(create_app(root, Settings())) as http:
        client = FeatureClient("http://testserver", http_client=http)
        arr = client.open("pannuke", "tiny", "s")
        np.testing.assert_array_equal(arr.read_numpy([N - 1, 2]), values(N, SHAPE, offset=0)[[N - 1, 2]])
        writer = featurestore.open_store(root, mode="a").create_split(
            "pannuke", "tiny", "s", num_samples=N // 2, sample_shape=SHAPE, dtype="float32", chunk_rows=CHUNK_ROWS,
            overwrite=True)
        writer.write(0, values(N // 2, SHAPE, offset=1))
        writer.commit()
        with pytest.raises(SplitChanged, match=f"fewer rows than the {N} this reader opened"):
            arr.read_numpy([N - 1, 2])
        with pytest.raises(SplitChanged):
            arr.read_into([N - 1], np.empty((1, *SHAPE), np.float32), np.empty((1,), np.int64))
        fresh = client.open("pannuke", "tiny", "s")  # opened again: the new split
        assert len(fresh) == N // 2


@pytest.mark.parametrize("change", ["shrunk", "gone"])
def test_a_bag_reader_of_a_split_overwritten_under_it_gets_split_changed(tmp_path: Any, change: str) -> None:
    """A held bag reader whose bag shrank (or went) in an overwrite got IndexOutOfRange for rows
    it never asked for (0:516 from its old listing), and a by-name read failed the same way; now
    the held reader says SplitChanged and the by-name read reads the split as it is now."""
    from fastapi.testclient import TestClient

    from server import Settings, create_app

    root = str(tmp_path / "store")
    rng = np.random.default_rng(0)

    def write(lengths: dict[str, int], overwrite: bool) -> dict[str, np.ndarray]:
        writer = featurestore.open_store(root, mode="a").create_bag_split("d", "e", "b", dim=8, overwrite=overwrite)
        bags = {name: rng.standard_normal((n, 8)).astype(np.float16) for name, n in lengths.items()}
        for name, features in bags.items():
            writer.add_bag(name, features)
        writer.commit()
        return bags

    write({"slide-1": 40, "slide-2": 516}, overwrite=False)
    with TestClient(create_app(root, Settings())) as http:
        client = FeatureClient("http://testserver", http_client=http)
        assert client.read_bag_numpy("d", "e", "b", "slide-2")[0].shape == (516, 8)  # the listing is cached
        held = client.open_bags("d", "e", "b")
        now = write({"slide-1": 40, **({"slide-2": 501} if change == "shrunk" else {"slide-3": 9})}, overwrite=True)
        with pytest.raises(SplitChanged, match="overwritten since it was opened"):
            held.read_numpy("slide-2")
        if change == "shrunk":
            np.testing.assert_array_equal(client.read_bag_numpy("d", "e", "b", "slide-2")[0], now["slide-2"])
