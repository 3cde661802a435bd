"""Dense layers with weights prepacked once for the fastest CPU kernel at hand.

Quantized weights (GGUF types kept as they are, or Q8_0 made at load) go to the native
quantized GEMM (kernels/cpu/quant.cpp); bf16 weights go to the native GEMM
(kernels/cpu/gemm.cpp), 1.2-3.7x faster than oneDNN at the batch sizes of decoding and as
fast at prefill sizes (measured on 2-core AVX512-BF16 machines); other weights are prepacked
for oneDNN, 1.5-2x faster than torch's default CPU linear for small batches; elsewhere (no
oneDNN, bf16 on a CPU without oneDNN's bf16 instructions such as AVX2-only ones, a GPU)
torch's linear runs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from radixmesh.kernels import native, native_quant
from radixmesh.kernels.native_quant import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


def float_weight(weights: Mapping[str, Weight], name: str) -> torch.Tensor:
    """A weight that is never quantized (norms, biases, routers, gates); ValueError naming
    it where the checkpoint gives anything else."""
    weight = weights[name]
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name} must be a float tensor, got {type(weight).__name__}")
    return weight


class Linear:
    """y = x @ W.T + b (+ a residual) for 2-D x. W may be given as parts side by side in the
    output features (q, k and v; gate and up): quantized parts stay apart, each in its own
    type, and a mix of quantized and float parts is dequantized to the float parts' dtype."""

    def __init__(self, weight: Weight | Sequence[Weight], bias: torch.Tensor | None = None) -> None:
        parts = list(weight) if isinstance(weight, Sequence) else [weight]
        self.bias = bias
        self.out_features = sum(p.shape[0] for p in parts)
        if all(isinstance(p, QuantizedWeight) for p in parts):
            self.kind = "quant"
            self.parts = [p for p in parts if isinstance(p, QuantizedWeight)]
            return
        dtype = next(p.dtype for p in parts if isinstance(p, torch.Tensor))
        dense = [p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts]
        weight = dense[0] if len(dense) == 1 else torch.cat(dense)
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

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 extra: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                 ) -> torch.Tensor:
        """x @ W.T + b, plus `residual` (same shape as the output) if given; then
        `extra(x, out)` adds something more to it in place (a LoRA adapter's B A x)."""
        out = self._product(x, residual)
        if extra is not None:
            extra(x, out)
        return out

    def _product(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "quant":
            return native_quant.linear(x, self.parts, self.bias, residual)
        if self.kind == "native":
            return native.gemm(x, self.weight, self.out_features, self.bias, residual)
        if self.kind == "onednn":
            out = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.weight, self.bias, "none", [], ""
            )
        else:
            out = F.linear(x, self.weight, self.bias)
        return out if residual is None else residual + out

    def native_weight(self) -> torch.Tensor | list[QuantizedWeight] | None:
        """What the native decoder layer takes for this weight, or None if it cannot."""
        if self.kind == "quant":
            return self.parts
        return self.weight if self.kind == "native" else None


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack weights of this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
