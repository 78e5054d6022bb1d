"""One root error, precise subclasses that also inherit the matching builtin.

Every message names the offending value and says how to fix it; the CLI prints ``str(error)`` as
its single stderr line, and the HTTP server maps each class to one status code (see
``server/errors.py``), so the class is the contract, not the wording.
"""

from __future__ import annotations

# The one repair advice for damage (a CorruptChunk or MissingChunks of a complete split): every
# message that reports damage ends with it, and what it names does repair. ``--resume`` alone on
# a complete split checks only sizes and seals (it does not read the chunks); ``--verify-chunks``
# re-reads every chunk (crc32c, seal, and the features against their statistics row, as
# `featurestore verify` does) and rewrites each damaged one from the input before committing.
REPAIR_ADVICE = (
    "run `featurestore verify` on the store, then repair the split with the command that wrote it "
    "plus --resume --verify-chunks (`featurestore extract ...` or `featurestore import ...`), which "
    "rewrites the damaged chunks from the input"
)


class FeatureStoreError(Exception):
    """Root of every error featurestore raises on purpose."""


class InvalidName(FeatureStoreError, ValueError):
    """A dataset, encoder or split name outside ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``."""


class StoreNotFound(FeatureStoreError, FileNotFoundError):
    """The store URL holds no featurestore root."""


class BucketNotFound(FeatureStoreError, LookupError):
    """The object-storage bucket (or container) in the store URL does not exist. Not a
    ``FileNotFoundError``: code that treats a missing key as "absent" must not swallow it."""


class InvalidStorageOptions(FeatureStoreError, ValueError):
    """A ``storage_options`` key or value the object-storage backend does not understand."""


class StorageAccessDenied(FeatureStoreError, PermissionError):
    """Object storage refused the credentials (wrong key/secret, expired token, no permission)."""


class StorageUnavailable(FeatureStoreError, ConnectionError):
    """Object storage did not answer (or kept failing) through every retry."""


class NotAFeatureStore(FeatureStoreError, ValueError):
    """The URL holds something, but not a featurestore root group."""


class UnsupportedFormatVersion(FeatureStoreError, ValueError):
    """The store was written by a newer, incompatible featurestore."""


class DatasetNotFound(FeatureStoreError, LookupError):
    pass


class EncoderNotFound(FeatureStoreError, LookupError):
    pass


class SplitNotFound(FeatureStoreError, LookupError):
    pass


class IncompleteSplit(FeatureStoreError, RuntimeError):
    """The split's status is not ``complete`` (still writing, or the writer died)."""


class SplitExists(FeatureStoreError, FileExistsError):
    """``create_split`` on an existing split without ``resume=True`` or ``overwrite=True``."""


class ReadOnlyStore(FeatureStoreError, PermissionError):
    """A write on a store opened with ``mode="r"``."""


class IndexOutOfRange(FeatureStoreError, IndexError):
    pass


class ShapeMismatch(FeatureStoreError, ValueError):
    pass


class DtypeMismatch(FeatureStoreError, TypeError):
    pass


class Float16Overflow(FeatureStoreError, OverflowError):
    """A value beyond +-65504 would be stored as float16."""


class NonFiniteValues(FeatureStoreError, ValueError):
    """NaN or Inf in the values to store."""


class CorruptChunk(FeatureStoreError, IOError):
    """A chunk whose size or crc32c does not match."""


class SplitChanged(FeatureStoreError, RuntimeError):
    """A split was overwritten or deleted while a reader that opened it earlier still reads it:
    the read would need rows of another generation (docs/READS.md, "Generations"). Open it again."""


class MissingChunks(FeatureStoreError, RuntimeError):
    """``commit()`` found chunks that were never written."""


class CacheKeyMismatch(FeatureStoreError, ValueError):
    """Resuming or re-running into a split made with another encoder, preprocessing or dtype."""


class InputChanged(FeatureStoreError, ValueError):
    """Resuming or re-running into a split whose input files changed after it was created
    (featurestore.extract.input_check): the rows already stored would not match the input."""


class StorageFull(FeatureStoreError, OSError):
    """The store's device ran out of space (ENOSPC/EDQUOT) while a chunk was written."""


class InvalidIndices(FeatureStoreError, TypeError):
    """Row indices that are not integers (a float, a string, a 2-D array...)."""





