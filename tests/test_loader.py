"""FeatureLoader (and the DataLoader drop-in) against in-RAM tensors, over local, S3 and HTTP.

The ``TestSourceSuite`` tests run once per source (``_loader_fixtures.source``): a local
directory (memory-mapped), the moto S3 server (ranged reads) and a live uvicorn server (HTTP).
Batches are compared bit for bit against indexing an in-RAM float32 tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _loader_fixtures import DATASET, ENCODER, NUM_SAMPLES, SAMPLE_SHAPE, Source
from _loader_fixtures import (  # noqa: F401  (fixtures are used by name)
    http_url,
    local_store,
    s3_store,
    seaweed_store,
    source,
)
from _loader_checks import _bits, _check_reproducible, _epoch, _randperm_batches, _ref

from client import FeatureDataset, FeatureLoader, sampling


# ---------------------------------------------------------------------- the suite, per source
class TestSourceSuite:
    def _ds(self, source: Source, split: str = "f32") -> FeatureDataset:
        return FeatureDataset(source.url, DATASET, ENCODER, split, **source.kwargs)

    def test_user_randperm_sampler_is_bit_identical_to_ram_tensor(self, source: Source) -> None:
        ref_x, ref_y = _ref()
        batches = _randperm_batches(NUM_SAMPLES, 32, seed=7)
        loader = FeatureLoader(self._ds(source), batch_sampler=batches, device="cpu", dtype=torch.float32)
        got = _epoch(loader)
        assert len(got) == len(batches) == len(loader)
        for (features, labels), index in zip(got, batches):
            assert features.dtype == torch.float32 and labels.dtype == torch.int64
            assert torch.equal(_bits(features), _bits(ref_x[index]))
            assert torch.equal(labels, ref_y[index])

    def test_float16_store_upcasts_exactly(self, source: Source) -> None:
        ref_x, ref_y = _ref()
        expected = ref_x.to(torch.float16).to(torch.float32)  # what float16 storage holds, widened
        batches = _randperm_batches(NUM_SAMPLES, 50, seed=3)
        loader = FeatureLoader(self._ds(source, "f16"), batch_sampler=batches, device="cpu")
        for (features, labels), index in zip(loader, batches):
            assert features.dtype == torch.float32
            assert torch.equal(_bits(features), _bits(expected[index]))
            assert labels.dtype == torch.int64 and torch.equal(labels, ref_y[index])  # uint8 widened

    def test_plain_dataloader_two_workers_covers_every_sample_once(self, source: Source) -> None:
        ref_x, ref_y = _ref()
        ds = self._ds(source)
        loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)
        batches = list(loader)
        features = torch.cat([f for f, _ in batches])
        labels = torch.cat([y for _, y in batches])
        assert features.shape == (NUM_SAMPLES, *SAMPLE_SHAPE) and features.dtype == torch.float32
        # Features identify samples (random floats): map each row back to its index.
        where = {float(v): i for i, v in enumerate(ref_x[:, 0, 0])}
        index = [where[float(v)] for v in features[:, 0, 0]]
        assert sorted(index) == list(range(NUM_SAMPLES))
        assert torch.equal(features, ref_x[index])
        assert labels.shape == (NUM_SAMPLES,) and torch.equal(torch.sort(labels).values, torch.sort(ref_y).values)

    def test_shuffle_is_reproducible_from_seed_and_epoch(self, source: Source) -> None:
        # The default shuffle; "block" is covered locally by test_explicit_orders_are_reproducible.
        _check_reproducible(self._ds(source), "auto")

    def test_shuffle_true_is_a_uniform_permutation_on_every_source(self, source: Source) -> None:
        # No silent switch to the chunk-local block order on S3 or HTTP.
        ds = self._ds(source)
        loader = FeatureLoader(ds, batch_size=16, shuffle=True, seed=3, device="cpu")
        assert loader.order == "shuffle"
        expected = sampling.epoch_order(NUM_SAMPLES, "shuffle", seed=3, epoch=0)
        assert np.array_equal(loader.plan().indices, expected)
        features = torch.cat([f for f, _ in loader])
        assert torch.equal(features, _ref()[0][expected])
        # Uniform, not chunk-local: the first batch spans many of the 13 chunks.
        assert len(set((expected[:16] // ds.chunk_rows).tolist())) > 4

    def test_mid_epoch_resume_yields_exactly_the_remaining_batches(self, source: Source) -> None:
        ds = self._ds(source)
        full = FeatureLoader(ds, batch_size=16, seed=11, device="cpu")
        full.set_epoch(2)
        expected = _epoch(full)
        first = FeatureLoader(ds, batch_size=16, seed=11, device="cpu")
        first.set_epoch(2)
        for k, _ in enumerate(first):
            if k == 4:
                state = first.state_dict()
                break
        assert state["epoch"] == 2 and state["batch"] == 5
        resumed = FeatureLoader(ds, batch_size=16, seed=11, device="cpu")
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # a training loop calls this again on resume: the offset must stay
        rest = _epoch(resumed)
        assert len(rest) == len(expected) - 5
        for (f, y), (ef, ey) in zip(rest, expected[5:]):
            assert torch.equal(f, ef) and torch.equal(y, ey)
        assert resumed.state_dict()["batch"] == 0  # the next pass is a whole epoch again

    @pytest.mark.parametrize("world_size", [2, 3])
    @pytest.mark.parametrize("drop_last", [False, True])
    def test_ddp_partition_covers_every_sample_with_equal_batch_counts(
        self, source: Source, world_size: int, drop_last: bool
    ) -> None:
        ds = self._ds(source)
        ref_x, _ = _ref()
        where = {float(v): i for i, v in enumerate(ref_x[:, 0, 0])}
        counts, seen = [], []
        for rank in range(world_size):
            loader = FeatureLoader(ds, batch_size=16, seed=2, device="cpu", rank=rank, world_size=world_size,
                                   drop_last=drop_last)
            batches = _epoch(loader)
            assert len(batches) == len(loader)
            counts.append(len(batches))
            seen += [where[float(v)] for f, _ in batches for v in f[:, 0, 0]]
        assert len(set(counts)) == 1, counts
        if drop_last:
            assert len(seen) == len(set(seen))  # nothing twice
            per_rank = NUM_SAMPLES // world_size
            assert len(seen) == world_size * (per_rank // 16) * 16
        else:
            assert set(seen) == set(range(NUM_SAMPLES))  # everything, padding wraps around
            assert len(seen) == -(-NUM_SAMPLES // world_size) * world_size

    def test_dataset_pickles_without_reader_and_reopens(self, source: Source) -> None:
        import pickle

        ds = self._ds(source)
        ds[0]  # this process now holds an open reader (maps, fsspec session or HTTP client)
        clone = pickle.loads(pickle.dumps(ds))
        assert clone._reader is None and clone.read_path == ds.read_path
        assert torch.equal(clone[3][0], _ref()[0][3])
        if source.kind == "http":
            with pytest.raises(ValueError, match="storage_options"):
                FeatureDataset(source.url, DATASET, ENCODER, "f32", storage_options={"anon": True})

    def test_split_without_labels_yields_minus_one(self, source: Source) -> None:
        loader = FeatureLoader(self._ds(source, "nolabels"), batch_size=64, shuffle=False, device="cpu")
        ref_x, _ = _ref()
        batches = _epoch(loader)
        assert torch.equal(torch.cat([f for f, _ in batches]), ref_x)
        labels = torch.cat([y for _, y in batches])
        assert labels.dtype == torch.int64 and bool((labels == -1).all())
