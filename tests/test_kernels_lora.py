"""The segmented LoRA kernels against their torch reference, on CPU under the Triton
interpreter: adapters of several ranks' worth mixed with tokens that have none, the output
a column slice of a wider projection's.

Tolerances: float32 atol = rtol = 1e-5 (IEEE float32 products, summed in another order);
bfloat16 atol = rtol = 6e-2: h and the sum round to bf16 as torch's do, but the interpreter
truncates float32 -> bf16 where torch rounds to nearest, so h may sit one ulp (2**-8
relative) off; expand's sum over the rank cancels in places and carries that error into a
smaller result (the largest seen here: 3.1e-2 on 0.55)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

import pytest
import torch

from radixmesh.kernels.lora import align_tokens, lora_add, lora_add_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "n", "rank"), [(37, 40, 24, 8), (5, 64, 96, 16),
                                                        (1, 24, 40, 4)])
def test_lora_add_matches_its_reference(dtype, tokens, k, n, rank):
    g = torch.Generator().manual_seed(tokens + k)
    slots_count = 3
    x = torch.randn(tokens, k, generator=g).to(dtype)
    a = (torch.randn(slots_count, rank, k, generator=g) * 0.3).to(dtype)
    b = (torch.randn(slots_count, n, rank, generator=g) * 0.3).to(dtype)
    slots = torch.randint(-1, slots_count, (tokens,), generator=g)
    wide = torch.randn(tokens, n + 10, generator=g).to(dtype)
    expected = wide.clone()
    lora_add_reference(x, a, b, slots, expected[:, 4 : 4 + n])
    lora_add(x, a, b, slots, wide[:, 4 : 4 + n], block_m=16, block_n=32, block_k=16)
    tol = TOL[dtype]
    torch.testing.assert_close(wide.float(), expected.float(), atol=tol, rtol=tol)
    untouched = slots < 0  # tokens without an adapter, and the columns around the slice
    assert torch.equal(wide[untouched], expected[untouched])
    assert torch.equal(wide[:, :4], expected[:, :4]) and torch.equal(wide[:, 4 + n :],
                                                                      expected[:, 4 + n :])


def test_tokens_are_grouped_by_adapter_in_whole_blocks():
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0])
    aligned = align_tokens(slots, 3, block_m=2)
    rows = aligned.rows.tolist()
    valid = int(aligned.num_blocks)
    for block, slot in enumerate(aligned.block_experts.tolist()[:valid]):
        members = [t for t in rows[2 * block : 2 * block + 2] if t < len(slots)]
        assert all((slots[t].item() if slots[t] >= 0 else 3) == slot for t in members)
    assert sorted(t for t in rows if t < len(slots)) == list(range(len(slots)))


def test_a_steps_adapters_run_alike_through_the_kernels_and_torch(tmp_path):
    """The LoRA pool's GPU path (the kernels, here interpreted) against its CPU one."""
    from test_lora import _config, save_adapter

    from radixmesh.engine.model.lora import LoraPool, load_adapter

    adapters = {
        name: load_adapter(name, save_adapter(tmp_path / name, {"r": rank, "lora_alpha": 8},
                                              dict.fromkeys(targets, rank), seed), _config())
        for seed, (name, rank, targets) in enumerate([
            ("a", 4, ("q_proj", "v_proj", "down_proj")), ("b", 8, ("k_proj", "gate_proj"))])
    }
    pool = LoraPool(adapters, _config(), 3, 0, torch.float32, torch.device("cpu"))
    slots = torch.tensor([pool.acquire("b"), -1, pool.acquire("a"), pool.acquire("b"), -1])
    g = torch.Generator().manual_seed(0)
    for fused, width, fan_in in [("qkv", 128, 64), ("gate_up", 256, 64), ("down", 64, 128)]:
        x = torch.randn(5, fan_in, generator=g)
        out = torch.randn(5, width, generator=g)
        expected = out.clone()
        pool.kernels = False
        pool.batch(slots).add(0, fused, x, expected)
        pool.kernels = True
        pool.batch(slots).add(0, fused, x, out)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
