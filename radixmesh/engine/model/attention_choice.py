"""Which attention backend a worker runs: Triton on CUDA, torch on CPU, or one named."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixmesh.core.settings import ATTENTION_BACKENDS
from radixmesh.engine.model.attention import AttentionBackend
from radixmesh.engine.model.torch_attention import TorchAttention


def make_attention(
    name: str,
    scale: float,
    device: torch.device,
    page_size: int = 1,
    windows: Sequence[int] = (),
    softcap: float = 0.0,
    latent: int = 0,
) -> AttentionBackend:
    """The backend called `name` ("auto": triton on CUDA, torch elsewhere) for `device`,
    with each layer's sliding window (`windows`, 0: none) and the scores' soft cap;
    `latent` > 0: latent attention's values are the keys' first `latent` dims (the torch
    backend's alone, so far)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if latent and name != "torch":
        raise ValueError("latent attention (deepseek_v3) runs on the torch attention backend "
                         "(the CPU) only: the triton kernels do not read a latent cache yet")
    if name == "torch":
        return TorchAttention(scale, windows=windows, softcap=softcap, latent=latent)
    # Imported here: triton is an optional dependency that a CPU-only install may lack.
    from radixmesh.engine.model.triton_attention import TritonAttention

    return TritonAttention(scale, page_size, device, windows=windows, softcap=softcap)


def check_runs_on(attention: AttentionBackend, device: torch.device) -> None:
    """Raise ValueError when `attention` cannot run on `device`: torch attention is CPU
    only, and the Triton kernels reach the CPU only through the interpreter
    (TRITON_INTERPRET=1)."""
    if isinstance(attention, TorchAttention):
        if device.type != "cpu":
            raise ValueError(f"the torch attention backend runs on the CPU only, not on {device}")
        return
    import triton  # a backend other than torch's is Triton's, so triton is installed

    if device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise ValueError(
            "the triton attention backend needs a CUDA device (on the CPU it runs only "
            "under TRITON_INTERPRET=1)"
        )
