"""The gated MLP of a decoder layer, SiLU or tanh-GELU (Gemma), and of each expert of a
sparse one (moe.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixmesh.engine.model.linear import Linear, Weight
from radixmesh.engine.model.parallel import TensorParallel, row_parallel
from radixmesh.kernels import native

if TYPE_CHECKING:
    from radixmesh.engine.model.lora import LoraBatch


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] [T, 2I] -> silu(gate) * up [T, I]: one native pass for bf16 where it is
    built, else torch's two ops."""
    if native.silu_mul_supported(x):
        return native.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate | up] [T, 2I] -> gelu(gate, tanh approximation) * up [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def clamped_swiglu(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts: [gate | up] [T, 2I] -> (up + 1) * gate * sigmoid(alpha * gate), gate
    clamped to at most `limit` and up to [-limit, limit] first."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(gate * alpha)


ACTIVATIONS = {"silu": silu_mul, "gelu_tanh": gelu_tanh_mul}


class GatedMLP:
    """down(act(gate(x)) * up(x)), act SiLU or tanh-GELU (`hidden_act`), gate and up fused
    into one matmul; `mlp(x, residual)` adds the residual in the down projection's epilogue.
    With `tp`, down is row-parallel (summed over the group); without, a plain Linear.

    `swiglu` (alpha, limit) makes it gpt-oss's expert: clamped_swiglu, and `biases` (gate,
    up, down) added to the projections (one rank only)."""

    def __init__(
        self,
        gate: Weight,
        up: Weight,
        down: Weight,
        tp: TensorParallel | None = None,
        hidden_act: str = "silu",
        swiglu: tuple[float, float] | None = None,
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        gate_bias = None if biases is None else torch.cat(biases[:2])
        self.gate_up = Linear([gate, up], gate_bias)
        self.down = row_parallel(down, tp) if biases is None else Linear(down, biases[2])
        self.act = (ACTIVATIONS[hidden_act] if swiglu is None
                    else functools.partial(clamped_swiglu, alpha=swiglu[0], limit=swiglu[1]))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 lora: LoraBatch | None = None, layer: int = 0) -> torch.Tensor:
        """The MLP of `x`, plus `residual`; `lora`: the step's adapters, of layer `layer`."""
        if lora is None:
            return self.down(self.act(self.gate_up(x)), residual=residual)
        gate_up = self.gate_up(x, extra=functools.partial(lora.add, layer, "gate_up"))
        return self.down(self.act(gate_up), residual=residual,
                         extra=functools.partial(lora.add, layer, "down"))
