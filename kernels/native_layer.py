"""The native decoder layer (cpu/layer.cpp): a bf16 model's layers run as one call each,
over the kernels of native.py and native_quant.py in the Python layer's order."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from radixmesh.kernels.native import check_rows, library, threads_for
from radixmesh.kernels.native_quant import ExpertWeights, QuantizedWeight, _QuantWeight

_PTR, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# A projection's weight: packed by native.pack_gemm_weight, or quantized parts side by side.
Projection = torch.Tensor | list[QuantizedWeight]
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Proj(ctypes.Structure):
    _fields_ = [("packed", _PTR), ("parts", _PTR), ("num_parts", _INT)]


class _Experts(ctypes.Structure):
    _fields_ = [
        ("router", _PTR), ("num_experts", _INT), ("top_k", _INT), ("renormalize", _INT),
        ("gate", _PTR), ("up", _PTR), ("down", _PTR),
    ]


class _LayerWeights(ctypes.Structure):
    _fields_ = [
        ("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _Proj), ("qkv_bias", _PTR),
        ("o", _Proj), ("gate_up", _Proj), ("down", _Proj), ("q_norm", _PTR), ("k_norm", _PTR),
        ("experts", _PTR),
    ]


class SparseLayer(NamedTuple):
    """A sparse layer's MLP as the native layer takes it: its bf16 router [E, hidden], top-k,
    whether the top-k weights are renormalized, and its quantized experts."""

    router: torch.Tensor
    top_k: int
    renormalize: bool
    experts: ExpertWeights


class _LoraBlock(ctypes.Structure):
    _fields_ = [(name, _INT) for name in ("column", "width", "row", "rank")]


class _LoraProj(ctypes.Structure):
    _fields_ = [("a", _PTR), ("bt", _PTR), ("r", _INT), ("blocks", _PTR), ("num_blocks", _INT)]


class _LoraLayer(ctypes.Structure):
    _fields_ = [*((name, _LoraProj) for name in _PROJECTIONS),
                ("order", _PTR), ("count", _INT), ("slots", _PTR)]


# A fused projection's LoRA adapters: A [slots, r, in] and B transposed [slots, r, out] in
# bfloat16, and its blocks (column, width, row, rank): a target's output columns and its
# rows of A x.
LoraProjection = tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]


class LoraArgs(NamedTuple):
    """A step's LoRA adapters as the native layers take them (cpu/lora.cpp): per layer, its
    fused projections' adapters (those no adapter targets left out); each token's slot
    (int32, -1: none) and the tokens that have one, sorted by slot (int32)."""

    layers: list[dict[str, LoraProjection]]
    slots: torch.Tensor
    order: torch.Tensor


class _LayerShape(ctypes.Structure):
    _fields_ = [
        *((name, _INT) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _FLOAT),
        ("scale", _FLOAT),
    ]


class _AttentionRun(ctypes.Structure):
    _fields_ = [
        ("first", _INT), ("count", _INT), ("index", _PTR), ("width", _INT), ("lens", _PTR)
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("tokens", _INT),
        *((name, _PTR) for name in ("positions", "cos", "sin", "out_slots", "runs")),
        ("num_runs", _INT),
        ("scratch", _PTR),
        ("threads", _INT),
    ]


class LayerStack:
    """The decoder layers of a bf16 model run natively, one call for them all (cpu/layer.cpp):
    the Python layer's kernels in its order, so the same bits.

    Each entry of `layers` names a layer's tensors: input_norm, post_norm, qkv_bias, q_norm
    and k_norm (each or None), its projections qkv, o, gate_up and down (each a
    `Projection`; gate_up and down None in a sparse layer) and `experts` (a `SparseLayer`, or
    None in a dense one)."""

    def __init__(
        self,
        layers: list[dict[str, torch.Tensor | list[QuantizedWeight] | SparseLayer | None]],
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        eps: float,
    ) -> None:
        self._tensors = layers  # keeps every pointer below alive
        self._parts: list[ctypes.Array[_QuantWeight]] = []
        self._experts: list[_Experts] = []
        structs = []
        for w in layers:
            fields = {}
            for name, _ in _LayerWeights._fields_:
                value = w.get(name)
                if name == "experts":
                    fields[name] = self._sparse(value)
                elif name in _PROJECTIONS:
                    fields[name] = _Proj() if value is None else self._projection(value)
                else:
                    assert value is None or isinstance(value, torch.Tensor)
                    fields[name] = None if value is None else value.data_ptr()
            structs.append(_LayerWeights(**fields))
        self._weights = (_LayerWeights * len(structs))(*structs)
        # The K and V pools' addresses as C arrays: (the pools they were made for, the arrays).
        self._pools: tuple[tuple[int, int, int], tuple[ctypes.Array[ctypes.c_void_p], ...]
                           ] | None = None
        self._shape = (hidden, heads, kv_heads, head_dim, intermediate, eps)
        # The LoRA pool's projections as structs, made once: (its layers' list, the structs,
        # the block arrays they point into).
        self._lora: tuple[object, list[dict[str, _LoraProj]], list[ctypes.Array[_LoraBlock]]
                          ] | None = None
        # Multiply-adds of one token through one layer's projections.
        self._layer_work = (hidden * (heads + kv_heads) * head_dim * 2
                            + 3 * hidden * intermediate)

    def _sparse(self, value: object) -> int | None:
        if value is None:
            return None
        assert isinstance(value, SparseLayer) and value.router.dtype == torch.bfloat16
        e = value.experts
        self._experts.append(_Experts(
            value.router.data_ptr(), e.num_experts, value.top_k, int(value.renormalize),
            *(ctypes.addressof(part) for part in (e.gate, e.up, e.down)),
        ))
        return ctypes.addressof(self._experts[-1])

    def _projection(self, value: object) -> _Proj:
        if isinstance(value, torch.Tensor):
            return _Proj(value.data_ptr(), None, 0)
        assert isinstance(value, list) and value
        parts = (_QuantWeight * len(value))(*(p.struct for p in value))
        self._parts.append(parts)
        return _Proj(None, ctypes.addressof(parts), len(value))

    def forward(
        self,
        hidden: torch.Tensor,
        k_pools: list[torch.Tensor],
        v_pools: list[torch.Tensor],
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        runs: Sequence[tuple[int, int, torch.Tensor, int, torch.Tensor]],
        scale: float,
        lora: LoraArgs | None = None,
    ) -> None:
        """Run every layer over hidden [T, hidden] (updated in place): token t writes its K/V
        at out_slots[t]; runs (first, count, index, width, lens) cover every token once, token
        first+i attending to index[i * width, :lens[i]] (see cpu/layer.cpp); each token's LoRA
        adapter (`lora`) added to the projections it targets."""
        lib = _layer_library()
        assert hidden.is_contiguous() and hidden.dtype == torch.bfloat16
        tokens = hidden.shape[0]
        assert sum(run[1] for run in runs) == tokens
        positions, out_slots = positions.contiguous(), out_slots.contiguous()
        # The kernels index raw memory: check every position and slot once per step.
        check_rows("position", positions, cos.shape[0])
        check_rows("slot", out_slots, k_pools[0].shape[0])
        keep = []  # the runs' tensors, alive until the last layer
        table = (_AttentionRun * len(runs))()
        keys = 0  # query-key pairs of the step's attention (padding included)
        for i, (first, count, index, width, lens) in enumerate(runs):
            keys += index.numel() * (1 if width else count)
            index, lens = index.contiguous(), lens.contiguous()
            check_rows("index slot", index, k_pools[0].shape[0])
            keep += [index, lens]
            table[i] = _AttentionRun(first, count, index.data_ptr(), width, lens.data_ptr())
        shape = _LayerShape(*self._shape, scale)
        scratch = torch.empty(lib.decoder_layer_scratch(ctypes.byref(shape), tokens),
                              dtype=torch.bfloat16)
        step = _Step(
            tokens, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out_slots.data_ptr(),
            ctypes.addressof(table), len(runs), scratch.data_ptr(),
            threads_for(tokens * self._layer_work + keys * self._shape[1] * self._shape[3]),
        )
        layers = len(self._weights)
        assert len(k_pools) == len(v_pools) == layers
        pools = self._pool_pointers(k_pools, v_pools)
        adapters = None if lora is None else (_LoraLayer * layers)(*self._lora_layers(lora))
        # One call for every layer: the torch thread takes the interpreter's lock back once a
        # step, where a call a layer waited for it after every layer (up to the interpreter's
        # switch interval, while the service's other threads run Python).
        lib.decoder_layers_bf16(hidden.data_ptr(), *pools, self._weights, layers,
                                ctypes.byref(shape), ctypes.byref(step), adapters)

    def _pool_pointers(self, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]
                       ) -> tuple[ctypes.Array[ctypes.c_void_p], ctypes.Array[ctypes.c_void_p]]:
        """The layers' K and V pool addresses as two C arrays (made once per pool)."""
        key = (k_pools[0].data_ptr(), v_pools[0].data_ptr(), len(k_pools))
        if self._pools is None or self._pools[0] != key:
            arrays = tuple((ctypes.c_void_p * len(pools))(*(p.data_ptr() for p in pools))
                           for pools in (k_pools, v_pools))
            self._pools = (key, arrays)
        return self._pools[1]

    def _lora_layers(self, lora: LoraArgs) -> list[_LoraLayer]:
        """Each layer's LoRA struct for this step (the projections' made once per pool)."""
        if self._lora is None or self._lora[0] is not lora.layers:
            keep: list[ctypes.Array[_LoraBlock]] = []
            layers = []
            for projections in lora.layers:
                structs = {}
                for name, (a, bt, blocks) in projections.items():
                    assert a.dtype == bt.dtype == torch.bfloat16
                    assert a.is_contiguous() and bt.is_contiguous()
                    table = (_LoraBlock * len(blocks))(*(_LoraBlock(*blk) for blk in blocks))
                    keep.append(table)
                    structs[name] = _LoraProj(a.data_ptr(), bt.data_ptr(), a.shape[1],
                                              ctypes.addressof(table), len(blocks))
                layers.append(structs)
            self._lora = (lora.layers, layers, keep)
        slots, order = lora.slots, lora.order
        assert slots.dtype == order.dtype == torch.int32
        return [_LoraLayer(**structs, order=order.data_ptr(), count=order.numel(),
                           slots=slots.data_ptr()) for structs in self._lora[1]]


@functools.cache
def _layer_library() -> ctypes.CDLL:
    lib = library()
    assert lib is not None
    lib.decoder_layer_scratch.argtypes = [ctypes.POINTER(_LayerShape), _INT]
    lib.decoder_layer_scratch.restype = ctypes.c_int64
    lib.decoder_layer_bf16.argtypes = [_PTR] * 3 + [
        ctypes.POINTER(_LayerWeights), ctypes.POINTER(_LayerShape), ctypes.POINTER(_Step),
        ctypes.POINTER(_LoraLayer),
    ]
    lib.decoder_layer_bf16.restype = None
    lib.decoder_layers_bf16.argtypes = [_PTR, ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(ctypes.c_void_p),
                                        ctypes.POINTER(_LayerWeights), _INT,
                                        ctypes.POINTER(_LayerShape), ctypes.POINTER(_Step),
                                        ctypes.POINTER(_LoraLayer)]
    lib.decoder_layers_bf16.restype = None
    return lib
