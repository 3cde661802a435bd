"""Decode attention over the paged KV pool: one query token per request, split-K + merge."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.common import load_slots, mma, upcast_dots
from radixmesh.kernels.paging import table_slots

_LOG2E = 1.4426950408889634
# Splits never exceed this: past it the merge pass costs more than the extra parallelism buys.
_MAX_SPLITS = 32


@triton.jit
def soft_cap(scores, SOFTCAP: tl.constexpr):
    """Base-2 logits capped to SOFTCAP * tanh(scores / SOFTCAP), SOFTCAP being the natural
    logits' cap times log2(e): the same as capping the natural logits. tanh(x) = 1 - 2 /
    (exp(2x) + 1), as the interpreter has no tanh."""
    return SOFTCAP * (1.0 - 2.0 / (tl.exp(scores * (2.0 / SOFTCAP)) + 1.0))


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,
    num_splits,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,  # in base-2 logits, as the scores are (see soft_cap)
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    # The splits share out the keys the query sees (with a window, only the last WINDOW); each
    # takes a whole number of blocks, so only the last block of a split is partial.
    first = tl.maximum(seq_len - WINDOW, 0) if WINDOW > 0 else 0
    chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        slot = load_slots(table_ptr + b * stride_tb, pos, ok, PAGE_SIZE)
        kv_mask = ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        scores = mma(q, tl.trans(k), UPCAST) * qk_scale
        if SOFTCAP > 0:
            scores = soft_cap(scores, SOFTCAP)
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
        m = m_new

    # An empty split (a short sequence, or a padding row) leaves m = -inf and denom = 0.
    has = denom > 0
    out = acc / tl.where(has, denom, 1.0)[:, None]
    lse = tl.where(has, m + tl.log2(tl.where(has, denom, 1.0)), float("-inf"))
    mid = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split
    tl.store(
        mid_o_ptr + mid[:, None] * HEAD_DIM + dims[None, :],
        out,
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    tl.store(mid_lse_ptr + mid, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    sinks_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM
    mid = (b * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(mid_lse_ptr + mid, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    if HAS_SINKS:  # the head's sink: one more part of the softmax, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    # A row with nothing to attend to (a padding row) has every lse at -inf: it gets zeros.
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - top)
    parts = tl.load(
        mid_o_ptr + mid[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def pick_num_splits(
    batch: int, kv_heads: int, max_len: int, block_n: int, device: torch.device
) -> int:
    """Splits per (request, KV head) that give the GPU about two programs per SM.

    Depends only on shapes, never on the lengths' values, so a captured CUDA graph stays valid."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 2
    wanted = triton.cdiv(2 * sms, max(1, batch * kv_heads))
    return max(1, min(wanted, triton.cdiv(max_len, block_n), _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
    num_splits: int | None = None,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D] over the first seq_lens[b] tokens of row b of page_table -> [B, Hq, D].

    page_table [B, W] int32 holds slots when page_size is 1, else page indices (slot =
    page * page_size + offset). A row with seq_len 0 yields zeros. window > 0: the query
    (the last token) sees only the last `window` tokens. softcap > 0: scaled scores become
    softcap * tanh(scores / softcap) before the softmax. sinks [Hq]: each head's logit that
    joins the softmax's denominator (gpt-oss)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    assert q_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(2) == k_pool.stride(2) == v_pool.stride(2) == 1
    group = q_heads // kv_heads
    if num_splits is None:
        max_len = page_table.shape[1] * page_size
        if window > 0:
            max_len = min(max_len, window)
        num_splits = pick_num_splits(batch, kv_heads, max_len, block_n, q.device)
    mid_o = torch.empty(batch, q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    _split_kernel[(batch, kv_heads, num_splits)](
        q,
        k_pool,
        v_pool,
        page_table,
        seq_lens,
        mid_o,
        mid_lse,
        scale * _LOG2E,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        page_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        UPCAST=upcast_dots(q.dtype),
        WINDOW=window,
        SOFTCAP=softcap * _LOG2E,
        num_warps=4,
        num_stages=2,
    )
    _merge_kernel[(batch, q_heads)](
        mid_o,
        mid_lse,
        out,
        mid_lse if sinks is None else sinks,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
        HAS_SINKS=sinks is not None,
        num_warps=4,
    )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    page_size: int = 1,
    num_splits: int | None = None,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time, softmax in float32 (split arguments are ignored)."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_pool.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        slots = table_slots(page_table[b], n, page_size)
        if window > 0:
            slots = slots[-window:]
        keys = k_pool[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        values = v_pool[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        out[b] = torch.einsum("hn,nhd->hd", sink_softmax(scores, sinks), values).to(q.dtype)
    return out


def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of scores [H, ..., N]; with sinks [H] each head's sink joins
    the denominator (the references' form of it)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
