"""A loader's epochs as a training loop drives them: set_epoch after a `break`, an iterator made and
dropped unstarted, a checkpoint of one cross-validation fold offered to another, and bad states."""

from __future__ import annotations

import gc
import threading

import pytest
from _bag_loader_fixtures import LENGTHS
from _bag_loader_fixtures import bag_store  # noqa: F401  (a fixture, used by name)

from client import BagDataset, BagLoader
from featurestore.errors import InvalidOption

pytestmark = pytest.mark.filterwarnings("ignore:1 empty bag")  # the cohort's slide without patches


def _loader(store: str, **options: object) -> BagLoader:
    ds = BagDataset(store, "cohort", "enc-float32", "all")
    return BagLoader(ds, device="cpu", batch_size=2, seed=3, **options)  # type: ignore[arg-type]


def test_set_epoch_after_a_break_starts_the_count_again(bag_store: str) -> None:
    """A steps-per-epoch loop: 2 batches, `break`, set_epoch(1), checkpoint. The state said batch 3
    of epoch 1, so a resume skipped 3 batches epoch 1 never gave."""
    loader = _loader(bag_store)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    loader.set_epoch(1)
    state = loader.state_dict()
    assert (state["epoch"], state["batch"]) == (1, 0), state
    resumed = _loader(bag_store)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == len(resumed)  # the whole of epoch 1


def test_an_iterator_dropped_unstarted_holds_no_threads(bag_store: str) -> None:
    """iter(loader) then an error before the first next(): its prefetch threads started at iter()
    and, the generator never having run, no `finally` ever stopped them (40 after 10 loaders)."""
    before = sum("prefetch" in t.name for t in threading.enumerate())
    for _ in range(5):
        loader = _loader(bag_store, prefetch=3, num_threads=2)
        it = iter(loader)
        del it, loader
    gc.collect()
    assert sum("prefetch" in t.name for t in threading.enumerate()) == before


def test_a_fold_s_checkpoint_does_not_resume_another_fold(bag_store: str) -> None:
    half = len(LENGTHS) // 2
    first = _loader(bag_store, indices=range(0, half))
    it = iter(first)
    next(it)
    state = first.state_dict()
    it.close()
    other = _loader(bag_store, indices=range(half, 2 * half))  # as many bags, other ones
    with pytest.raises(InvalidOption, match="cannot resume: the state has indices="):
        other.load_state_dict(state)
    same = _loader(bag_store, indices=range(0, half))
    same.load_state_dict(state)
    same.load_state_dict({**state, "indices": half})  # a state saved before indices were recorded by value


def test_bad_epochs_and_states_are_refused(bag_store: str) -> None:
    loader = _loader(bag_store)
    with pytest.raises(InvalidOption, match="non-negative integer, but got: True"):
        loader.set_epoch(True)
    with pytest.raises(InvalidOption, match=f"state\\['batch'\\] is 999, but this loader's epochs have {len(loader)}"):
        loader.load_state_dict({**loader.state_dict(), "batch": 999})
