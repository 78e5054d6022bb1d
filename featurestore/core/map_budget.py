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
