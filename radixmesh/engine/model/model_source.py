"""Loading a model's config and weights from a GGUF file or a Hugging Face directory, in the
quantization asked for (see DeviceSettings.quantization)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from radixmesh.core.model_files import is_gguf, resolve_model_path
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.kernels import native_quant

if TYPE_CHECKING:
    import torch

    from radixmesh.engine.model.linear import Weight

log = logging.getLogger("radixmesh.worker")

# The weights q8_0 quantizes: every matrix a Linear or the embedding lookup reads.
_Q8_SUFFIXES = ("_proj.weight", "lm_head.weight", "embed_tokens.weight")


class LoadedModel(NamedTuple):
    config: ModelConfig
    weights: dict[str, Weight]
    quantization: str  # what `quantization` resolved to


def resolve_quantization(
    quantization: str, gguf: bool, device: str, dtype: str = "bfloat16"
) -> str:
    """auto -> gguf for a GGUF file run in bfloat16 on the CPU where the native kernels
    build, else bf16 (float32 asks for exact arithmetic: the quantized kernels round
    activations to int8); gguf and q8_0 need the CPU and the kernels. `device` is a device
    type: cpu or cuda."""
    cpu = device == "cpu"
    if quantization == "auto":
        fits = gguf and cpu and dtype == "bfloat16" and native_quant.supported()
        return "gguf" if fits else "bf16"
    if quantization in ("gguf", "q8_0"):
        if not cpu:
            raise ValueError(f"quantization={quantization!r} runs on the CPU only; use bf16 "
                             f"on device={device!r}")
        if not native_quant.supported():
            raise ValueError(f"quantization={quantization!r} needs the native CPU kernels "
                             "(a C++ compiler; RADIXMESH_NATIVE_KERNELS not 0); use bf16")
    return quantization


def _to_q8_0(name: str, tensor: torch.Tensor) -> Weight:
    """Q8_0 for the matrices it serves (whole 32-input blocks), the tensor as it is else."""
    if name.endswith(_Q8_SUFFIXES) and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
        return native_quant.QuantizedWeight.quantize_q8_0(tensor)
    return tensor


def load_model(
    path: str | None,
    progress: bool = True,
    quantization: str = "bf16",
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> LoadedModel:
    """Load a model's config and weights, keyed by Hugging Face parameter names: float32
    tensors, and quantized weights where `quantization` (auto, gguf, bf16 or q8_0) keeps or
    makes them."""
    resolved = resolve_model_path(path)
    gguf = is_gguf(resolved)
    quantization = resolve_quantization(quantization, gguf, device, dtype)
    convert = _to_q8_0 if quantization == "q8_0" else None
    if gguf:
        from radixmesh.engine.model.weights_gguf import load_gguf

        config, weights = load_gguf(
            resolved, progress=progress, keep_quantized=quantization in ("gguf", "q8_0"),
            convert=convert,
        )
    else:
        from radixmesh.engine.model.weights_hf import load_hf_dir

        config, weights = load_hf_dir(resolved, progress=progress, convert=convert)
    if quantization != "bf16":
        quantized = [w for w in weights.values() if isinstance(w, native_quant.QuantizedWeight)]
        held = sum(w.nbytes for w in quantized)
        log.info("weights: %s quantization, %.0f MiB quantized (%s kernels)", quantization,
                 held / 2**20, native_quant.isa())
    return LoadedModel(config, weights, quantization)
