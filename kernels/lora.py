"""Segmented LoRA: each token's adapter adds B_s (A_s x) to a projection's output, for
every adapter of a step in two grouped GEMMs, shrink then expand.

The tokens are sorted by adapter slot and each slot's run padded to whole BLOCK_M blocks
(`align_picks`, as the fused MoE sorts picks by expert; no host sync), so every block is one
adapter's. Tokens without an adapter (slot -1) form a last group whose blocks do nothing.
Shrink writes h [rows, R] = x[token] @ A[slot].T for every padded row (zeros past an
adapter's tokens); expand adds h @ B[slot].T into each token's row of `out` in place. A
token has one adapter, so no two programs write one element of `out`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.common import mma, upcast_dots
from radixmesh.kernels.fused_moe import AlignedPicks, align_picks


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    rows_ptr,
    block_slots_ptr,
    num_blocks_ptr,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_hm,
    stride_hr,
    R,
    K,
    NUM_TOKENS,
    NO_ADAPTER,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (row block, R tile) of h = x[tokens] @ A[slot].T, for the block's adapter."""
    block = tl.program_id(0)
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    tokens = tl.load(rows_ptr + offs_m)
    valid = tokens < NUM_TOKENS
    r_ok = offs_r < R
    slot = tl.load(block_slots_ptr + block).to(tl.int64)
    # Blocks past the valid ones, and those of tokens without an adapter, run no K steps.
    k_end = tl.where((block < tl.load(num_blocks_ptr)) & (slot != NO_ADAPTER), K, 0)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        acc += mma(x, a, UPCAST)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_r[None, :] * stride_hr
    tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    out_ptr,
    rows_ptr,
    block_slots_ptr,
    num_blocks_ptr,
    stride_hm,
    stride_hr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    N,
    R,
    NUM_TOKENS,
    NO_ADAPTER,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (row block, N tile) of out[tokens] += h @ B[slot].T, for the block's adapter."""
    block = tl.program_id(0)
    slot = tl.load(block_slots_ptr + block).to(tl.int64)
    if (block < tl.load(num_blocks_ptr)) & (slot != NO_ADAPTER):
        offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        tokens = tl.load(rows_ptr + offs_m)
        valid = tokens < NUM_TOKENS
        n_ok = offs_n < N
        h_ptrs = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm + offs_r[None, :] * stride_hr
        b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * \
            stride_br
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r_ok = offs_r < R - r0
            h = tl.load(h_ptrs, mask=r_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc += mma(h, b, UPCAST)
            h_ptrs += BLOCK_R * stride_hr
            b_ptrs += BLOCK_R * stride_br
        ok = valid[:, None] & n_ok[None, :]
        out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * \
            stride_on
        total = tl.load(out_ptrs, mask=ok, other=0.0).to(tl.float32) + \
            acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)


def align_tokens(slots: torch.Tensor, num_slots: int, block_m: int) -> AlignedPicks:
    """slots [T] (each token's adapter slot, -1 for none) -> the tokens sorted by slot in
    blocks of `block_m`, one slot's each; tokens without an adapter are the group
    `num_slots`, whose blocks the kernels skip."""
    groups = torch.where(slots < 0, num_slots, slots).long()
    return align_picks(groups[:, None], num_slots + 1, block_m)


def lora_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             out: torch.Tensor, aligned: AlignedPicks | None = None, block_m: int = 16,
             block_n: int = 64, block_k: int = 64) -> None:
    """out[t] += B[s] @ (A[s] @ x[t]) in place for each token t whose slot s = slots[t] is
    not -1. x [T, K], a [S, R, K], b [S, N, R] (all one dtype), out [T, N] (a column slice
    of a wider output may do). h rounds to x's dtype between the two products, as torch's
    two matmuls round. `aligned`: align_tokens(slots, S, block_m), shared by a step's
    projections."""
    tokens, k = x.shape
    num_slots, rank, n = a.shape[0], a.shape[1], b.shape[1]
    assert a.shape[2] == k and b.shape == (num_slots, n, rank) and out.shape == (tokens, n)
    if tokens == 0:
        return
    if aligned is None:
        aligned = align_tokens(slots, num_slots, block_m)
    rows, blocks = aligned.rows.numel(), aligned.block_experts.numel()
    h = torch.empty(rows, rank, dtype=x.dtype, device=x.device)
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    block_n = min(block_n, max(16, triton.next_power_of_2(n)))
    upcast = upcast_dots(x.dtype)
    _lora_shrink_kernel[(blocks, triton.cdiv(rank, block_r))](
        x, a, h, aligned.rows, aligned.block_experts, aligned.num_blocks,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
        h.stride(0), h.stride(1), rank, k, tokens, num_slots,
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, UPCAST=upcast, num_warps=4,
    )
    _lora_expand_kernel[(blocks, triton.cdiv(n, block_n))](
        h, b, out, aligned.rows, aligned.block_experts, aligned.num_blocks,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), n, rank, tokens, num_slots,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, UPCAST=upcast, num_warps=4,
    )


def lora_add_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       slots: torch.Tensor, out: torch.Tensor) -> None:
    """What lora_add computes, one adapter at a time in torch."""
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().flatten()
        delta = (x.index_select(0, rows) @ a[slot].T) @ b[slot].T
        out.index_add_(0, rows, delta.to(out.dtype))
