"""Decode and extend attention kernels against their torch references, on CPU under the
Triton interpreter.

Tolerances: float32 atol = rtol = 1e-5 (only summation order differs). bfloat16 atol = rtol
= 2e-2: softmax weights are rounded to bf16 before the value product, as on the GPU, and the
interpreter truncates float32 -> bf16 where the GPU rounds to nearest, so outputs (|x| < 4)
may differ by one or two bf16 ulps (2**-6 at 2..4)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest
import torch

from radixmesh.kernels.decode_attention import (
    decode_attention,
    decode_attention_reference,
    pick_num_splits,
)
from radixmesh.kernels.extend_attention import extend_attention, extend_attention_reference
from radixmesh.kernels.paging import page_table

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-5, BF16: 2e-2}
# (dtype, page size, query heads, KV heads, head dim): MHA, GQA 3, 4 and 8, head dims 64, 128
# and one that is not a power of 2; each dtype meets both page sizes and head dims 64 and 128.
CASES = [
    (F32, 1, 2, 2, 64),
    (BF16, 16, 2, 2, 64),
    (F32, 16, 8, 1, 128),
    (BF16, 1, 8, 1, 128),
    (F32, 1, 6, 2, 48),
    (BF16, 16, 4, 1, 64),
]
SHAPE = ("dtype", "page_size", "q_heads", "kv_heads", "dim")
IDS = [f"{str(c[0])[6:]}-page{c[1]}-{c[2]}q{c[3]}kv-d{c[4]}" for c in CASES]
BLOCK = 16  # small blocks, so short sequences still cross block and split boundaries


def paged_slots(
    lengths: list[int], page_size: int, pool_pages: int, seed: int
) -> list[torch.Tensor]:
    """Each request's token slots: whole pages scattered over the pool in random order."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(pool_pages, generator=g)
    out, used = [], 0
    for n in lengths:
        count = -(-n // page_size)
        mine = pages[used : used + count]
        used += count
        out.append((mine[:, None] * page_size + torch.arange(page_size)).flatten()[:n])
    return out


def pools(slots: int, kv_heads: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(slots, kv_heads, dim).to(dtype) for _ in range(2))


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(SHAPE, CASES, ids=IDS)
def test_decode_matches_reference(dtype, page_size, q_heads, kv_heads, dim):
    torch.manual_seed(0)
    # one token, an empty (padding) row, exactly two blocks, one past, and a long one
    lengths = [1, 0, 2 * BLOCK, 2 * BLOCK + 1, 100]
    k_pool, v_pool = pools(1024, kv_heads, dim, dtype)
    table = page_table(paged_slots(lengths, page_size, 1024 // page_size, 1), page_size)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), q_heads, dim).to(dtype)
    expected = decode_attention_reference(q, k_pool, v_pool, table, seq_lens, dim**-0.5, page_size)
    assert expected[1].abs().max() == 0
    # 1 split; 3 (uneven chunks); 7 (more splits than a short request has blocks)
    for splits in (1, 3, 7):
        out = decode_attention(
            q, k_pool, v_pool, table, seq_lens, dim**-0.5, page_size, splits, block_n=BLOCK
        )
        assert out.dtype == dtype and out.shape == q.shape
        close(out, expected, dtype)


def test_decode_default_blocks_and_strided_query():
    """q as the model makes it (a slice of a wider q|k tensor) and the default launch shape."""
    torch.manual_seed(1)
    lengths = [70, 3, 129]
    k_pool, v_pool = pools(512, 2, 64, torch.float32)
    table = page_table(paged_slots(lengths, 1, 512, 2), 1)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(3, 8 + 2, 64)[:, :8]
    out = decode_attention(q, k_pool, v_pool, table, seq_lens, 0.125)
    close(out, decode_attention_reference(q, k_pool, v_pool, table, seq_lens, 0.125), torch.float32)


def test_num_splits_depends_only_on_shapes():
    cpu = torch.device("cpu")
    assert pick_num_splits(1, 1, 4096, 64, cpu) == 4
    assert pick_num_splits(64, 8, 4096, 64, cpu) == 1
    assert pick_num_splits(1, 1, 10, 64, cpu) == 1


@pytest.mark.parametrize(SHAPE, CASES, ids=IDS)
def test_extend_matches_reference(dtype, page_size, q_heads, kv_heads, dim):
    torch.manual_seed(0)
    # no prefix; one new token over a prefix; a long run over a page-aligned prefix; a run
    # that ends one past a block, over a prefix that ends inside a page
    q_lens = [5, 1, 40, BLOCK + 1]
    prefixes = [0, 33, 32, 7]
    k_pool, v_pool = pools(1024, kv_heads, dim, dtype)
    table = page_table(paged_slots(prefixes, page_size, 1024 // page_size, 3), page_size)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0)[:-1].tolist()], dtype=torch.int32)
    # q, k and v as the model hands them over: slices of one fused tensor
    qkv = torch.randn(sum(q_lens), q_heads + 2 * kv_heads, dim).to(dtype)
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    args = (
        q,
        k,
        v,
        k_pool,
        v_pool,
        table,
        starts,
        torch.tensor(q_lens, dtype=torch.int32),
        torch.tensor(prefixes, dtype=torch.int32),
        max(q_lens),
        dim**-0.5,
        page_size,
    )
    out = extend_attention(*args, block_m=BLOCK, block_n=BLOCK)
    assert out.dtype == dtype and out.shape == q.shape
    close(out, extend_attention_reference(*args), dtype)


def test_extend_writes_only_its_rows():
    """A mixed step hands extend the whole output: rows of other requests stay untouched."""
    torch.manual_seed(2)
    k_pool, v_pool = pools(64, 1, 64, torch.float32)
    q, k, v = torch.randn(6, 2, 64), torch.randn(6, 1, 64), torch.randn(6, 1, 64)
    out = torch.full_like(q, 7.0)
    ints = [torch.tensor(x, dtype=torch.int32) for x in ([1], [4], [0])]
    table = torch.zeros(1, 1, dtype=torch.int32)
    extend_attention(q, k, v, k_pool, v_pool, table, *ints, 4, 0.125, out=out)
    assert (out[0] == 7).all() and (out[5] == 7).all()
    expected = extend_attention_reference(q, k, v, k_pool, v_pool, table, *ints, 4, 0.125)
    close(out[1:5], expected[1:5], torch.float32)


@pytest.mark.parametrize("window", [0, 2])
def test_references_build_everything_on_the_inputs_device(window: int) -> None:
    """The references run where their inputs are (a GPU's, in bench_kernels): on the meta
    device, a tensor made on the host fails as it would on a GPU."""
    meta = torch.device("meta")
    q, k, v = (torch.zeros(6, h, 16, device=meta) for h in (4, 2, 2))
    k_pool, v_pool = torch.zeros(64, 2, 16, device=meta), torch.zeros(64, 2, 16, device=meta)
    table = torch.zeros(2, 8, dtype=torch.int32, device=meta)
    out = extend_attention_reference(q, k, v, k_pool, v_pool, table, torch.tensor([0, 3]),
                                     torch.tensor([3, 3]), torch.tensor([2, 4]), 3, 0.25,
                                     window=window)
    assert out.device == meta
    out = decode_attention_reference(q[:2], k_pool, v_pool, table, torch.tensor([3, 5]), 0.25,
                                     window=window)
    assert out.device == meta


@pytest.mark.parametrize("window", [0, 5])
def test_sinks_match_reference(window: int) -> None:
    """gpt-oss's attention sinks (a logit per query head in each softmax's denominator) in
    both kernels, alone and under a window, against the references; the sinks weigh enough
    that a kernel without them is far off."""
    torch.manual_seed(5)
    q_heads, kv_heads, dim = 4, 2, 64
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    k_pool, v_pool = pools(512, kv_heads, dim, F32)
    lengths = [1, 0, 2 * BLOCK + 1, 40]
    table = page_table(paged_slots(lengths, 1, 512, 4), 1)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), q_heads, dim)
    expected = decode_attention_reference(q, k_pool, v_pool, table, seq_lens, 0.125,
                                          window=window, sinks=sinks)
    plain = decode_attention_reference(q, k_pool, v_pool, table, seq_lens, 0.125, window=window)
    assert (expected - plain).abs().max() > 0.1
    for splits in (1, 3):
        out = decode_attention(q, k_pool, v_pool, table, seq_lens, 0.125, 1, splits,
                               block_n=BLOCK, window=window, sinks=sinks)
        close(out, expected, F32)

    q_lens, prefixes = [5, 1, BLOCK + 3], [0, 20, 9]
    table = page_table(paged_slots(prefixes, 1, 512, 6), 1)
    starts = torch.tensor([0, 5, 6], dtype=torch.int32)
    qkv = torch.randn(sum(q_lens), q_heads + 2 * kv_heads, dim)
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    args = (q, k, v, k_pool, v_pool, table, starts, torch.tensor(q_lens, dtype=torch.int32),
            torch.tensor(prefixes, dtype=torch.int32), max(q_lens), 0.125, 1)
    out = extend_attention(*args, block_m=BLOCK, block_n=BLOCK, window=window, sinks=sinks)
    close(out, extend_attention_reference(*args, window=window, sinks=sinks), F32)
