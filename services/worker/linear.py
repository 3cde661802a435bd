"""Dense layers with weights prepacked once for the fastest CPU kernel at hand.

bf16 weights go to the native GEMM (kernels/cpu/gemm.cpp), 1.2-3.7x faster than oneDNN at
the batch sizes of decoding and as fast at prefill sizes (measured on 2-core AVX512-BF16
machines); other weights are prepacked for oneDNN, 1.5-2x faster than torch's default CPU
linear for small batches; elsewhere (no oneDNN, bf16 on a CPU without oneDNN's bf16
instructions such as AVX2-only ones, a GPU) torch's linear runs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixmesh.kernels import native


class Linear:
    """y = x @ W.T + b (+ a residual) for 2-D x."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        if native.gemm_supported(weight):
            self.kind = "native"
            self.weight = native.pack_gemm_weight(weight)
        elif weight.device.type == "cpu" and _onednn_packs(weight.dtype):
            self.kind = "onednn"
            # Packing for batch size 1 serves larger batches nearly as well (measured).
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.kind = "torch"
            self.weight = weight

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b, plus `residual` (same shape as the output) if given."""
        if self.kind == "native":
            return native.gemm(x, self.weight, self.out_features, self.bias, residual)
        if self.kind == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight, self.bias, "none", [], ""
            )
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if residual is None else residual + out


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack weights of this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
