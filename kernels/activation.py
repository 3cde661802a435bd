"""SiLU-and-mul: the gated MLP's activation over the fused gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, WIDTH: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I], computed in float32."""
    rows, width = x.shape[0], x.shape[1] // 2
    assert x.shape[1] == 2 * width and x.stride(1) == 1
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        block = min(block, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](
            x, out, x.stride(0), out.stride(0), WIDTH=width, BLOCK=block, num_warps=4
        )
    return out


def silu_and_mul_reference(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The same in plain torch."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
