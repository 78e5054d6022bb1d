"""``featurestore probe --head abmil --save-attention NAME``: the trained head's attention over
each evaluated bag's patches, kept in the store beside the bag split it was computed on.

The gated-attention head (featurestore.probes.abmil) gives each patch of a bag a weight
``a_k`` (softmax over the bag); pathologists read it as where the model looked. A
:class:`AttentionRecorder` takes those weights from the evaluation passes of one seed (the run's
first): every fold's held-out bags with ``--folds K`` (each bag once), every bag of ``--eval
SPLIT`` otherwise. Evaluation reads whole bags one at a time in position order (empty bags left
out, as ``BagLoader`` does), so the k-th batch is the k-th evaluated bag; each batch is checked
against that bag's length all the same. :meth:`AttentionRecorder.save` writes the map under the
evaluated split with its lineage (format: featurestore.format.attention, docs/FORMAT.md
"Attention maps"), refusing if the split changed while the probe ran. The web page shows it
(docs/SERVER.md); featurestore.core.bag_attention reads it.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from featurestore.errors import InvalidOption, ShapeMismatch, SplitChanged
from featurestore.format import attention, chunks, layout
from featurestore.format.names import validate_name
from featurestore.format.redact import redact_url

__all__ = ["AttentionRecorder"]

_CHUNK_BYTES = 8 << 20
# Settings of the probe run kept in a map's lineage (the rest of the run's result is metrics).
_PROBE_KEYS = ("dataset", "encoder", "dtype", "train_split", "eval_split", "folds", "group_by", "task", "num_classes",
               "device", "loader", "batch_size", "max_patches", "config", "seeds")


class AttentionRecorder:
    """Attention of the bags one probe run evaluates (``evaluated``: the ``client.BagDataset`` of
    the evaluated split), for map ``name``; written to ``source`` by :meth:`save`."""

    def __init__(self, name: str, evaluated: Any, *, source: str, storage_options: dict[str, Any] | None = None,
                 fold_seed: int | None = None, labels: dict[str, str] | None = None) -> None:
        self.name = validate_name(name, "attention map name (--save-attention)")
        if str(source).startswith(("http://", "https://")):
            raise InvalidOption(f"--save-attention writes into the store, which {redact_url(source)} only serves: "
                                "run the probe on the store's path or URL (s3://..., a directory)")
        self.ds = evaluated
        self.source, self.storage_options = str(source), dict(storage_options or {})
        self.fold_seed = fold_seed
        self.labels = labels  # the task's table and columns (probes.labels.task_record); None: the stored labels
        lengths = np.asarray(evaluated.lengths, np.int64)
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.values = np.full(int(self.offsets[-1]), np.nan, np.float32)
        self.fold = np.full(len(lengths), attention.NOT_EVALUATED, np.int32)
        self.seed: int | None = None

    def sink(self, seed: int, fold: int, eval_positions: Sequence[int] | np.ndarray | None
             ) -> Callable[[Any, Any], None] | None:
        """The ``attention_sink`` for ``train_abmil`` on one fold of one seed: None except for the
        first seed the run trains (one seed's attention is the map; its seed is in the lineage)."""
        if self.seed is None:
            self.seed = int(seed)
        if int(seed) != self.seed:
            return None
        pool = range(len(self.lengths)) if eval_positions is None else (int(i) for i in eval_positions)
        order = iter([i for i in pool if self.lengths[i] > 0])

        def take(weights: Any, mask: Any) -> None:
            weights = weights.detach().float().cpu().numpy()
            mask = mask.detach().cpu().numpy().astype(bool)
            for row, keep in zip(weights, mask):
                i = next(order, None)
                values = row[keep]
                if i is None or len(values) != self.lengths[i]:
                    raise ShapeMismatch(
                        f"--save-attention: an evaluation batch of {len(values)} patches does not match the next "
                        f"evaluated bag ({'none left' if i is None else f'{self.lengths[i]} patches'}): evaluation "
                        "must read whole bags one at a time in order")
                self.values[self.offsets[i] : self.offsets[i + 1]] = values
                self.fold[i] = fold

        return take

    def save(self, result: dict[str, Any]) -> dict[str, Any]:
        """Write the map beside the evaluated split (``result``: the probe run's result, whose
        settings join the lineage); returns ``{"name", "key", "bags", "patches", "seed"}``."""
        from featurestore import __version__, open_store

        ds = self.ds
        store = open_store(self.source, mode="a", **self.storage_options)
        split_key = layout.split_key(ds.dataset, ds.encoder, ds.split)
        now = store.split_metadata(ds.dataset, ds.encoder, ds.split)
        if attention.split_state(now) != attention.split_state(ds.metadata):
            raise SplitChanged(f"bag split {split_key} changed while the probe ran (generation "
                               f"{ds.metadata.get('generation')} -> {now.get('generation')}): attention map "
                               f"{self.name!r} not saved; run the probe again")
        probe = {"head": "abmil", **{k: result.get(k) for k in _PROBE_KEYS}, "seed": self.seed,
                 "fold_seed": self.fold_seed if result.get("folds") else None,
                 "metrics": _metrics_of(result, self.seed), "source": redact_url(self.source), "labels": self.labels}
        doc = attention.lineage(name=self.name, split_key=split_key, metadata=ds.metadata, probe=probe,
                                created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                creator_version=__version__)
        storage = store.storage
        group = attention.group_key(split_key)
        key = attention.group_key(split_key, self.name)
        # The map's document goes last, and first when replacing one: a map without it is not
        # listed, so a save cut short never shows half a map.
        _delete_key(storage, f"{key}/{layout.ZARR_JSON}")
        storage.delete_tree(key)
        if not storage.exists(f"{group}/{layout.ZARR_JSON}"):
            storage.write(f"{group}/{layout.ZARR_JSON}", layout.group_document(
                {"featurestore": {"kind": "attention-maps"}}))
        _put(storage, f"{key}/{attention.VALUES}", self.values,
             "one attention weight per patch of the split (bag i: offsets[i]:offsets[i+1]); NaN: bag not evaluated")
        _put(storage, f"{key}/{attention.FOLD}", self.fold,
             "the fold that evaluated each bag (0 with an eval split); -1: not evaluated")
        storage.write(f"{key}/{layout.ZARR_JSON}", layout.group_document({"featurestore": doc}))
        evaluated = int((self.fold != attention.NOT_EVALUATED).sum())
        return {"name": self.name, "key": key, "bags": evaluated, "patches": int(np.isfinite(self.values).sum()),
                "seed": self.seed}


def _metrics_of(result: dict[str, Any], seed: int | None) -> dict[str, float] | None:
    seeds, runs = result.get("seeds") or [], result.get("runs") or []
    for s, run in zip(seeds, runs):
        if s == seed:
            return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in run.items()}
    return None


def _put(storage: Any, array_key: str, values: np.ndarray, description: str) -> None:
    """A 1-D array in the store's own chunk encoding (raw little-endian + crc32c), any Zarr v3 reader's."""
    values = np.ascontiguousarray(values, values.dtype.newbyteorder("<"))
    rows = max(1, min(max(1, len(values)), _CHUNK_BYTES // values.dtype.itemsize))
    storage.write(f"{array_key}/{layout.ZARR_JSON}", layout.array_document(
        shape=values.shape, chunk_rows=rows, data_type=values.dtype.name,
        attributes={"featurestore": {"description": description}}))
    for index in range(layout.num_chunks(len(values), rows)):
        part = values[index * rows : (index + 1) * rows]
        if len(part) < rows:  # edge chunks at full shape, as zarr writes them
            part = np.concatenate([part, np.zeros(rows - len(part), values.dtype)])
        storage.write_sealed(layout.chunk_key(array_key, index, 1), chunks.encode(part, None))


def _delete_key(storage: Any, key: str) -> None:
    path = storage.local_path(key)
    if path is None:
        storage.delete_tree(key)  # object storage: removes the object at the key itself
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
