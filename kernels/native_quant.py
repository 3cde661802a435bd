"""Weights kept in a GGUF block quantization, for the native quantized GEMM (cpu/quant.cpp).

Every supported type is unpacked, without loss, into one form: value = scale * (u - zero)
+ min, with u an unsigned 4-bit (Q4_0, Q4_1, Q4_K) or 8-bit (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)
integer and a scale (and min, for the asymmetric types) per block of 32 inputs (16 for
Q6_K), then packed as the kernel reads it. `QuantizedWeight.from_gguf` does that from a
tensor's raw blocks, `QuantizedWeight.quantize_q8_0` quantizes float weights at load, and
`linear` runs x @ W^T over one or more weights side by side in the output features."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixmesh.kernels.native import check_rows, library

_PTR, _INT = ctypes.c_void_p, ctypes.c_int
GROUP = 16  # output features per packed group (kGroup in cpu/quant.cpp)
BLOCK = 32  # inputs per block of the packed form and of quantized x
_CHUNK = GROUP * 64  # rows packed at a time while loading: temporaries of a few MB


@dataclass(frozen=True)
class QuantType:
    """A GGUF type: its block (inputs, bytes) and the packed form it unpacks to."""

    name: str
    block_inputs: int
    block_bytes: int
    bits: int  # 4 or 8 bits per packed value
    scale_block: int  # inputs per scale: 16 or 32
    zero: int
    has_min: bool
    half_scales: bool  # scale and min are the file's float16 values (not products)


# ggml type ids (gguf.GGMLQuantizationType) of the types the kernels take.
QUANT_TYPES = {
    2: QuantType("Q4_0", 32, 18, 4, 32, 8, False, True),
    3: QuantType("Q4_1", 32, 20, 4, 32, 0, True, True),
    6: QuantType("Q5_0", 32, 22, 8, 32, 16, False, True),
    7: QuantType("Q5_1", 32, 24, 8, 32, 0, True, True),
    8: QuantType("Q8_0", 32, 34, 8, 32, 128, False, True),
    12: QuantType("Q4_K", 256, 144, 4, 32, 0, True, False),
    13: QuantType("Q5_K", 256, 176, 8, 32, 0, True, False),
    14: QuantType("Q6_K", 256, 210, 8, 16, 32, False, False),
}
Q8_0 = 8


class _QuantWeight(ctypes.Structure):
    _fields_ = [
        ("q", _PTR), ("scale", _PTR), ("min", _PTR),
        *((name, _INT) for name in ("n", "k", "bits", "block", "zero", "half_scales")),
    ]


def _f16(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [rows, blocks, 1]."""
    return raw[..., at : at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-input nibble block (16 bytes: input i low, i + 16 high) -> 32 values."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins packed in a K-quant's 12 bytes -> two [.., 8] arrays."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """A K-quant's 128 bytes: 64-input chunks, 32 bytes each, low nibbles first -> 256."""
    qs = qs.reshape(*qs.shape[:-1], 4, 32)
    return np.stack([qs & 15, qs >> 4], axis=-2).reshape(*qs.shape[:-2], 256)


def unpack_blocks(
    raw: np.ndarray, qt: QuantType
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF blocks [rows, blocks, block_bytes] -> u [rows, K] uint8, scale and min
    [rows, K / scale_block] float32 (min None for symmetric types); exact."""
    rows = raw.shape[0]

    def flat(a: np.ndarray) -> np.ndarray:
        return a.reshape(rows, -1)

    if qt.name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        d = _f16(raw, 0)
        head = 2 if qt.name.endswith("0") else 4
        u = _nibbles(raw[..., head + (4 if qt.name.startswith("Q5") else 0) :])
        if qt.name.startswith("Q5"):
            qh = raw[..., head : head + 4].copy().view("<u4")
            u = u | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        mn = flat(_f16(raw, 2)) if qt.has_min else None
        return flat(u), flat(d), mn
    if qt.name == "Q8_0":
        u = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return flat(u), flat(_f16(raw, 0)), None
    if qt.name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw, 0), _f16(raw, 2)
        sc, mn = _k_scales(raw[..., 4:16])
        if qt.name == "Q4_K":
            u = _k_nibbles(raw[..., 16:144])
        else:
            qh = raw[..., 16:48]
            high = np.stack([(qh >> (2 * c)) & 1 for c in range(4)] +
                            [(qh >> (2 * c + 1)) & 1 for c in range(4)], axis=-2)
            # high[..., 2c + p, l]: bit of sub-block 2c + p, input l
            order = [0, 4, 1, 5, 2, 6, 3, 7]
            high = high[..., order, :].reshape(*qh.shape[:-1], 256)
            u = _k_nibbles(raw[..., 48:176]) | (high << 4)
        return flat(u), flat(d * sc), flat(-(dmin * mn))
    if qt.name == "Q6_K":
        ql, qh = raw[..., 0:128], raw[..., 128:192]
        sc = raw[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(raw, 208)
        halves = []
        for h in range(2):
            lo, hi = ql[..., 64 * h : 64 * h + 64], qh[..., 32 * h : 32 * h + 32]
            halves += [
                (lo[..., :32] & 15) | (((hi >> 0) & 3) << 4),
                (lo[..., 32:] & 15) | (((hi >> 2) & 3) << 4),
                (lo[..., :32] >> 4) | (((hi >> 4) & 3) << 4),
                (lo[..., 32:] >> 4) | (((hi >> 6) & 3) << 4),
            ]
        return flat(np.concatenate(halves, axis=-1)), flat(d * sc), None
    raise ValueError(f"no unpacking for {qt.name}")


def _pack_values(u: np.ndarray, bits: int) -> np.ndarray:
    """u [G*16, K] -> the kernel's q [G, K/32, chunks, 16, 4]."""
    g = u.shape[0] // GROUP
    kb = u.shape[1] // BLOCK
    if bits == 8:
        return u.reshape(g, GROUP, kb, 8, 4).transpose(0, 2, 3, 1, 4)
    halves = u.reshape(g, GROUP, kb, 2, 4, 4)
    packed = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)
    return packed.transpose(0, 2, 3, 1, 4)


def _pack_scales(s: np.ndarray) -> np.ndarray:
    """[G*16, K/block] -> [G, K/block, 16]."""
    return s.reshape(-1, GROUP, s.shape[1]).transpose(0, 2, 1)


class QuantizedWeight:
    """A weight [n, k] in packed quantized form (see cpu/quant.cpp), on the CPU."""

    def __init__(
        self,
        qtype: QuantType,
        n: int,
        k: int,
        q: torch.Tensor,
        scale: torch.Tensor,
        min_: torch.Tensor | None,
    ) -> None:
        self.qtype, self.n, self.k = qtype, n, k
        self.q, self.scale, self.min = q, scale, min_
        self.struct = _QuantWeight(
            q.data_ptr(), scale.data_ptr(), None if min_ is None else min_.data_ptr(),
            n, k, qtype.bits, qtype.scale_block, qtype.zero, int(qtype.half_scales),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.min)
                   if t is not None)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.qtype.name}, n={self.n}, k={self.k})"

    @classmethod
    def empty(cls, qtype: QuantType, n: int, k: int) -> QuantizedWeight:
        groups = -(-n // GROUP)
        chunk_bytes = (4 if qtype.bits == 4 else 8) * 64
        scales = (groups, k // qtype.scale_block, GROUP)
        dtype = torch.float16 if qtype.half_scales else torch.float32
        return cls(
            qtype, n, k,
            torch.zeros(groups, k // BLOCK, chunk_bytes, dtype=torch.uint8),
            torch.zeros(scales, dtype=dtype),
            torch.zeros(scales, dtype=dtype) if qtype.has_min else None,
        )

    def _fill(
        self, first: int, u: np.ndarray, scale: np.ndarray, min_: np.ndarray | None
    ) -> None:
        """Pack rows first.. (first a multiple of 16) from their unpacked form."""
        rows = u.shape[0]
        padded = -(-rows // GROUP) * GROUP
        if padded != rows:  # the last group: zero weights past n
            pad = ((0, padded - rows), (0, 0))
            u = np.pad(u, pad)
            scale = np.pad(scale, pad)
            min_ = None if min_ is None else np.pad(min_, pad)
        g0, g1 = first // GROUP, first // GROUP + padded // GROUP
        self.q[g0:g1].numpy().reshape(-1)[:] = _pack_values(u, self.qtype.bits).reshape(-1)
        self.scale[g0:g1].numpy()[:] = _pack_scales(scale)
        if min_ is not None and self.min is not None:
            self.min[g0:g1].numpy()[:] = _pack_scales(min_)

    @classmethod
    def from_gguf(
        cls,
        raw: np.ndarray,
        ggml_type: int,
        n: int,
        k: int,
        done: Callable[[np.ndarray], None] | None = None,
    ) -> QuantizedWeight:
        """A weight [n, k] from its GGUF blocks (raw bytes, n rows of k inputs), a few
        thousand rows at a time; `done` is given each part of `raw` once it is packed."""
        qt = QUANT_TYPES[ggml_type]
        if k % qt.block_inputs:
            raise ValueError(f"{qt.name} rows of {k} inputs are not whole blocks")
        blocks = raw.reshape(n, k // qt.block_inputs, qt.block_bytes)
        w = cls.empty(qt, n, k)
        for first in range(0, n, _CHUNK):
            w._fill(first, *unpack_blocks(blocks[first : first + _CHUNK], qt))
            if done is not None:
                done(raw[first : first + _CHUNK])
        return w

    @classmethod
    def quantize_q8_0(cls, weight: torch.Tensor) -> QuantizedWeight:
        """Float weight [n, k] (k a multiple of 32) -> Q8_0 as ggml quantizes it: per 32
        inputs d = max|w| / 127, values round(w / d) (halves away from zero), d kept in
        float16."""
        n, k = weight.shape
        w = cls.empty(QUANT_TYPES[Q8_0], n, k)
        for first in range(0, n, _CHUNK):
            x = weight[first : first + _CHUNK].to(torch.float32).numpy()
            rows = x.shape[0]
            x = x.reshape(rows, k // BLOCK, BLOCK)
            d = np.abs(x).max(axis=-1, keepdims=True) / np.float32(127)
            inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d > 0)
            q = np.trunc(x * inv + np.copysign(np.float32(0.5), x)).astype(np.int16) + 128
            scale = d.astype(np.float16).astype(np.float32)
            w._fill(first, q.astype(np.uint8).reshape(rows, k), scale.reshape(rows, -1), None)
        return w

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """A copy of rows (dim 0, at multiples of 16) or inputs (dim 1, at multiples of 32)
        start .. start+length: a tensor-parallel shard."""
        unit = GROUP if dim == 0 else BLOCK
        if start % unit or (length % unit and start + length != self.shape[dim]):
            raise ValueError(
                f"a {self.qtype.name} weight {list(self.shape)} cannot be split at "
                f"{start}:{start + length} of dim {dim} (whole {unit}s only); use "
                "--quantization bf16 with this tensor-parallel size"
            )
        if dim == 0:
            g = slice(start // GROUP, -(-(start + length) // GROUP))
            parts = [self.q[g], self.scale[g], None if self.min is None else self.min[g]]
            n, k = length, self.k
        else:
            per = BLOCK // self.qtype.scale_block
            b = slice(start // BLOCK, (start + length) // BLOCK)
            s = slice(b.start * per, b.stop * per)
            parts = [self.q[:, b], self.scale[:, s], None if self.min is None else self.min[:, s]]
            n, k = self.n, length
        q, scale, min_ = (None if t is None else t.contiguous().clone() for t in parts)
        assert q is not None and scale is not None
        return QuantizedWeight(self.qtype, n, k, q, scale, min_)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` dequantized to `dtype` (an embedding lookup)."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"no dequantization to {dtype}")
        lib = _quant_library()
        ids = ids.to(torch.int64).contiguous()
        check_rows("token id", ids, self.n)
        out = torch.empty(ids.numel(), self.k, dtype=dtype)
        fn = lib.dequantize_rows_bf16 if dtype == torch.bfloat16 else lib.dequantize_rows_f32
        fn(ctypes.byref(self.struct), ids.data_ptr(), ids.numel(), out.data_ptr(),
           torch.get_num_threads())
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole weight [n, k] in floating point."""
        return self.rows(torch.arange(self.n), dtype)


def supported() -> bool:
    """Whether the quantized kernels are built here."""
    return library() is not None


def isa() -> str:
    """The instruction set the kernels were built for."""
    names = ("portable C++", "AVX2", "AVX-VNNI", "AVX512-VNNI")
    return names[_quant_library().quant_isa()]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 or float32, K a multiple of 32) -> the kernel's quantized rows."""
    lib = _quant_library()
    m, k = x.shape
    if k % BLOCK:
        raise ValueError(f"quantized GEMM inputs must be a multiple of {BLOCK}, not {k}")
    x = x.contiguous()
    buf = torch.empty(lib.quant_rows_bytes(m, k), dtype=torch.uint8)
    fn = lib.quantize_rows_bf16 if x.dtype == torch.bfloat16 else lib.quantize_rows_f32
    fn(x.data_ptr(), m, k, buf.data_ptr(), torch.get_num_threads())
    return buf


def quantized_rows_reference(buf: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """What `quantize_rows` stored, as the float64 rows [M, K] it stands for (int8 * d)."""
    q = buf[: m * k].view(torch.int8).to(torch.float64).view(m, k // BLOCK, BLOCK)
    d = buf[m * k : m * k + m * k // BLOCK * 4].view(torch.float32).to(torch.float64)
    return (q * d.view(m, -1, 1)).view(m, k)


def linear(
    x: torch.Tensor,
    parts: list[QuantizedWeight],
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ [parts side by side]^T (+ bias) (+ residual, after rounding) in x's dtype
    (bf16 or float32)."""
    lib = _quant_library()
    m = x.shape[0]
    n = sum(p.n for p in parts)
    assert all(p.k == x.shape[1] for p in parts)
    assert x.dtype in (torch.bfloat16, torch.float32)
    for t in (bias, residual):
        assert t is None or (t.dtype == x.dtype and t.is_contiguous())
    assert residual is None or residual.shape == (m, n)
    buf = quantize_rows(x)
    out = torch.empty(m, n, dtype=x.dtype)
    size = x.element_size()
    fn = lib.gemm_quant_bf16 if x.dtype == torch.bfloat16 else lib.gemm_quant_f32
    at = 0
    for p in parts:
        fn(buf.data_ptr(), m, ctypes.byref(p.struct), _at(bias, at, size),
           _at(residual, at, size), out.data_ptr() + at * size, n, torch.get_num_threads())
        at += p.n
    return out


def linear_reference(
    x: torch.Tensor, parts: list[QuantizedWeight], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """float64 x @ W^T (+ bias) over the dequantized weights: what `linear` approximates
    (it rounds x to int8 per 32 inputs)."""
    w = torch.cat([p.dequantize(torch.float32) for p in parts]).to(torch.float64)
    out = x.to(torch.float64) @ w.T
    return out if bias is None else out + bias.to(torch.float64)


class ExpertWeights:
    """A sparse layer's experts, every projection quantized, as `moe_experts` takes them:
    gate and up [I, hidden] and down [hidden, I] of each expert, in expert order."""

    def __init__(
        self,
        gate: list[QuantizedWeight],
        up: list[QuantizedWeight],
        down: list[QuantizedWeight],
    ) -> None:
        inter, hidden = gate[0].shape
        if any(w.shape != (inter, hidden) for w in (*gate, *up)) or any(
            w.shape != (hidden, inter) for w in down
        ):
            raise ValueError("experts of one layer must share their shapes")
        array = _QuantWeight * len(gate)
        self.gate, self.up, self.down = (array(*(w.struct for w in ws)) for ws in (gate, up, down))
        self._weights = (gate, up, down)  # the packed tensors the structs point into
        self.num_experts, self.hidden = len(gate), hidden

    @classmethod
    def of(cls, experts: list[tuple[object, object, object]]) -> ExpertWeights | None:
        """From each expert's (gate, up, down) weights where all are quantized and the native
        kernels are built here; else None."""
        weights = [w for expert in experts for w in expert]
        quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
        if not supported() or len(quantized) != len(weights):
            return None
        return cls(quantized[0::3], quantized[1::3], quantized[2::3])


def moe_route(
    x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bf16 row's top-k experts [T, k] and router weights [T, k] float32, as
    cpu/moe.cpp routes (the bf16 logits' softmax in float32; ties: the lower expert): the
    routing of the native layers, so the Python layers route the same way."""
    lib = _quant_library()
    assert x.dtype == router.dtype == torch.bfloat16 and router.is_contiguous()
    x = x.contiguous()
    experts = torch.empty(x.shape[0], top_k, dtype=torch.int64)
    weights = torch.empty(x.shape[0], top_k, dtype=torch.float32)
    lib.moe_route_bf16(x.data_ptr(), x.shape[0], x.shape[1], router.data_ptr(), router.shape[0],
                       top_k, int(renormalize), experts.data_ptr(), weights.data_ptr(),
                       torch.get_num_threads())
    return experts, weights


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                w: ExpertWeights) -> torch.Tensor:
    """x [T, hidden] bf16, each token's experts [T, k] and router weights [T, k] -> float32
    [T, hidden]: each token's weighted sum over its experts' gated SiLU MLPs (cpu/moe.cpp),
    every expert of the step in one native call."""
    lib = _quant_library()
    assert x.dtype == torch.bfloat16 and x.shape[1] == w.hidden
    experts = experts.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    check_rows("expert ids", experts, w.num_experts)
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.moe_quant_bf16(x.data_ptr(), x.shape[0], w.hidden, experts.shape[1], experts.data_ptr(),
                       weights.data_ptr(), w.gate, w.up, w.down, w.num_experts, out.data_ptr(),
                       torch.get_num_threads())
    return out


def _at(t: torch.Tensor | None, column: int, size: int) -> int | None:
    return None if t is None else t.data_ptr() + column * size


@functools.cache
def _quant_library() -> Any:
    lib = library()
    if lib is None:
        raise RuntimeError("quantized weights need the native CPU kernels (a C++ compiler)")
    lib.quant_isa.restype = _INT
    lib.quant_rows_bytes.argtypes = [_INT, _INT]
    lib.quant_rows_bytes.restype = ctypes.c_int64
    for name in ("quantize_rows_bf16", "quantize_rows_f32"):
        getattr(lib, name).argtypes = [_PTR, _INT, _INT, _PTR, _INT]
        getattr(lib, name).restype = None
    for name in ("gemm_quant_bf16", "gemm_quant_f32"):
        getattr(lib, name).argtypes = [_PTR, _INT, ctypes.POINTER(_QuantWeight)] + [_PTR] * 3 + [
            _INT, _INT
        ]
        getattr(lib, name).restype = None
    weights = ctypes.POINTER(_QuantWeight)
    lib.moe_quant_bf16.argtypes = [_PTR, _INT, _INT, _INT, _PTR, _PTR, weights, weights, weights,
                                   _INT, _PTR, _INT]
    lib.moe_quant_bf16.restype = None
    lib.moe_route_bf16.argtypes = [_PTR, _INT, _INT, _PTR, _INT, _INT, _INT, _PTR, _PTR, _INT]
    lib.moe_route_bf16.restype = None
    for name in ("dequantize_rows_bf16", "dequantize_rows_f32"):
        getattr(lib, name).argtypes = [ctypes.POINTER(_QuantWeight), _PTR, _INT, _PTR, _INT]
        getattr(lib, name).restype = None
    return lib
