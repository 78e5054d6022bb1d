"""How much of the chunk maps a process keeps mapped in (``FEATURESTORE_MAPPED_MIB``), and the sizes
that decide which reads bypass the maps (core.chunk_maps, docs/READS.md "Resident bytes")."""

from __future__ import annotations

import os
import warnings

from featurestore.errors import InvalidOption

DEFAULT_MAPPED_MIB = 64
UNBOUNDED = "unbounded"  # an earlier setting (shuffled small rows kept mapped): now the default, warned


def resident_budget() -> int:
    """Bytes of chunk maps the process keeps mapped in (in its RSS): ``FEATURESTORE_MAPPED_MIB``
    (MiB, read on first use), default 64; a working set within it is never mapped in again."""
    text = os.environ.get("FEATURESTORE_MAPPED_MIB", "").strip()
    if text.lower() == UNBOUNDED:
        # FutureWarning: shown by default (a DeprecationWarning from inside the library is not).
        warnings.warn(f"FEATURESTORE_MAPPED_MIB={text} no longer changes reads (shuffled rows under 64 KiB "
                      "read through descriptors measured faster than out of maps): unset it. Using the default, "
                      f"{DEFAULT_MAPPED_MIB} MiB", FutureWarning, stacklevel=2)
        return DEFAULT_MAPPED_MIB << 20
    if not text:
        return DEFAULT_MAPPED_MIB << 20
    try:
        mib = float(text)
    except ValueError:
        mib = -1.0
    if not mib > 0:
        raise InvalidOption(f"FEATURESTORE_MAPPED_MIB={text!r} is not a positive number: unset it or give the "
                            f"MiB of chunk maps a process may keep mapped in, e.g. {DEFAULT_MAPPED_MIB}")
    return int(mib * 2**20)


def _folio() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return max(4096, int(f.read()))
    except (OSError, ValueError):
        return 2 << 20


FOLIO = _folio()  # the largest page-cache folio one touch maps (x86-64: 2 MiB)
LONG_RUN = 64 << 10  # the kernel's fault-around: a release costs a run this long one fault
DIRECT_ROW = 256 << 10  # rows this large are read through descriptors past the budget (scattered)


def scattered(nbytes: int, chunks: int, chunk_bytes: int, array_nbytes: int, budget: int, *, runs: int = 0,
              rows: int = 0) -> bool:
    """Whether a read of ``nbytes`` from an array past the ``budget`` (of the process's maps: the
    shared :class:`~featurestore.core.chunk_maps.ChunkMaps`' ``max_resident``) goes through the
    maps' descriptors (``ArrayMaps.gather``, nothing mapped in): rows of :data:`DIRECT_ROW` or more
    (a ``preadv`` each costs nothing beside its copy; a map's copy pays the release and mapping back
    of its pages, 1.4x slower on warm [1024, 1536] float16 rows), and reads of much less than a folio
    per chunk (shuffled small rows, each mapping in a folio around it: 4x slower for 2 KiB rows). Not
    smaller ``rows`` in ``runs`` of :data:`LONG_RUN` each (a bag, a row range): those are read a run
    at a time (``ArrayMaps._read_runs``; docs/READS.md, "Resident bytes")."""
    if rows and direct_rows(nbytes // rows, array_nbytes, budget):
        return True
    if array_nbytes <= budget:
        return False
    if runs and rows >= 2 * runs and nbytes >= runs * LONG_RUN:
        return False
    return 2 * nbytes < chunks * min(FOLIO, chunk_bytes)


def direct_rows(width: int, array_nbytes: int, budget: int) -> bool:  # read through descriptors however they lie
    return width >= DIRECT_ROW and array_nbytes > budget
