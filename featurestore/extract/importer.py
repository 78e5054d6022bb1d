"""``featurestore import``: an existing feature cache -> a split, streaming and resumable; this
module checks the options and picks the import the source needs.

Caches people already hold, read without loading them whole. Dense caches go to
extract/dense_import.py (readers: extract/caches.py):

- a **directory** with one ``.pt`` or ``.npy`` file per sample (eva's embeddings layout), in
  natural name order (``2.pt`` before ``10.pt``); the file stems become the sample ids;
- an **HDF5 file** (THUNDER-style; needs h5py) with one ``[N, ...]`` dataset, or one dataset per
  sample (in a group, natural name order, names -> ids);
- a **tensor file**: ``torch.save`` of one ``[N, ...]`` tensor (the ``torch.cat`` cache of a probe),
  memory-mapped (``torch.load(mmap=True)``), or a ``.npy`` ``[N, ...]`` array (``mmap_mode="r"``).

A directory of **per-slide files** (TRIDENT/CLAM/STAMP ``.h5``, CLAM ``pt_files/``) becomes a bag
split, one bag per slide (extract/bag_import.py, readers in extract/slide_files.py).
"""

from __future__ import annotations

import os

from featurestore.errors import SourceError
from featurestore.extract.bag_import import BagImport
from featurestore.extract.dense_import import DenseImport
from featurestore.extract.dist_run import run_split
from featurestore.extract.import_types import ImportOptions, ImportResult
from featurestore.extract.plan import check_chunk_mb
from featurestore.extract.slide_files import SlideFiles, find_slides, slide_directories_below
from featurestore.format.names import validate_name

__all__ = ["ImportOptions", "ImportResult", "import_cache"]


def import_cache(opts: ImportOptions) -> ImportResult:
    """Bring the cache at ``opts.source`` in as a split; raises FeatureStoreError on bad input."""
    for value, what in ((opts.dataset, "dataset"), (opts.encoder_name, "encoder name"), (opts.split, "split")):
        validate_name(value, what)
    if opts.batch_size < 1:
        raise SourceError(f"--batch-size must be a positive integer, but got: {opts.batch_size}")
    if opts.resume and opts.overwrite:
        raise SourceError("--resume and --overwrite exclude each other: choose one")
    check_chunk_mb(opts.chunk_mb)
    slides = find_slides(opts.source, force=opts.bags)
    if slides is not None:  # per-slide files (TRIDENT, CLAM, STAMP): one bag per file
        if opts.worker is not None:
            from featurestore.extract.workers_share import ClaimShare

            return run_split(BagImport(opts, SlideFiles(*slides)), share=ClaimShare(opts.worker))
        return run_split(BagImport(opts, SlideFiles(*slides)))
    if opts.worker is not None:
        if not os.path.exists(opts.source):
            raise SourceError(f"source {opts.source!r} does not exist: give the directory of per-slide .h5 or .pt "
                              "files the workers share")
        raise SourceError(f"--worker shares the slides of a bag split, but {opts.source!r} is not a directory of "
                          "per-slide files: import it without --worker")
    if opts.bags:
        raise SourceError(f"--bags: {opts.source!r} is not a directory of per-slide .h5 or .pt files")
    _refuse_a_parent_of_slide_directories(opts.source)
    if opts.label_column is not None or opts.id_column is not None:
        raise SourceError(f"--label-column/--id-column name columns of a slide-bags labels CSV, but {opts.source!r} "
                          "is not a directory of per-slide files: leave them out")
    return run_split(DenseImport(opts))


def _refuse_a_parent_of_slide_directories(source: str) -> None:
    """A directory without feature files of its own, above per-slide directories (a TRIDENT job's
    ``20x_256px/`` holds one ``features_<encoder>/`` per encoder): name them, one split each."""
    if not os.path.isdir(source) or any(n.endswith((".pt", ".npy")) for n in os.listdir(source)):
        return
    below = slide_directories_below(source)
    if below:
        shown = ", ".join(f"{path}/ ({count} slide files)" for path, count in below[:5])
        more = f" and {len(below) - 5} more" if len(below) > 5 else ""
        raise SourceError(f"directory {source!r} holds no feature files itself; per-slide files are in {shown}{more}: "
                          "import one of those directories (one split per encoder)")
