"""The native decoder layer (cpu/layer.cpp): a model's layers run for decode-only bf16 steps
as one call each, over the kernels of native.py in the Python layer's order."""

from __future__ import annotations

import ctypes
import functools

import torch

from radixmesh.kernels.native import check_rows, library

_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        (name, _PTR)
        for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down")
    ]


class _LayerShape(ctypes.Structure):
    _fields_ = [
        *((name, _INT) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _FLOAT),
        ("scale", _FLOAT),
    ]


class _DecodeStep(ctypes.Structure):
    _fields_ = [
        ("tokens", _INT),
        *((name, _PTR) for name in ("positions", "cos", "sin", "out_slots", "index", "lens")),
        ("width", _INT),
        ("scratch", _PTR),
        ("threads", _INT),
    ]


class LayerStack:
    """The decoder layers of a bf16 model run natively for decode-only steps, a call per
    layer (cpu/layer.cpp): the Python layer's kernels in its order, so the same bits.

    Each entry of `layers` names a layer's tensors: input_norm, post_norm, qkv, qkv_bias
    (or None), o, gate_up, down, the GEMM weights packed by `pack_gemm_weight`."""

    def __init__(
        self,
        layers: list[dict[str, torch.Tensor | None]],
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
    ) -> None:
        self._tensors = layers  # keeps every pointer below alive
        self._weights = [
            _LayerWeights(*(None if (t := w[f[0]]) is None else t.data_ptr()
                            for f in _LayerWeights._fields_))
            for w in layers
        ]
        self._shape = (hidden, heads, kv_heads, head_dim, intermediate, eps)

    def decode(
        self,
        hidden: torch.Tensor,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        index: torch.Tensor,
        lens: torch.Tensor,
        scale: float,
    ) -> None:
        """Run every layer over hidden [B, hidden] (updated in place) for B decode tokens,
        token b writing its K/V at out_slots[b] and attending to index[b, :lens[b]]."""
        lib = _layer_library()
        assert hidden.is_contiguous() and hidden.dtype == torch.bfloat16
        shape = _LayerShape(*self._shape, scale)
        tokens = hidden.shape[0]
        keep = [t.contiguous() for t in (positions, out_slots, index, lens)]
        # The kernels index raw memory: check every position and slot once per step.
        check_rows("position", keep[0], cos.shape[0])
        for name, rows in (("slot", keep[1]), ("index slot", keep[2])):
            check_rows(name, rows, k_pools[0].shape[0])
        scratch = torch.empty(lib.decoder_layer_scratch(ctypes.byref(shape), tokens),
                              dtype=torch.bfloat16)
        step = _DecodeStep(
            tokens, *(t.data_ptr() for t in (keep[0], cos, sin, keep[1], keep[2], keep[3])),
            index.shape[1], scratch.data_ptr(), torch.get_num_threads(),
        )
        for weights, k, v in zip(self._weights, k_pools, v_pools, strict=True):
            lib.decoder_layer_bf16(hidden.data_ptr(), k.data_ptr(), v.data_ptr(),
                                   ctypes.byref(weights), ctypes.byref(shape), ctypes.byref(step))


@functools.cache
def _layer_library() -> ctypes.CDLL:
    lib = library()
    assert lib is not None
    lib.decoder_layer_scratch.argtypes = [ctypes.POINTER(_LayerShape), _INT]
    lib.decoder_layer_scratch.restype = ctypes.c_int64
    lib.decoder_layer_bf16.argtypes = [_PTR] * 3 + [
        ctypes.POINTER(_LayerWeights), ctypes.POINTER(_LayerShape), ctypes.POINTER(_DecodeStep)
    ]
    lib.decoder_layer_bf16.restype = None
    return lib
