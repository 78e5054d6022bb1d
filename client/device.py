"""One ``resolve_device`` for the loader and the probes (and anything else that takes ``device=``)."""

from __future__ import annotations

import torch

from featurestore.errors import DeviceUnavailable, InvalidOption

__all__ = ["resolve_device"]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else the CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
    ``torch.device`` as given, once checked: CUDA asked for where there is none is
    :class:`~featurestore.errors.DeviceUnavailable`, a string torch does not parse is
    :class:`~featurestore.errors.InvalidOption`."""
    if isinstance(device, torch.device):
        resolved = device
    elif device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError) as error:
            raise InvalidOption(f"invalid device {device!r}: use auto, cpu, cuda or cuda:N") from error
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {str(device)!r} was asked for but CUDA is not available here: "
                                    "use device 'cpu' (--device cpu) or 'auto'")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceUnavailable(f"device {str(device)!r} does not exist: this machine has "
                                    f"{torch.cuda.device_count()} CUDA device(s)")
    return resolved
