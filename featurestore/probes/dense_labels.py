"""The labels a dense probe trains and scores on: the stored ones or a table's, and their chance.

- :func:`table_labels`: a label table (:mod:`featurestore.probes.labels`) matched to a dense
  split's sample ids (an embedding split from ``featurestore embed`` has the slide ids);
- :class:`TableBatches`: ``(features, labels)`` batches of the labelled samples only, with the
  table's labels: a ``FeatureLoader`` over a batch sampler of those rows (the same uniform
  shuffle as ``FeatureLoader(order="shuffle")``, so a table that repeats the stored labels trains
  the same probe), or an in-RAM :class:`~featurestore.probes.train.TensorLoader`;
- :func:`stored_labels`, :func:`read_all`: a split's stored class ids; the whole split in RAM;
- :func:`dense_baselines`: the chance baselines of a dense probe's metrics on its evaluation
  labels (:mod:`featurestore.probes.chance`), with the one-class refusal for the linear probe.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from featurestore.errors import InvalidLabels, MissingLabels
from featurestore.probes import chance
from featurestore.probes.labels import LabelTable, Matched

__all__ = ["TableBatches", "dense_baselines", "read_all", "stored_labels", "table_labels"]

_BLOCK_VALUES = 1 << 22  # label values read at a time (class maps are large: 32 MiB as int64)


def table_labels(info: Any, table: LabelTable) -> Matched:
    """``table``'s labels for the samples of ``info`` (a ``SplitInfo``), by its sample ids."""
    ids = info.ds.array.ids
    if ids is None:
        raise MissingLabels(f"split {info.name} has no sample ids, so the labels table {table.path} cannot be matched "
                            "to it: --labels works on bag splits and on dense splits with ids (featurestore embed)")
    if info.label_shape is not None and len(info.label_shape) >= 2:
        raise InvalidLabels(f"split {info.name} holds class maps (seg): a labels table gives one label per slide, "
                            "for --head linear or abmil")
    return table.match(ids, info.name, "samples")  # an embedding split's: slides, or patients (--group-by)


class _RowBatches:
    """Batches of ``positions`` for a ``FeatureLoader``'s ``batch_sampler``: uniform shuffle (or
    in order), a pure function of ``(seed, epoch)`` as the loader's own orders are."""

    def __init__(self, positions: np.ndarray, batch_size: int, shuffle: bool, seed: int) -> None:
        self.positions, self.batch_size, self.shuffle, self.seed = positions, batch_size, shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self, epoch: int) -> list[np.ndarray]:
        from client.sampling import epoch_order

        order = self.positions[epoch_order(len(self.positions), "shuffle" if self.shuffle else "sequential",
                                           seed=self.seed, epoch=epoch)]
        return [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]

    def __len__(self) -> int:
        return -(-len(self.positions) // self.batch_size)

    def __iter__(self) -> Iterator[np.ndarray]:
        return iter(self.batches(self.epoch))


class TableBatches:
    """``(features, labels)`` of the samples a table labels, with its labels (module doc)."""

    def __init__(self, info: Any, matched: Matched, *, batch_size: int, shuffle: bool, seed: int, device: Any,
                 held: tuple[Any, Any] | None = None) -> None:
        import torch

        self.matched, self.device = matched, device
        self.rows = _RowBatches(matched.positions, batch_size, shuffle, seed)
        if held is not None:  # loader="ram": the split's features already in RAM
            from featurestore.probes.train import TensorLoader

            index = torch.from_numpy(matched.positions)
            self.loader: Any = TensorLoader(held[0][index], torch.from_numpy(matched.labels[matched.positions]),
                                            batch_size=batch_size, shuffle=shuffle, seed=seed, device=device)
            self.ram = True
        else:
            from client import FeatureLoader

            self.loader = FeatureLoader(info.ds, batch_sampler=self.rows, device=device, dtype=torch.float32)
            self.ram = False

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        import torch

        if self.ram:
            yield from self.loader
            return
        for index, (features, _stored) in zip(self.rows.batches(self.loader.epoch), self.loader):
            yield features, torch.from_numpy(self.matched.labels[index]).to(features.device)


def dense_baselines(train: Any, evaluate: Any, task: str, num_classes: int,
                    matched: tuple[Matched, Matched] | None) -> dict[str, float]:
    """The chance baselines of a dense probe on ``evaluate``'s labels (the table's when given);
    the linear probe's train and eval labels must hold 2 classes."""
    if task == "seg":
        return {"jaccard": chance.seg_baseline(_label_blocks(evaluate), num_classes)}
    labels = []
    for info, picked in zip((train, evaluate), matched or (None, None)):
        if picked is None:
            values = np.concatenate([np.empty(0, np.int64), *(b.reshape(-1) for b in _label_blocks(info))])
        else:
            values = picked.labels[picked.positions]
        chance.check_two_classes(values.reshape(-1), f"split {info.name}",
                                 "a probe needs samples of each class (--labels CSV --label-column COL takes "
                                 "another task's labels)", None if picked is None else picked.names)
        labels.append(values)
    return chance.class_baselines([labels[1]])


def _label_blocks(info: Any) -> Iterator[np.ndarray]:
    labels = info.ds.array.labels
    rows = max(1, _BLOCK_VALUES // max(1, int(np.prod(info.label_shape or ()))))
    for start in range(0, info.num_samples, rows):
        yield np.asarray(labels.read_range(start, min(start + rows, info.num_samples)))


def stored_labels(info: Any) -> np.ndarray:
    """The stored class ids of every sample of ``info`` (one per sample), as int64."""
    if info.label_shape is None:
        raise MissingLabels(f"split {info.name} has no labels: store them, or give --labels CSV --label-column COL")
    values = np.concatenate([np.empty(0, np.int64), *(b.reshape(-1) for b in _label_blocks(info))])
    if len(values) != info.num_samples:
        raise InvalidLabels(f"split {info.name} has labels of shape {list(info.label_shape)}: folds need one class id "
                            "per sample")
    return values.astype(np.int64)


def read_all(info: Any) -> tuple[Any, Any]:
    """The whole split as float32 features + labels in host RAM (``loader="ram"``).

    This is the cache featurestore replaces; it is here to show that streaming trains the same probe.
    """
    import torch

    array = info.ds.array
    features = torch.empty((info.num_samples, *info.sample_shape), dtype=torch.float32)
    labels = (torch.full((info.num_samples,), -1, dtype=torch.int64) if array.labels is None
              else torch.from_numpy(array.labels.read_range(0, info.num_samples)))
    for start in range(0, info.num_samples, 256):
        stop = min(start + 256, info.num_samples)
        features[start:stop] = array.read(list(range(start, stop))).to(torch.float32)
    return features, labels
