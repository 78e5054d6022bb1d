"""One chunk file as the chunk maps hold it: its memory map, and a descriptor for reads that map nothing.

A :class:`MappedFile` is made by :func:`map_file` and kept by :class:`~featurestore.core.chunk_maps.ChunkMaps`.
Its rows are read two ways:

* through the map (``rows``): a copy straight out of the page cache, whose touched pages count in
  the process's RSS until they are released (:meth:`MappedFile.release`);
* through a descriptor (:func:`read_into`, ``preadv``; opened by ``ChunkMaps.descriptor``): the
  kernel copies the rows out of the page cache and maps nothing, so nothing is added to RSS. For
  shuffled rows (much smaller than a folio) this costs about what the copy out of the map costs
  (one system call per row against the faults that map the row in; core.descriptor_reads) and
  keeps a shuffled epoch of any split out of the process's RSS. The descriptor is opened on first need
  (:func:`open_descriptor`) and used only if it names the very file that was mapped (same inode
  and size): a file replaced at the same path since is never read by mistake. A map that is only
  ever copied from holds none.

Both stay valid while a gather uses them after the cache dropped the entry: the map is unmapped
once the gather lets go of its view, the descriptor closed once it lets go of its
:class:`Descriptor` (CPython frees both as their last reference goes).
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import time
from collections.abc import Callable

import numpy as np

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only; elsewhere pages fault in lazily
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
# Linux >= 5.14; Python names it from 3.13. Maps a range's cached pages in with one call: a copy
# out of a released map otherwise faults once per 64 KiB (measured on chunk files here: a warm
# 8 MiB copy at 1.76 GB/s after a release, 2.03 with this, 2.64 while still mapped in).
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else 0)


class Descriptor:
    """An open file descriptor, closed when the last reference to this object goes."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __del__(self, _close: Callable[[int], None] = os.close) -> None:  # bound now: works at exit too
        try:
            _close(self.fd)
        except OSError:
            pass


class MappedFile:
    """A chunk file's map (``rows``: its payload as ``[chunk_rows, row bytes]``), its inode, when it
    was opened, and its descriptor for reads that map nothing (None until opened, and once closed)."""

    __slots__ = ("address", "cached", "descriptor", "inode", "mapped", "mincore_truthful", "nbytes", "no_descriptor",
                 "opened", "path", "resident", "rows", "size_checked")

    def __init__(self, path: str, inode: int, mapped: mmap.mmap, rows: np.ndarray,
                 mincore_truthful: bool = False) -> None:  # fmt: skip
        self.path, self.inode, self.mapped, self.rows = path, inode, mapped, rows
        self.descriptor: Descriptor | None = None
        # Its path named another file (or none) when a descriptor was asked for: not asked again,
        # since the reader maps the new file once it sees it (its rows are copied out of this map).
        self.no_descriptor = False
        self.cached = False  # held by the ChunkMaps cache (its lock guards this and the descriptor)
        self.mincore_truthful = mincore_truthful  # see mincore_truthful()
        self.address = rows.ctypes.data  # of the map's first byte (for mincore)
        self.nbytes = len(mapped)
        # When the file was opened (monotonic): a generation check requested after it proves the
        # map is of the generation its reader opened (featurestore.core.generation).
        self.opened = time.monotonic()
        self.resident = 0  # bytes counted as mapped in since the last release (ChunkMaps.touched)
        self.size_checked = self.opened  # monotonic: when checked_rows() last found the mapped size

    def release(self) -> None:
        """Drop this process's page-table entries of the map (the page cache keeps the bytes)."""
        mapped = self.mapped
        if mapped is not None and _DONTNEED is not None:
            try:
                mapped.madvise(_DONTNEED)
            except (ValueError, OSError):  # closed meanwhile: its pages went with it
                pass

    def map_in(self, start: int, length: int) -> None:
        """Map the (page-cached) bytes ``[start, start + length)`` in with one call."""
        global _POPULATE_READ
        mapped = self.mapped
        if mapped is None or not _POPULATE_READ:
            return
        begin = start - start % mmap.PAGESIZE
        try:
            mapped.madvise(_POPULATE_READ, begin, start + length - begin)
        except ValueError:  # closed meanwhile
            pass
        except OSError as error:
            if error.errno == errno.EINVAL:  # a kernel without it: the copy faults the pages in
                _POPULATE_READ = 0

    def close(self) -> None:
        mapped, self.rows, self.mapped, self.descriptor = self.mapped, None, None, None  # type: ignore[assignment]
        if mapped is not None:
            try:
                mapped.close()
            except BufferError:  # a gather still copies from it: unmapped when it drops its view
                pass

    def checked_rows(self) -> np.ndarray | None:
        """The rows if the file still has the size it was mapped with (``fstat`` on the map's own
        descriptor), else None. Holding the rows keeps the map alive even if evicted meanwhile."""
        rows, mapped = self.rows, self.mapped
        if rows is None or mapped is None or mapped.size() != self.nbytes:
            return None
        self.size_checked = time.monotonic()
        return rows


