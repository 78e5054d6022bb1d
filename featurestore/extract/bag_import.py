"""``featurestore import DIR`` for per-slide files: one bag per slide, streaming and resumable.

Chosen by :func:`featurestore.extract.importer.import_cache` when the source directory holds
per-slide feature files (featurestore.extract.slide_files). Every file's header is checked
first (features dataset, one dim, coords of the features' length, attributes JSON can hold) and
the ``--labels`` table read whole (featurestore.extract.label_csv: a label for each slide, the
other columns as bag attributes), so a malformed file or table stops the import before anything
is written. Then slides go to the bag writer one at a time (host RAM: two bags, the next is read
meanwhile), in name order, skipping the ids already complete (``--resume``, or a re-run; a file
of a kept bag modified since the split was created stops it with InputChanged, as for dense
imports). A file that fails while being read (a truncated h5, NaN in its rows) stops the import
with one line naming it; the bags already added are kept (the writer is closed, not committed).
The run's steps (create or resume, the slides to add, commit) are extract.dist_run's.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from featurestore.errors import DtypeMismatch, Float16Overflow, InvalidLabels, NonFiniteValues, ShapeMismatch
from featurestore.extract.dist_run import SplitJob, left_out, progress_bar
from featurestore.extract.import_types import ImportOptions, ImportResult
from featurestore.extract.input_check import refuse_changed_files
from featurestore.extract.label_csv import read_label_table
from featurestore.extract.plan import resolve_dtype
from featurestore.extract.slide_files import PT_SUFFIXES, Slide, SlideFileError, SlideFiles

__all__ = ["BagImport"]


class BagImport(SplitJob):
    """The bag import as a :func:`~featurestore.extract.dist_run.run_split` job: units are slides."""

    def __init__(self, opts: ImportOptions, files: SlideFiles) -> None:
        super().__init__(opts)
        self.files = files
        self.labels: dict[str, Any] | None = None
        self.table_attrs: dict[str, dict[str, Any]] | None = None
        self.notes = _hidden_note(files) + _unpaired_note(files)

    def load(self) -> None:
        opts, files = self.opts, self.files
        headers = [files.header(slide) for slide in files.slides]
        if files.dropped:  # a .pt dict's coords and the like: not imported, said so
            first_key, where = next(iter(files.dropped.items()))
            self.notes.append(f"the .pt files are dicts: only their 'features' are imported; not their "
                              f"{', '.join(repr(k) for k in files.dropped)} (first: {first_key!r} in {where!r}). "
                              "Import coordinates from per-slide h5 files (CLAM's h5_files)")
        first = headers[0]
        for slide, header in zip(files.slides, headers):
            if header.dim != first.dim:
                raise SlideFileError(f"{slide.path!r} has features of dim {header.dim}, but {files.slides[0].path!r} "
                                     f"has {first.dim}: one bag split holds one encoder's features (split the directory)")
            if header.coords != first.coords or header.unit != first.unit:
                raise SlideFileError(f"{slide.path!r} has {'coords in ' + header.unit if header.coords else 'no coords'}, "
                                     f"but {files.slides[0].path!r} has {'coords in ' + first.unit if first.coords else 'no coords'}: "
                                     "one bag split has one coordinate convention")
        label_names, label_digest, columns = None, None, None
        if opts.labels:
            table = read_label_table(opts.labels, [s.bag_id for s in files.slides], opts.label_column or "label",
                                     opts.id_column or "slide_id")
            self.labels, label_names, label_digest, self.table_attrs = table.labels, table.names, table.digest, table.attrs
            _refuse_reserved(opts.labels, next(iter(table.attrs.values()), {}))
            columns = table.columns
            if table.unused:
                self.notes.append(f"labels CSV: {len(table.unused)} row(s) name no slide in {files.directory!r} "
                                  f"(first: {table.unused[0]!r}): left out")
        elif opts.label_column is not None or opts.id_column is not None:
            raise InvalidLabels("--label-column/--id-column name columns of the --labels CSV: pass --labels too")
        self.settings = files.settings(first, files.slides[0])
        self.dim, self.dtype = first.dim, resolve_dtype(opts.dtype, first.dtype)
        self.label_dtype = "int64" if label_names is not None else None
        fingerprint = {"source": files.fingerprint(), "labels": label_digest}
        cache_key = hashlib.sha256(json.dumps({"import-bags": fingerprint, "dtype": self.dtype, **self.settings},
                                              sort_keys=True).encode()).hexdigest()
        self.metadata: dict[str, Any] = {
            "encoder": {"name": opts.encoder_name, "spec": f"import:{files.spec}", "weights_hash": None,
                        "output_dtype": first.dtype, "precision": None},
            "source_dtype": first.dtype,
            "cache_key": cache_key,
            "source": {"spec": files.spec, "format": f"slide-{files.kind}", "fingerprint": fingerprint,
                       "num_bags": len(files), "labels": opts.labels and os.path.abspath(opts.labels)},
        }
        if columns:  # the table's other columns, kept as bag attributes: an export writes them back
            self.metadata["source"]["table_columns"] = columns
            # and the two it read the ids and labels from: an export names its labels.csv columns after
            # them where a kept column is named slide_id or label (bag_export.csv_columns)
            self.metadata["source"].update(id_column=opts.id_column or "slide_id",
                                           label_column=opts.label_column or "label")
        if label_names is not None:
            self.metadata["label_names"] = label_names

    def create(self, *, resume: bool, overwrite: bool) -> Any:
        opts = self.opts
        return self.store.create_bag_split(
            opts.dataset, opts.encoder_name, opts.split, dim=self.dim, dtype=self.dtype, metadata=self.metadata,
            resume=resume, overwrite=overwrite, label_dtype=self.label_dtype,
            chunk_bytes=int(opts.chunk_mb * (1 << 20)), verify_chunks=opts.verify_chunks, **self.settings)

    def check_kept(self, writer: Any) -> None:
        # bags kept from an earlier run must still match their files (extract.input_check)
        slides = self.files.slides
        refuse_changed_files([s.path for s in slides], [s.bag_id for s in slides], writer, self.key)

    def units(self, writer: Any) -> list[tuple[int, Slide]]:
        done = writer.done_ids
        return [(i, slide) for i, slide in enumerate(self.files.slides) if slide.bag_id not in done]

    def unit_id(self, unit: Slide) -> str:
        return unit.bag_id

    def missing_from(self, writer: Any, meta: dict[str, Any]) -> list[str]:
        gone = left_out(meta)  # failed for good by --worker runs
        return [slide.bag_id for _, slide in self.units(writer) if slide.bag_id not in gone]

    def work(self, writer: Any, mine: list[Slide]) -> int:
        return _copy(self.files, writer, mine, self.labels, self.table_attrs, self.opts)

    def result(self, progress: list[int] | None, metadata: dict[str, Any], wall_seconds: float) -> ImportResult:
        if progress is None:
            return ImportResult("already-complete", self.key, len(self.files), metadata=metadata, notes=self.notes)
        return ImportResult("complete", self.key, len(self.files), sum(progress), wall_seconds, metadata, self.notes)


def _copy(files: SlideFiles, writer: Any, pending: list[Slide], labels: dict[str, Any] | None,
          table_attrs: dict[str, dict[str, Any]] | None, opts: ImportOptions) -> int:
    """Add ``pending`` in name order; the next slide is read on a thread while this one is added
    (two slides in RAM at most)."""
    from concurrent.futures import ThreadPoolExecutor

    bar = progress_bar(opts, len(pending), "slide", "import")
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="featurestore-slide") as reader:
            ahead = reader.submit(files.read, pending[0]) if pending else None
            for k, slide in enumerate(pending):
                assert ahead is not None
                features, coords, attrs = ahead.result()
                ahead = reader.submit(files.read, pending[k + 1]) if k + 1 < len(pending) else None
                if coords is not None and len(coords) != len(features):
                    raise SlideFileError(f"{slide.path!r}: coords of {len(coords)} rows for {len(features)} feature rows")
                if table_attrs is not None:
                    attrs.update(table_attrs[slide.bag_id])
                try:
                    writer.add_bag(slide.bag_id, features, coords=coords,
                                   label=None if labels is None else labels[slide.bag_id], attrs=attrs)
                except (NonFiniteValues, Float16Overflow, DtypeMismatch, ShapeMismatch) as error:
                    raise _refused_slide(slide, features, error) from None
                del features, coords
                bar.update(1)
    except BaseException:
        writer.close()  # the complete bags stay: a rerun with --resume goes on from them
        raise
    finally:
        bar.close()
    return len(pending)


# Bag attributes an import sets from the slide file: a CSV column of the same name would replace them.
_FILE_ATTRS = ("source_file", "root", "features", "feats", "coords")


def _refuse_reserved(path: str, columns: dict[str, Any]) -> None:
    clash = sorted(set(columns) & set(_FILE_ATTRS))
    if clash:
        raise InvalidLabels(f"labels CSV {path!r} has a column {clash[0]!r}, the name of a bag attribute the import "
                            f"takes from the slide file ({', '.join(_FILE_ATTRS)}): rename the column")


def _unpaired_note(files: SlideFiles) -> list[str]:
    """A CLAM job is imported from its ``h5_files`` (features and coords); slides that have a
    ``pt_files`` file but no h5 (a run cut short between its two writes) are named, not dropped
    unseen."""
    if os.path.basename(files.directory) != "h5_files":
        return []
    pt_dir = os.path.join(os.path.dirname(files.directory), "pt_files")
    try:
        pt = {os.path.splitext(n)[0] for n in os.listdir(pt_dir)
              if n.lower().endswith(PT_SUFFIXES) and not n.startswith(".")}
    except OSError:
        return []
    alone = sorted(pt - {slide.bag_id for slide in files.slides})
    if not alone:
        return []
    return [f"{len(alone)} slide(s) of {pt_dir!r} have no h5 file in h5_files (first: {alone[0]!r}): not imported "
            "(the h5 files hold the coordinates); import pt_files alone for features without coordinates"]


def _hidden_note(files: SlideFiles) -> list[str]:
    if not files.hidden:
        return []
    return [f"left out {len(files.hidden)} hidden file(s) in {files.directory!r} (names starting with '.', e.g. "
            f"{files.hidden[0]!r}: macOS resource forks are named so): rename a slide's file to import it"]


def _refused_slide(slide: Any, features: Any, error: Exception) -> Exception:
    """A slide add_bag refused, named by its file, with the advice an import can follow."""
    from featurestore.core.bag_writer import non_finite_rows

    where = non_finite_rows(features) if isinstance(error, NonFiniteValues) else None
    # not --resume: the directory's files (names, sizes) are in the cache key, and they change
    then = "then rerun with --overwrite (the split's cache key covers the directory's files)"
    if where is not None:
        return NonFiniteValues(f"{slide.path!r} (bag {slide.bag_id!r}): {where}: featurestore does not store "
                               f"non-finite values; re-extract the slide's features or move the file out of the "
                               f"directory, {then}")
    return type(error)(f"{slide.path!r}: {error}; to import without this slide, move its file out of the "
                       f"directory, {then}")
