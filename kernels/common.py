"""What every kernel shares: interpreter detection, a matrix product that survives it, and
the page-table lookup of the attention kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs


def interpreting() -> bool:
    """Whether kernels run on the CPU under the Triton interpreter (TRITON_INTERPRET=1)."""
    return bool(knobs.runtime.interpret)


def upcast_dots(dtype: torch.dtype) -> bool:
    """Whether tl.dot must see float32 operands: the interpreter multiplies bfloat16 as raw
    16-bit integers, and products of bf16 values are exact in float32 anyway."""
    return interpreting() and dtype != torch.float32


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """a @ b accumulated in float32; float32 inputs multiply in IEEE float32, not TF32."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def load_slots(row_ptr, pos, ok, PAGE_SIZE: tl.constexpr):
    """KV pool slots (int64) of token positions `pos` through one page-table row."""
    if PAGE_SIZE == 1:
        slot = tl.load(row_ptr + pos, mask=ok, other=0)
    else:
        page = tl.load(row_ptr + pos // PAGE_SIZE, mask=ok, other=0)
        slot = page * PAGE_SIZE + pos % PAGE_SIZE
    return slot.to(tl.int64)
