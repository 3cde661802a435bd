"""The fused MoE kernel against its torch reference and a per-token loop in float64, and
SparseMoE's fused path against its per-expert one, on CPU under the Triton interpreter.

Tolerances: float32 atol = rtol = 1e-5 (IEEE float32 products, summed in another order).
bfloat16 atol = rtol = 3e-2: the kernel rounds to bf16 three times in a row (gate|up, the
activation, each weighted pick) and once more at the end, and the interpreter truncates
float32 -> bf16 where torch (and the GPU) round to nearest: each truncation may sit one bf16
ulp (2**-7 relative) away, always towards zero, so the errors add through the down GEMM
instead of cancelling (the largest seen here: 0.9 of 2e-2)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest
import torch
import torch.nn.functional as F
from test_moe import FF, block_weights, per_token_reference
from test_moe import E as MOE_EXPERTS
from test_moe import H as MOE_HIDDEN

from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.moe import SparseMoE, expert_weight_name
from radixmesh.engine.model.parallel import TensorParallel, shard_weights
from radixmesh.kernels.fused_moe import align_picks, fused_moe, fused_moe_reference
from radixmesh.kernels.native_quant import QuantizedWeight

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# Experts, hidden size, expert width: neither width a multiple of the blocks below.
E, H, INTER = 6, 40, 24
BLOCKS = {"block_m": 16, "block_n": 32, "block_k": 16}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def expert_weights(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random w_gate_up [E, 2I, H] and w_down [E, H, I], scaled ~ fan_in^-0.5."""
    g = torch.Generator().manual_seed(seed)
    w_gate_up = torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5
    w_down = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def per_token(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The definition token by token, pick by pick, in float64."""
    rows = []
    for token, picked, ws in zip(x.double(), experts.tolist(), weights.double(), strict=True):
        out = torch.zeros(H, dtype=torch.float64)
        for e, weight in zip(picked, ws, strict=True):
            gate, up = (w_gate_up[e].double() @ token).chunk(2)
            out += weight * (w_down[e].double() @ (F.silu(gate) * up))
        rows.append(out)
    return torch.stack(rows)


def check(experts: torch.Tensor, dtype: torch.dtype, seed: int, **blocks: int) -> None:
    """fused_moe over random x and routing weights for these picks: its reference's and the
    per-token loop's result."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(experts.shape[0], H, generator=g).to(dtype)
    weights = torch.rand(experts.shape, generator=g)
    weights /= weights.sum(-1, keepdim=True)
    w_gate_up, w_down = expert_weights(dtype, seed)
    out = fused_moe(x, w_gate_up, w_down, experts, weights, **blocks)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, fused_moe_reference(x, w_gate_up, w_down, experts, weights))
    close(out, per_token(x, w_gate_up, w_down, experts, weights))


def distinct_picks(tokens: int, top_k: int, seed: int, num_experts: int = E) -> torch.Tensor:
    """Each token's top_k distinct experts among the first num_experts, at random."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(tokens, num_experts, generator=g).argsort(-1)[:, :top_k]


def test_align_picks_pads_each_expert_to_whole_blocks():
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])  # picks 0..5; expert 1 and 4 unpicked
    aligned = align_picks(experts, 5, 4)
    pad = 6
    assert aligned.rows.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert aligned.rows[12:].eq(pad).all()
    assert aligned.block_experts.tolist()[:3] == [0, 2, 3]
    assert aligned.num_blocks.tolist() == [3]
    assert aligned.rows.dtype == aligned.block_experts.dtype == torch.int32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_ragged_picks_and_an_expert_no_token_picks(dtype, top_k):
    """13 tokens (not a multiple of BLOCK_M), expert 5 picked by none."""
    experts = distinct_picks(13, top_k, seed=1, num_experts=E - 1)
    assert not experts.eq(E - 1).any()
    check(experts, dtype, seed=2, **BLOCKS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2])
def test_every_token_on_the_same_experts(dtype, top_k):
    """37 tokens on expert 3 (and 5): three blocks of one expert, the last one ragged."""
    experts = torch.tensor([3, 5][:top_k]).expand(37, top_k)
    check(experts, dtype, seed=3, **BLOCKS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_of_one_token(dtype):
    check(torch.tensor([[4, 0, 2]]), dtype, seed=4, **BLOCKS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_blocks(dtype):
    check(distinct_picks(50, 2, seed=5), dtype, seed=6)


# ---- SparseMoE ----------------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
def test_sparse_moe_fused_matches_the_per_expert_path(renormalize):
    w = block_weights(0)
    x = torch.randn(23, MOE_HIDDEN, generator=torch.Generator().manual_seed(1))
    residual = torch.randn(23, MOE_HIDDEN, generator=torch.Generator().manual_seed(2))
    fused = SparseMoE(w, "mlp", MOE_EXPERTS, 2, renormalize, fused=True)
    loop = SparseMoE(w, "mlp", MOE_EXPERTS, 2, renormalize, fused=False)
    assert fused.fused and not fused.experts and not loop.fused
    assert fused.w_gate_up.shape == (MOE_EXPERTS, 2 * FF, MOE_HIDDEN)
    assert fused.w_down.shape == (MOE_EXPERTS, MOE_HIDDEN, FF)
    out = fused(x, residual)
    torch.testing.assert_close(out, loop(x, residual), rtol=1e-5, atol=1e-5)
    expected = residual + per_token_reference(w, x, 2, renormalize)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_sparse_moe_fuses_only_on_cuda_and_only_dense_experts():
    w = block_weights(3)
    assert not SparseMoE(w, "mlp", MOE_EXPERTS, 2, True).fused  # the CPU
    w[expert_weight_name("mlp", 2, "gate_proj")] = QuantizedWeight.quantize_q8_0(
        w[expert_weight_name("mlp", 2, "gate_proj")]
    )
    assert not SparseMoE(w, "mlp", MOE_EXPERTS, 2, True).fused
    with pytest.raises(ValueError, match="dense expert weights"):
        SparseMoE(w, "mlp", MOE_EXPERTS, 2, True, fused=True)


def test_tensor_parallel_fused_shards_sum_to_the_block():
    """Each rank stacks its shards of the experts: the ranks' fused partial outputs (before
    their one all-reduce) sum to the whole block's."""

    class Sum(TensorParallel):
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x  # the test sums the ranks' outputs itself

    config = ModelConfig("mixtral", 16, MOE_HIDDEN, FF, 1, 2, 2, MOE_HIDDEN // 2,
                         num_experts=MOE_EXPERTS, num_experts_per_tok=2,
                         moe_intermediate_size=FF, sparse_layers=(0,))
    prefix = "model.layers.0.mlp"
    whole = {f"model.layers.0.{k}": v for k, v in block_weights(11).items()}
    x = torch.randn(10, MOE_HIDDEN, generator=torch.Generator().manual_seed(12))
    zeros = torch.zeros_like(x)
    full = SparseMoE(whole, prefix, MOE_EXPERTS, 2, True, fused=False)(x, zeros)
    parts = []
    for rank in range(2):
        shard = dict(whole)
        shard_weights(config, shard, rank, 2)
        block = SparseMoE(shard, prefix, MOE_EXPERTS, 2, True, Sum(rank, 2), fused=True)
        assert block.w_gate_up.shape == (MOE_EXPERTS, FF, MOE_HIDDEN)  # half of gate, of up
        parts.append(block(x, zeros))
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-5, atol=1e-5)