class InvalidMetadata(FeatureStoreError, ValueError):
    """A split's metadata (or one of its zarr.json documents) is damaged or not plain JSON."""


class InvalidOption(FeatureStoreError, ValueError):
    """An argument or command-line option outside its allowed values (the message names both)."""


class DeviceUnavailable(FeatureStoreError, ValueError):
    """A device asked for that this machine does not have (CUDA without a CUDA device)."""


class MissingLabels(FeatureStoreError, ValueError):
    """A split without labels where a probe needs them."""


class InvalidLabels(FeatureStoreError, ValueError):
    """Labels a probe cannot use: class ids outside ``[0, num_classes)``, or the wrong shape."""


class EmptySplit(FeatureStoreError, ValueError):
    """A split (or loader) that yields no samples where at least one is needed."""


class WriterClosed(FeatureStoreError, RuntimeError):
    """A write on a :class:`SplitWriter` after ``close()`` or ``commit()``."""


class SplitTakenOver(FeatureStoreError, RuntimeError):
    """Another writer replaced the split (``--overwrite``) while this one was writing it: the
    split's generation on storage is no longer this writer's (docs/FORMAT.md, "Generation")."""



class SplitSettingsMismatch(FeatureStoreError, ValueError):
    """Resuming or re-running into a split written with another compressor or chunk size."""


class StoreUnreachable(FeatureStoreError, OSError):
    """The storage backend behind a store URL failed (no such bucket, refused connection, missing
    credentials or fsspec backend); the message names the URL and the fix."""


class MissingDependency(FeatureStoreError, ImportError):
    """An optional dependency (an extra in pyproject.toml) is not installed."""


class BagNotFound(FeatureStoreError, KeyError):
    """A bag id (or bag position) that a bag split does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; keep the one clear line
        return str(self.args[0]) if self.args else ""


class SampleNotFound(FeatureStoreError, KeyError):
    """A sample id that a dense split's ids do not hold (``positions_of``, ``read_ids``)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep the one clear line
        return str(self.args[0]) if self.args else ""


class DuplicateBag(FeatureStoreError, ValueError):
    """A bag id added twice to one bag split (callers skip ``writer.done_ids``)."""


class SourceError(FeatureStoreError, ValueError):
    """An input (image source, feature cache, slide file) that is missing, malformed, or does not
    match its spec (featurestore.extract: defined here so readers without torch can raise it)."""


class WrongSplitKind(FeatureStoreError, TypeError):
    """A dense-split operation on a bag split, or a bag operation on a dense split."""

    # What the message says before naming the library's door for the split's kind; a CLI verb
    # replaces what follows with its own way forward (commands.storeargs.kind_hint). A class
    # attribute, not a field: over HTTP the error comes back as its name and message only.
    DOOR = ": open it with "


class EmptyBag(FeatureStoreError, ValueError):
    """A bag without patches where one is needed (``BagLoader(skip_empty=False)``)."""


class AttentionNotFound(FeatureStoreError, LookupError):
    """An attention map name that a bag split does not hold (``--save-attention NAME`` saves one)."""


class StaleSplitWarning(UserWarning):
    """A split opened for reading is a stale derived split: its source changed since it was
    computed (featurestore.core.lineage); its rows describe the old source."""


class StaleAttention(FeatureStoreError, RuntimeError):
    """An attention map saved for another state of its bag split (overwritten, re-committed):
    its values no longer belong to the split's patches."""


class ConditionalWritesUnsupported(FeatureStoreError, RuntimeError):
    """``--worker`` needs create-if-absent and compare-and-swap writes, and this storage (or the
    server behind it) does not enforce them: claims could race (docs/EXTRACT.md, "Cluster workers")."""


class Stopped(KeyboardInterrupt):
    """A command stopped by SIGTERM or SIGINT (a spot instance reclaimed, a job preempted or
    cancelled, a pod ended, Ctrl-C): a ``--worker`` gives the slide it held back, not counted as an
    attempt (featurestore.extract.worker_stop); ``bench all`` reports what finished. A
    KeyboardInterrupt, so whatever stops on Ctrl-C stops."""

    def __init__(self, signum: int) -> None:
        import signal

        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(self.name)
