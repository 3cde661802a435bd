"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_n,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # Round the sum to the model dtype first: that rounded value is the residual stream.
        x = x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = x.to(new_residual_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_n + cols, x, mask=ok)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=ok
    )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    assert x.dim() == 2 and x.stride(1) == 1, "rows of x must be dense"
    rows, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    new_residual = None if residual is None else torch.empty_like(out)
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight,
            out,
            out if new_residual is None else new_residual,
            eps,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            out.stride(0),
            out.stride(0),
            HIDDEN=hidden,
            BLOCK=triton.next_power_of_2(hidden),
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, triton.next_power_of_2(hidden) // 256)),
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H] * rsqrt(mean(x^2) + eps) * weight, computed in float32, in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the normed input of the next sublayer and the
    new residual stream, in one pass over memory."""
    assert residual.shape == x.shape and residual.stride(1) == 1
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same in plain torch."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * weight.float()).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(new_residual, weight, eps), new_residual
