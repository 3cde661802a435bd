"""Structured output: a packed vocabulary bitmask applied to logits before sampling."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bitmask_kernel(
    logits_ptr,
    mask_ptr,
    stride_l,
    stride_m,
    VOCAB: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < VOCAB
    covered = tokens < 32 * WORDS
    words = tl.load(mask_ptr + row * stride_m + tokens // 32, mask=in_vocab & covered, other=0)
    allowed = ((words >> (tokens % 32)) & 1) == 1
    tl.store(logits_ptr + row * stride_l + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 1024) -> None:
    """Set logits [B, V] to -inf in place where the token's bit in bitmask [B, W] int32 is 0.

    Bit i of word w stands for token 32 * w + i (set: allowed); tokens past 32 * W are masked."""
    rows, vocab = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == rows and logits.stride(1) == 1
    if rows:
        block = min(block, triton.next_power_of_2(vocab))
        _bitmask_kernel[(rows, triton.cdiv(vocab, block))](
            logits,
            bitmask,
            logits.stride(0),
            bitmask.stride(0),
            VOCAB=vocab,
            WORDS=bitmask.shape[1],
            BLOCK=block,
            num_warps=4,
        )


def apply_token_bitmask_reference_(
    logits: torch.Tensor, bitmask: torch.Tensor, block: int = 1024
) -> None:
    """The same in plain torch."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)  # [B, 32 * W]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits.masked_fill_(~allowed[:, :vocab], float("-inf"))
