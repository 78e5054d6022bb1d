"""The bag part of ``featurestore bench s3``: BagLoader epochs over a bag split in object storage,
without and through a chunk cache, against the chunks' whole-object ceiling and one ``.pt`` object
per slide; GB/s of the split's float16 feature bytes.
"""

from __future__ import annotations

import io
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from featurestore.bench.harness import gbps
from featurestore.bench.s3_cache import evict_cold, fetch_whole, remove_cache

CEILING = "bags ceiling (whole chunks, 8 GETs)"
USERS = "bags, .pt per slide (4 in flight)"
NO_CACHE = "bag loader, no cache (ranged GETs)"
EPOCH1 = "bag loader, cache epoch 1 (empty)"
EPOCH2 = "bag loader, cache epoch 2 (cold files)"
FIGURES = (CEILING, USERS, NO_CACHE, EPOCH1, EPOCH2)


class BagEpochs:
    """Bag epochs over ``url``: the methods above, one call each per repeat (:meth:`methods`)."""

    def __init__(self, url: str, options: dict[str, Any], *, bags: int, median: int, dim: int, prefetch: int,
                 workdir: str | None = None) -> None:
        import torch

        import featurestore
        from featurestore.core.storage.obstore import ObjectStorage
        from featurestore.demo.synthetic_bags import bag_lengths, io_bags

        self.url, self.options, self.prefetch = url, dict(options), prefetch
        self.lengths = bag_lengths(median, count=bags)
        self.work = tempfile.mkdtemp(prefix="featurestore-s3bags-", dir=workdir)
        writer = featurestore.open_store(url, mode="a", **options).create_bag_split(
            "bench", "enc", "bags", dim=dim, dtype="float16", overwrite=True, label_dtype="int64")
        self.slides = ObjectStorage(f"{url}/pt_files", options)
        for bag_id, features, coords, label in io_bags(self.lengths, dim):
            writer.add_bag(bag_id, features, coords=coords, label=label)
            buffer = io.BytesIO()
            torch.save(torch.from_numpy(features), buffer)
            self.slides.write(f"{bag_id}.pt", buffer.getvalue())
        writer.commit()
        split = featurestore.open_store(url, **options).open_bags("bench", "enc", "bags")
        self.nbytes = int(self.lengths.sum()) * dim * 2
        self.keys = split.features.chunk_keys() + split.coords.chunk_keys()
        self.storage = split.features.storage
        print(f"[s3] bags: {bags} slides, {int(self.lengths.sum())} patches x {dim} float16 "
              f"({self.nbytes / 1e6:.0f} MB), median {median} patches, {len(self.keys) // 2} chunks per array")

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.work, ignore_errors=True)

    def methods(self, epoch2: list[float]) -> dict[str, Callable[[], float]]:
        """Figure name -> a call that runs it once and returns GB/s; the cache's epoch 1 call
        appends its epoch 2 to ``epoch2``."""
        def cache_epoch1() -> float:
            first, second = self.cache_epochs()
            epoch2.append(second)
            return first

        return {CEILING: self.ceiling, USERS: self.users_way, NO_CACHE: self.no_cache, EPOCH1: cache_epoch1}

    def ceiling(self) -> float:
        t0 = time.perf_counter()
        fetch_whole(self.storage.obstore, self.keys)
        return gbps(self.nbytes, time.perf_counter() - t0)

    def users_way(self) -> float:
        import torch

        order = np.random.default_rng(int(time.time())).permutation(len(self.lengths))

        def load(i: int) -> int:
            data = self.slides.read(f"slide-{i:05d}.pt")
            return torch.load(io.BytesIO(data), weights_only=True).shape[0]

        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            rows = sum(pool.map(load, order.tolist()))
        assert rows == int(self.lengths.sum())
        return gbps(self.nbytes, time.perf_counter() - t0)

    def _loader(self, options: dict[str, Any]) -> Any:
        from client import BagDataset, BagLoader

        ds = BagDataset(self.url, "bench", "enc", "bags", storage_options=options)
        return BagLoader(ds, batch_size=1, shuffle=True, seed=int(time.time()), device="cpu", dtype=None,
                         prefetch=self.prefetch)

    def _epoch(self, loader: Any, epoch: int) -> float:
        loader.set_epoch(epoch)
        t0, rows = time.perf_counter(), 0
        for batch in loader:
            rows += int(batch[0].shape[-2])
        assert rows == int(self.lengths.sum())
        return gbps(self.nbytes, time.perf_counter() - t0)

    def no_cache(self) -> float:
        loader = self._loader(self.options)
        speed = self._epoch(loader, 0)
        loader.close()
        return speed

    def cache_epochs(self) -> tuple[float, float]:
        directory = tempfile.mkdtemp(prefix="cache-", dir=self.work)
        loader = self._loader({**self.options, "cache_dir": directory})
        first = self._epoch(loader, 0)
        evict_cold(directory)
        second = self._epoch(loader, 1)
        loader.close()
        remove_cache(directory)
        return first, second


def ratios(median: dict[str, float]) -> dict[str, float]:
    return {
        "bags_cache_epoch1_vs_ceiling": median[EPOCH1] / median[CEILING],
        "bags_cache_epoch1_vs_pt_per_slide": median[EPOCH1] / median[USERS],
        "bags_cache_epoch2_vs_pt_per_slide": median[EPOCH2] / median[USERS],
        "bags_no_cache_vs_pt_per_slide": median[NO_CACHE] / median[USERS],
    }

