"""Rotary position embedding in place of a table lookup + elementwise torch ops."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    x_row = x_ptr + token * stride_xt + head * stride_xh
    o_row = out_ptr + token * stride_ot + head * stride_oh
    # Dimensions past the rotary ones (partial rotary) pass through unchanged.
    dims = tl.arange(0, BLOCK_D)
    tail = (dims >= 2 * HALF) & (dims < HEAD_DIM)
    tl.store(o_row + dims, tl.load(x_row + dims, mask=tail), mask=tail)

    pairs = tl.arange(0, BLOCK_HALF)
    ok = pairs < HALF
    if NEOX:
        first, second = pairs, pairs + HALF  # rotate halves
    else:
        first, second = 2 * pairs, 2 * pairs + 1  # rotate adjacent pairs (GPT-J)
    cos = tl.load(cos_ptr + pos * stride_cos + pairs, mask=ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + pairs, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(x_row + first, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(x_row + second, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_row + first, (a * cos - b * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o_row + second, (b * cos + a * sin).to(out_ptr.dtype.element_ty), mask=ok)


def rotary_embedding(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool = True,
) -> torch.Tensor:
    """Rotate x [T, H, D] by the angles of each token's position.

    cos/sin [max_positions, R/2] hold one value per rotated pair; the first R <= D dims
    rotate. neox pairs dim i with i + R/2 (Llama, Qwen); otherwise 2i with 2i + 1 (GPT-J)."""
    tokens, heads, head_dim = x.shape
    half = cos.shape[1]
    assert 2 * half <= head_dim and x.stride(2) == 1 and cos.stride(1) == sin.stride(1) == 1
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if tokens:
        _rotary_kernel[(tokens, heads)](
            x,
            out,
            positions,
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            sin.stride(0),
            HEAD_DIM=head_dim,
            HALF=half,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_D=triton.next_power_of_2(head_dim),
            NEOX=neox,
            num_warps=1,
        )
    return out


def rotary_embedding_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool = True,
) -> torch.Tensor:
    """The same in plain torch, in float32."""
    half = cos.shape[1]
    c = cos[positions.long()].float().unsqueeze(1)  # [T, 1, R/2]
    s = sin[positions.long()].float().unsqueeze(1)
    xf = x.float()
    rot = xf[..., : 2 * half]
    if neox:
        a, b = rot[..., :half], rot[..., half:]
        rotated = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    return torch.cat((rotated, xf[..., 2 * half :]), dim=-1).to(x.dtype)
