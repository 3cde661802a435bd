"""KV store: scatter a step's new K/V rows into their pool slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kernel(
    k_ptr,
    v_ptr,
    k_pool_ptr,
    v_pool_ptr,
    slots_ptr,
    stride_kt,
    stride_vt,
    stride_ks,
    stride_vs,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    # A negative slot marks a padding row of a captured batch: it owns no pool storage.
    ok = (cols < ROW) & (slot >= 0)
    k = tl.load(k_ptr + token * stride_kt + cols, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + cols, mask=ok)
    tl.store(k_pool_ptr + slot * stride_ks + cols, k, mask=ok)
    tl.store(v_pool_ptr + slot * stride_vs + cols, v, mask=ok)


def _check_rows(t: torch.Tensor) -> None:
    assert t.stride(2) == 1 and t.stride(1) == t.shape[2], "each token's heads must be dense"


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    block: int = 1024,
) -> None:
    """Write k/v [T, Hkv, D] into k_pool/v_pool [S, Hkv, D] at slots [T]; slot -1 is skipped."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    for t in (k, v, k_pool, v_pool):
        _check_rows(t)
    row = k.shape[1] * k.shape[2]
    block = min(block, triton.next_power_of_2(row))
    _store_kernel[(tokens, triton.cdiv(row, block))](
        k,
        v,
        k_pool,
        v_pool,
        slots,
        k.stride(0),
        v.stride(0),
        k_pool.stride(0),
        v_pool.stride(0),
        ROW=row,
        BLOCK=block,
        num_warps=4,
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    block: int = 1024,
) -> None:
    """index_copy_ of the rows whose slot is not negative."""
    keep = slots >= 0
    k_pool.index_copy_(0, slots[keep].long(), k[keep])
    v_pool.index_copy_(0, slots[keep].long(), v[keep])