def read_into(descriptor: Descriptor, target: np.ndarray, offset: int, path: str,
              check_size: Callable[[str, int], None]) -> None:
    """Fill ``target`` (contiguous bytes) from byte ``offset`` of the file with ``preadv``. A file
    that ends first (truncated in place since its size was checked) is refused by ``check_size``
    (``CorruptChunk`` naming it), where a copy out of its map would have raised SIGBUS."""
    done = os.preadv(descriptor.fd, [target], offset)  # the whole of it, almost always: no view made
    if done == target.nbytes:
        return
    view = memoryview(target).cast("B")
    while done < len(view):
        got = os.preadv(descriptor.fd, [view[done:]], offset + done)
        if got <= 0:
            check_size(path, os.fstat(descriptor.fd).st_size)
            raise OSError(errno.EIO, f"chunk file {path} ended before byte {offset + len(view)} while it was read")
        done += got


def open_descriptor(entry: MappedFile) -> Descriptor | None:
    """A descriptor of the file ``entry`` mapped: None if it is closed, or if its path now names
    another file (replaced since) or cannot be opened; the caller then copies out of the map."""
    if entry.mapped is None:
        return None
    try:
        descriptor = Descriptor(os.open(entry.path, os.O_RDONLY))
    except OSError:
        return None
    st = os.fstat(descriptor.fd)
    return descriptor if (st.st_ino, st.st_size) == (entry.inode, entry.nbytes) else None


def map_file(path: str, shape: tuple[int, int], check_size: Callable[[str, int], None],
             populate: bool) -> MappedFile:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        check_size(path, st.st_size)
        # The map keeps its own duplicate of the descriptor (CPython's mmap), which the size
        # checks above use; the 4-byte crc trailer is left out of the view. MAP_POPULATE maps the
        # chunk's cached pages in one call instead of one page fault per 4 KiB on first touch, but
        # on a cold chunk it reads the whole file first (384 MiB for one 6 MiB row of a 64-row
        # chunk), so "auto" maps lazily.
        flags = mmap.MAP_SHARED | (_POPULATE if populate else 0)
        mapped = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
    rows = np.frombuffer(mapped, np.uint8, count=shape[0] * shape[1]).reshape(shape)
    return MappedFile(path, st.st_ino, mapped, rows, mincore_truthful(path, st.st_uid))


def mincore_truthful(path: str, owner: int) -> bool:
    """Whether ``mincore`` on a map of ``path`` reports the page cache's state. Since Linux 5.2 it
    does so only for a file the caller owns (or root) or could open for writing; for any other
    file it reports every page resident, which would pass a cold read off as a page-cached one."""
    euid = os.geteuid()
    if euid == 0 or owner == euid:
        return True
    return os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids)
