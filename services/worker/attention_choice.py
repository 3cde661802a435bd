"""Which attention backend a worker runs: Triton on CUDA, torch on CPU, or one named."""

from __future__ import annotations

import torch

from radixmesh.services.worker.attention import AttentionBackend
from radixmesh.services.worker.torch_attention import TorchAttention

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def make_attention(
    name: str, scale: float, device: torch.device, page_size: int = 1
) -> AttentionBackend:
    """The backend called `name` ("auto": triton on CUDA, torch elsewhere) for `device`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention(scale)
    # Imported here: triton is an optional dependency that a CPU-only install may lack.
    from radixmesh.services.worker.triton_attention import TritonAttention

    return TritonAttention(scale, page_size, device)
