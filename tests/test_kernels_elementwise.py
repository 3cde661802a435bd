"""KV store, RMSNorm, rotary, SiLU-and-mul and the token bitmask against their torch
references, on CPU under the Triton interpreter.

Tolerances: float32 atol = rtol = 1e-5. bfloat16 atol = rtol = 1e-2: both sides compute in
float32 and round once, but the interpreter truncates float32 -> bf16 where torch (and the
GPU) round to nearest, so a result may sit one bf16 ulp (2**-7 relative) away. Copies and
masks are exact."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest
import torch
import torch.nn.functional as F

from radixmesh.engine.model.rope import RotaryEmbedding, apply_rotary
from radixmesh.kernels.activation import silu_and_mul, silu_and_mul_reference
from radixmesh.kernels.kv_store import store_kv, store_kv_reference
from radixmesh.kernels.paging import page_table, table_slots
from radixmesh.kernels.rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from radixmesh.kernels.rotary import rotary_embedding, rotary_embedding_reference
from radixmesh.kernels.token_bitmask import apply_token_bitmask_, apply_token_bitmask_reference_

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_scatters_rows_and_skips_padding(dtype):
    torch.manual_seed(0)
    qkv = torch.randn(5, 4 + 2 + 2, 64).to(dtype)  # k and v as slices of a fused tensor
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.tensor([3, -1, 7, 0, 9], dtype=torch.int32)
    pools = [torch.zeros(12, 2, 64, dtype=dtype) for _ in range(4)]
    store_kv(k, v, pools[0], pools[1], slots, block=32)
    store_kv_reference(k, v, pools[2], pools[3], slots)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert torch.equal(pools[0][7], k[2]) and pools[0][[1, 2, 4, 5, 6, 8, 10, 11]].eq(0).all()


def test_page_table_holds_pages_and_rejects_broken_ones():
    slots = [torch.tensor([32, 33, 34, 35, 8, 9]), torch.tensor([4, 5])]
    table = page_table(slots, page_size=4)
    assert table.tolist() == [[8, 2], [1, 0]] and table.dtype == torch.int32
    assert torch.equal(table_slots(table[0], 6, 4), slots[0])
    assert page_table(slots, 1, width=8).shape == (2, 8)
    with pytest.raises(ValueError, match="whole pages"):
        page_table([torch.tensor([32, 34])], page_size=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(2, 7, 96).to(dtype).unbind(0)
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    close(rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected, expected_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    close(out, expected)
    close(new_residual, expected_residual)
    if dtype == torch.float32:
        # the model's own norm agrees with the reference
        close(rms_norm_reference(x, weight, 1e-6), F.rms_norm(x, (96,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_rotary(dtype, neox):
    torch.manual_seed(0)
    x = torch.randn(4, 8, 64).to(dtype)[:, 1:6]  # a strided view, as q/k heads are
    positions = torch.tensor([3, 49, 0, 7])
    angles = torch.randn(50, 32)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    close(
        rotary_embedding(x, positions, cos, sin, neox),
        rotary_embedding_reference(x, positions, cos, sin, neox),
    )
    partial = (cos[:, :8], sin[:, :8])  # the first 16 of 64 dims rotate
    out = rotary_embedding(x, positions, *partial, neox)
    close(out, rotary_embedding_reference(x, positions, *partial, neox))
    assert torch.equal(out[..., 16:], x[..., 16:])


def test_rotary_neox_matches_the_model():
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 128, 10000.0, torch.float32)
    x = torch.randn(5, 3, 64)
    positions = torch.tensor([0, 1, 17, 99, 127])
    out = rotary_embedding(x, positions, rope.cos[:, :32], rope.sin[:, :32], neox=True)
    close(out, apply_rotary(x, *rope.tables(positions)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 2 * 100).to(dtype)
    close(silu_and_mul(x, block=32), silu_and_mul_reference(x))
    gate, up = x.float().chunk(2, dim=-1)
    close(silu_and_mul_reference(x), (F.silu(gate) * up).to(dtype))


@pytest.mark.parametrize("vocab", [64, 70, 100])
def test_token_bitmask(vocab):
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    # 3 words cover 96 tokens: vocab 100 leaves tokens 96..99 uncovered, hence masked
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32)
    bitmask[0, 0] = -1  # bit 31 set: a negative word
    got, expected = logits.clone(), logits.clone()
    apply_token_bitmask_(got, bitmask, block=16)
    apply_token_bitmask_reference_(expected, bitmask)
    assert torch.equal(got, expected)
    assert torch.equal(got[0, :32], logits[0, :32])
    word, bit = 1, 5
    allowed = bool((bitmask[2, word] >> bit) & 1)
    assert (got[2, 32 * word + bit] == logits[2, 32 * word + bit]) == allowed
    if vocab > 96:
        assert torch.isinf(got[:, 96:]).all()
