"""Fused mixture-of-experts: every expert's gated SiLU MLP over its tokens in two grouped
GEMMs, each token's picks weighted and summed.

The T*k (token, expert) picks are sorted by expert and each expert's run is padded to a
multiple of BLOCK_M (`align_picks`), so every block of BLOCK_M rows belongs to one expert
and an expert no token picks gets no block. The first GEMM gathers each row's token from x
and writes [rows, 2I] = [gate | up]; `silu_and_mul` takes it to [rows, I]; the second GEMM
multiplies by down, scales each row by its routing weight (in float32) and writes it to
its pick's row of a [T*k, H] in x's dtype; torch sums each token's k picks in float32.
Nothing waits on the GPU: the padded size is a bound from the shapes, and blocks past the
valid ones run no K steps (the first GEMM writes their rows as zeros, so the activation
reads no uninitialized memory)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from radixmesh.kernels.activation import silu_and_mul, silu_and_mul_reference
from radixmesh.kernels.common import mma, upcast_dots


class AlignedPicks(NamedTuple):
    """The picks sorted by expert in blocks of BLOCK_M rows, each block one expert's.

    rows [blocks * BLOCK_M] int32: each row's pick (token * k + j), T*k on padding rows;
    block_experts [blocks] int32: each block's expert; num_blocks [1] int32: how many of
    the blocks are valid (the first ones; `blocks` is a bound from the shapes)."""

    rows: torch.Tensor
    block_experts: torch.Tensor
    num_blocks: torch.Tensor


def align_picks(experts: torch.Tensor, num_experts: int, block_m: int) -> AlignedPicks:
    """experts [T, k] -> the picks aligned to blocks of `block_m`, without a host sync."""
    picks = experts.flatten().long()
    n, device = picks.numel(), picks.device
    # Each expert that is picked pads at most block_m - 1 rows.
    bound = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, picks, torch.ones_like(picks))
    blocks = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks, 0)
    order = torch.argsort(picks, stable=True)
    sorted_experts = picks[order]
    # A sorted pick's row: its expert's first row plus its rank among the expert's picks.
    first_row = (block_ends - blocks) * block_m
    first_pick = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=device) - first_pick[sorted_experts]
    rows = torch.full((bound * block_m,), n, dtype=torch.int32, device=device)
    rows[first_row[sorted_experts] + rank] = order.to(torch.int32)
    # Blocks past the valid ones get expert num_experts, which nothing reads.
    block_experts = torch.searchsorted(
        block_ends, torch.arange(bound, device=device), right=True
    )
    return AlignedPicks(rows, block_experts.to(torch.int32), block_ends[-1:].to(torch.int32))


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    rows_ptr,
    block_experts_ptr,
    num_blocks_ptr,
    scale_ptr,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    N,
    K,
    NUM_PICKS,
    TOP_K: tl.constexpr,
    GATHER: tl.constexpr,
    SCATTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (row block, N tile) of out = a @ w[expert].T for the block's expert.

    GATHER: a's rows are tokens, each row reads its pick's (pick // TOP_K); else a's rows
    are the padded rows. SCATTER: each row is scaled by its pick's routing weight and
    written to the pick's row of out, padding rows nowhere; else every padded row is
    written (zeros for padding rows and for blocks past the valid ones)."""
    block = tl.program_id(0)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    picks = tl.load(rows_ptr + offs_m)
    valid = picks < NUM_PICKS
    n_ok = offs_n < N
    a_rows = (picks // TOP_K).to(tl.int64) if GATHER else offs_m.to(tl.int64)
    # A block past the valid ones runs no K steps.
    k_end = tl.where(block < tl.load(num_blocks_ptr), K, 0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += mma(a, w, UPCAST)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if SCATTER:
        acc *= tl.load(scale_ptr + picks, mask=valid, other=0.0)[:, None]
        out_rows = picks.to(tl.int64)
        ok = valid[:, None] & n_ok[None, :]
    else:
        out_rows = offs_m.to(tl.int64)
        ok = n_ok[None, :]
    out_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: AlignedPicks,
    scale: torch.Tensor,
    top_k: int,
    scatter: bool,
    block_m: int,
    block_n: int,
    block_k: int,
) -> None:
    """out rows = a rows @ w[expert].T over the aligned picks (see _grouped_gemm_kernel):
    gathering tokens and writing padded rows, or reading padded rows and scattering picks."""
    n, k = w.shape[1], w.shape[2]
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    grid = (aligned.block_experts.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a,
        w,
        out,
        aligned.rows,
        aligned.block_experts,
        aligned.num_blocks,
        scale,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        n,
        k,
        scale.numel(),
        TOP_K=top_k,
        GATHER=not scatter,
        SCATTER=scatter,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        UPCAST=upcast_dots(a.dtype),
        num_warps=4,
    )


def pick_block_m(picks: int, num_experts: int) -> int:
    """BLOCK_M from shapes alone: about the picks an expert gets on average, 16 to 64."""
    return min(64, max(16, triton.next_power_of_2(triton.cdiv(picks, num_experts))))


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """x [T, H] (bf16 or float32), w_gate_up [E, 2I, H] (gate rows, then up), w_down
    [E, H, I], experts [T, k] (each token's experts), weights [T, k] float32 -> out [T, H]
    in x's dtype: each token's sum over its picks of weight * down_e(silu(gate_e x) *
    up_e x), accumulated in float32. gate|up, the activation and each weighted pick round
    to x's dtype, as torch's per-expert MLP rounds its three outputs. block_m None:
    `pick_block_m`."""
    tokens, hidden = x.shape
    num_experts, top_k = w_gate_up.shape[0], experts.shape[1]
    assert w_gate_up.dtype == w_down.dtype == x.dtype and weights.dtype == torch.float32
    assert w_gate_up.shape[1] == 2 * w_down.shape[2] and hidden == w_gate_up.shape[2]
    assert w_down.shape[:2] == (num_experts, hidden) and weights.shape == experts.shape
    if tokens == 0:
        return torch.empty_like(x)
    if block_m is None:
        block_m = pick_block_m(tokens * top_k, num_experts)
    aligned = align_picks(experts, num_experts, block_m)
    scale = weights.flatten()
    rows = aligned.rows.numel()
    gate_up = torch.empty(rows, w_gate_up.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w_gate_up, gate_up, aligned, scale, top_k, False, block_m, block_n, block_k)
    act = silu_and_mul(gate_up)
    per_pick = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w_down, per_pick, aligned, scale, top_k, True, block_m, block_n, block_k)
    return per_pick.view(tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def fused_moe_reference(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """The same as a loop over the picked experts in plain torch: each expert's tokens
    through gate|up (in x's dtype), silu(gate) * up (in float32, rounded to x's dtype) and
    down, scaled by their routing weights and added to their tokens' float32 sums."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in experts.unique().tolist():
        token, pick = (experts == e).nonzero(as_tuple=True)
        act = silu_and_mul_reference(F.linear(x[token], w_gate_up[e]))
        down = F.linear(act, w_down[e]).float()
        out.index_add_(0, token, weights[token, pick, None] * down)
    return out.to(x.dtype)
