"""Extend (prefill) attention: new tokens see their cached prefix and, causally, each other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixmesh.kernels.common import load_slots, mma, upcast_dots
from radixmesh.kernels.decode_attention import sink_softmax, soft_cap
from radixmesh.kernels.paging import table_slots

_LOG2E = 1.4426950408889634


@triton.jit
def _online_update(m, denom, acc, scores, v, UPCAST: tl.constexpr, EMPTY_ROWS: tl.constexpr):
    """Fold one block of scores (base-2 logits, -inf where masked) and values into the state.

    EMPTY_ROWS: a row may have seen no key yet and none in this block either (a window);
    it then stays empty (m = -inf, denom = 0) instead of turning NaN."""
    m_new = tl.maximum(m, tl.max(scores, 1))
    top = tl.where(m_new == float("-inf"), 0.0, m_new) if EMPTY_ROWS else m_new
    alpha = tl.exp2(m - top)
    p = tl.exp2(scores - top[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return m_new, denom, acc


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_pool_ptr,
    v_pool_ptr,
    out_ptr,
    table_ptr,
    q_starts_ptr,
    q_lens_ptr,
    prefix_lens_ptr,
    sinks_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ks,
    stride_kph,
    stride_vs,
    stride_vph,
    stride_ot,
    stride_oh,
    stride_tb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,  # in base-2 logits, as the scores are (see soft_cap)
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    q_block = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + b)
    if q_block * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_starts_ptr + b)
    prefix = tl.load(prefix_lens_ptr + b)
    kv_head = head // GROUP

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    dim_ok = dims < HEAD_DIM
    tokens = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the head's sink starts the softmax: a logit with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.full([BLOCK_M], 1.0, tl.float32) * sink
        denom = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # New token r sits at key position prefix + r. With a window it sees key positions after
    # prefix + r - WINDOW, so the block's first row bounds where reading starts.
    if WINDOW > 0:
        first = tl.maximum(prefix + q_block * BLOCK_M - WINDOW + 1, 0)
        first_new = tl.maximum(q_block * BLOCK_M - WINDOW + 1, 0)
    else:
        first = 0
        first_new = 0

    # The cached prefix, read through the page table: without a window every new token sees
    # all of it.
    for n0 in range(first, prefix, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < prefix
        slot = load_slots(table_ptr + b * stride_tb, pos, ok, PAGE_SIZE)
        kv_mask = ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_pool_ptr + slot[:, None] * stride_ks + kv_head * stride_kph + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        scores = mma(q, tl.trans(k), UPCAST) * qk_scale
        if SOFTCAP > 0:
            scores = soft_cap(scores, SOFTCAP)
        visible = ok[None, :]
        if WINDOW > 0:
            visible = visible & (pos[None, :] > prefix + rows[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(
            v_pool_ptr + slot[:, None] * stride_vs + kv_head * stride_vph + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        m, denom, acc = _online_update(m, denom, acc, scores, v, UPCAST, WINDOW > 0)

    # The new tokens themselves, read from the step's K/V: causal, so stop at the diagonal.
    end = tl.minimum(q_len, (q_block + 1) * BLOCK_M)
    for n0 in range(first_new, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_ok = cols < q_len
        col_tokens = (q_start + cols).to(tl.int64)
        kv_mask = col_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_ptr + col_tokens[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        scores = mma(q, tl.trans(k), UPCAST) * qk_scale
        if SOFTCAP > 0:
            scores = soft_cap(scores, SOFTCAP)
        visible = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
        if WINDOW > 0:
            visible = visible & (cols[None, :] > rows[:, None] - WINDOW)
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(
            v_ptr + col_tokens[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
            mask=kv_mask,
            other=0.0,
        )
        m, denom, acc = _online_update(m, denom, acc, scores, v, UPCAST, WINDOW > 0)

    # Every row sees at least its own token, so denom > 0 on the rows that are stored.
    out = acc / tl.where(row_ok, denom, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    page_size: int = 1,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens q [T, Hq, D] (k/v [T, Hkv, D]) for B ragged requests.

    Request b owns rows q_starts[b] : q_starts[b] + q_lens[b]; they see its first
    prefix_lens[b] cached tokens (row b of page_table, as in decode_attention) and each
    other causally. Only those rows of `out` ([T, Hq, D], made when None) are written.
    window > 0: new token i, at key position prefix_lens[b] + i, sees only the `window`
    positions up to its own. softcap > 0: scaled scores become softcap * tanh(scores /
    softcap) before the softmax. sinks [Hq]: each head's logit that joins the softmax's
    denominator (gpt-oss)."""
    q_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    assert q_heads % kv_heads == 0, "query heads must be a multiple of KV heads"
    for t in (q, k, v, k_pool, v_pool):
        assert t.stride(2) == 1, "the head dimension must be contiguous"
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    batch = q_lens.shape[0]
    if batch == 0 or max_q_len == 0:
        return out
    grid = (batch, q_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q,
        k,
        v,
        k_pool,
        v_pool,
        out,
        page_table,
        q_starts,
        q_lens,
        prefix_lens,
        q_lens if sinks is None else sinks,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=q_heads // kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
        UPCAST=upcast_dots(q.dtype),
        WINDOW=window,
        SOFTCAP=softcap * _LOG2E,
        HAS_SINKS=sinks is not None,
        num_warps=4,
        num_stages=2,
    )
    return out


def extend_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    page_size: int = 1,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time, softmax in float32 (block sizes are ignored)."""
    out = torch.zeros_like(q) if out is None else out
    group = q.shape[1] // k.shape[1]
    for b, (start, n, prefix) in enumerate(
        zip(q_starts.tolist(), q_lens.tolist(), prefix_lens.tolist(), strict=True)
    ):
        slots = table_slots(page_table[b], prefix, page_size)
        keys = torch.cat((k_pool[slots], k[start : start + n])).float()
        values = torch.cat((v_pool[slots], v[start : start + n])).float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].float(), keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        hidden = torch.ones(n, prefix + n, dtype=torch.bool, device=q.device).triu(prefix + 1)
        if window > 0:
            hidden |= torch.ones_like(hidden).tril(prefix - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        attended = torch.einsum("hqk,khd->qhd", sink_softmax(scores, sinks), values)
        out[start : start + n] = attended.to(q.dtype)
    return out
