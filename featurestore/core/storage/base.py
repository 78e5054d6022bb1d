"""The storage interface: key-value access to a store root, whatever the backend.

Keys are ``/``-separated paths relative to the store root (``ds/enc/split/features/c/0/0/0``).
The writer needs exactly three guarantees from a backend, and every backend gives them:

* ``write`` is atomic: a reader (or a resumed writer) sees the whole value or no value, never a
  torn one. Locally that is write-to-temp + ``os.replace`` in the same directory (POSIX rename is
  atomic, :mod:`.local`); on object stores a single PUT is atomic by design. ``write_sealed`` is
  ``write`` of a chunk plus its crc32c trailer; the local backend checksums each piece as it
  writes it and starts the file's writeback as it goes (:func:`.files.start_writeback`).
* ``read_ranges`` fetches many byte ranges in one call, concurrently where the backend can (the
  obstore backend for s3/gs/az in :mod:`.obstore`, fsspec's async filesystems in :mod:`.fsspec`).
* ``local_path`` tells the reader when a key is a plain file it may memory-map.

The backends sit below this module, :mod:`.factory` above them picks one for a URL, and
:mod:`.cached` wraps one in the local chunk cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from featurestore.errors import ConditionalWritesUnsupported
from featurestore.format import chunks


class Storage:
    """Abstract key-value view of a store root."""

    url: str

    def read(self, key: str) -> bytes:  # raises FileNotFoundError
        raise NotImplementedError

    # Conditional writes, the primitive of --worker claims (core.claims); a token names one version
    # of a key and changes with every write. Backends: core.storage.conditional.
    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Create ``key`` holding ``data`` unless it exists: the new version's token, or None."""
        raise ConditionalWritesUnsupported(f"{self.url}: this backend has no create-if-absent write; "
                                           "use a local/NFS path or s3://, gs://, az:// (obstore)")

    def read_versioned(self, key: str) -> tuple[bytes, str]:
        """``key``'s bytes and its version's token (FileNotFoundError when absent)."""
        raise ConditionalWritesUnsupported(f"{self.url}: this backend has no versioned read")

    def replace_if(self, key: str, data: bytes, token: str) -> str | None:
        """Overwrite ``key`` only while its version is ``token``: the new token, else None."""
        raise ConditionalWritesUnsupported(f"{self.url}: this backend has no conditional replace")

    def read_ranges(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        raise NotImplementedError

    def read_ranges_into(self, keys: Sequence[str], starts: Sequence[int], ends: Sequence[int],
                         sink: Callable[[int, Any], None]) -> None:
        """``sink(i, data)`` for each range ``i`` of :meth:`read_ranges`; a backend that fetches
        concurrently calls it as each range arrives, so the caller's copy overlaps the wait for
        the others."""
        for i, data in enumerate(self.read_ranges(keys, starts, ends)):
            sink(i, data)

    def read_many(self, keys: Sequence[str]) -> list[bytes]:
        """Whole values of many keys (concurrently where the backend can)."""
        return [self.read(k) for k in keys]

    def read_present(self, keys: Sequence[str]) -> list[bytes | None]:
        """:meth:`read_many`, a key not there (deleted meanwhile: a claim or segment a commit
        removed) None; the keys are read one by one only when one of them is missing."""
        try:
            return list(self.read_many(keys))
        except (FileNotFoundError, IsADirectoryError):
            out: list[bytes | None] = []
            for key in keys:
                try:
                    out.append(self.read(key))
                except (FileNotFoundError, IsADirectoryError):
                    out.append(None)
            return out

    def read_whole_into(self, key: str, size: int, part_bytes: int, sink: Callable[[Any], None],
                        answered: Callable[[], None] | None = None) -> None:
        """The value of ``key``, expected to hold ``size`` bytes, handed to ``sink`` as consecutive
        buffers (a backend may fetch parts of ``part_bytes`` concurrently, or stream pieces as they
        arrive and hold no buffer of the whole value). A longer value comes longer than ``size``
        (by at least a byte), a shorter one shorter: the caller checks the size. ``answered()``
        is called once every request for the value has been answered (a backend that streams calls
        it before the body has arrived): whatever is read after that call was stored no earlier
        than the value that comes back."""
        data = self.read(key)
        if answered is not None:
            answered()
        sink(data)

    def write(self, key: str, *parts: bytes | memoryview) -> None:
        """Store the concatenation of ``parts`` under ``key``, atomically."""
        raise NotImplementedError

    def write_sealed(self, key: str, payload: bytes | memoryview) -> None:
        """Store ``payload`` and its crc32c trailer (a chunk, as zarr's ``crc32c`` codec seals
        it) under ``key``, atomically. A backend that streams may compute the crc as it writes."""
        self.write(key, payload, chunks.crc_bytes(payload))

    def copy(self, source: str, target: str) -> None:
        """Store the value of ``source`` under ``target`` too, atomically (a bag split's commit
        moves chunks already in place this way). Locally a hard link: no bytes are copied. A
        missing ``source`` raises ``FileNotFoundError`` and leaves nothing behind."""
        self.write(target, self.read(source))

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def size(self, key: str) -> int | None:
        """Size in bytes, or None if the key does not exist."""
        raise NotImplementedError

    def listdir(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (files and sub-directories), [] if none."""
        raise NotImplementedError

    def delete_tree(self, prefix: str) -> None:
        """Every key under ``prefix``, or the one key ``prefix`` names; nothing if none."""
        raise NotImplementedError

    def local_path(self, key: str) -> str | None:
        return None

    def zarr_store(self, read_only: bool = True) -> Any:
        """A zarr-python store on the same root (for the compressed read path and ``ids``)."""
        raise NotImplementedError
