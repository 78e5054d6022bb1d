"""The one ``resolve_device``: extraction, the loaders and the probes all take ``device=`` through it.

It lives in ``core`` because both ``featurestore.extract`` and ``client`` may import ``core`` but
not each other. torch is imported when it is called (``core`` imports no torch at import time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from featurestore.errors import DeviceUnavailable, InvalidOption

if TYPE_CHECKING:
    import torch

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device = "auto", local_rank: int | None = None) -> torch.device:
    """``"auto"`` -> CUDA when available, else the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
    ``torch.device`` as given, once checked.

    ``local_rank`` (a torchrun process's ``LOCAL_RANK``) pins an index-less CUDA choice to
    ``cuda:(local_rank % device_count)``, so the ranks of one host spread over its GPUs; without
    it ``"cuda"`` stays index-less (torch's current device, which a caller may have set).
    CUDA asked for where there is none is :class:`~featurestore.errors.DeviceUnavailable`; a
    string torch does not parse is :class:`~featurestore.errors.InvalidOption`.
    """
    import torch

    if isinstance(device, torch.device):
        resolved = device
    else:
        choice = device
        if choice == "auto":
            choice = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            resolved = torch.device(choice)
        except (RuntimeError, TypeError) as error:
            raise InvalidOption(f"invalid device {device!r}: use auto, cpu, cuda or cuda:N") from error
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {str(device)!r} was asked for but CUDA is not available here: "
                                "use device 'cpu' (--device cpu) or 'auto'")
    count = torch.cuda.device_count()
    if resolved.index is None:
        return resolved if local_rank is None else torch.device("cuda", local_rank % count)
    if resolved.index >= count:
        raise DeviceUnavailable(f"device {str(device)!r} does not exist: this machine has {count} CUDA device(s)")
    return resolved
