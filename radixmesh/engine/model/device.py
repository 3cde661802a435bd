"""Which torch device a worker runs on."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from radixmesh.core.settings import check_device


def resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device `name` (auto, cpu, cuda, cuda:N) stands for on this machine.

    auto is cuda when torch sees a GPU, else cpu; a plain cuda puts tensor-parallel rank r
    on GPU r (modulo the GPU count), so the ranks of one group never share a GPU."""
    check_device(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To a GPU through pinned memory without waiting: a copy from
    pageable memory would wait for every kernel queued before it, and a step launched
    behind another would wait for that one to finish."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def current(device: torch.device) -> AbstractContextManager[object]:
    """Make `device` the current CUDA device for a block (Triton kernels, streams and CUDA
    graphs go to the current device); nothing on the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
