"""featurestore.core.device.resolve_device: the one device rule of extraction, loaders and probes."""

from __future__ import annotations

import pytest
import torch

from featurestore.core.device import resolve_device
from featurestore.errors import DeviceUnavailable, InvalidOption

CUDA = torch.cuda.is_available()


def test_cpu_and_auto_without_cuda() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu"), local_rank=3) == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    with pytest.raises(InvalidOption, match="invalid device 'gpu0': use auto, cpu, cuda or cuda:N"):
        resolve_device("gpu0")


@pytest.mark.skipif(CUDA, reason="checks the message where CUDA is absent")
@pytest.mark.parametrize("choice", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_a_device_is_one_clear_error(choice: object) -> None:
    with pytest.raises(DeviceUnavailable, match="CUDA is not available here: use device 'cpu'"):
        resolve_device(choice, local_rank=0)  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_local_rank_spreads_index_less_cuda_over_the_devices() -> None:
    count = torch.cuda.device_count()
    assert resolve_device("cuda") == torch.device("cuda")  # the current device, as the caller set it
    assert resolve_device("cuda", local_rank=count + 1) == torch.device("cuda", (count + 1) % count)
    assert resolve_device("auto", local_rank=0) == torch.device("cuda", 0)
    assert resolve_device("cuda:0", local_rank=5) == torch.device("cuda", 0)  # an explicit index wins
    with pytest.raises(DeviceUnavailable, match="does not exist"):
        resolve_device(f"cuda:{count}")
