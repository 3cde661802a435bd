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

    from radixmesh.engine.model.lora import LoraBatch, LoraPool, load_adapter

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
        LoraBatch(pool, slots).add(0, fused, x, expected)
        pool.kernels = True
        LoraBatch(pool, slots).add(0, fused, x, out)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_padded_graph_decodes_take_adapters(tmp_path):
    """The CUDA-graph decode path (its padded buffers, run eagerly here) with adapters read
    from its slot buffer through the kernels: the tokens of the torch path without graphs."""
    from array import array

    from test_lora import _config, save_adapter
    from tiny_model import save_tiny_model

    from radixmesh.core.sampling_params import SamplingParams
    from radixmesh.core.step import NewRequest, StepBatch, StepEntry
    from radixmesh.engine.model.lora import LoraPool, load_adapter
    from radixmesh.engine.model.model_source import load_model
    from radixmesh.engine.model.runner import ModelRunner

    loaded = load_model(str(save_tiny_model(tmp_path / "base")), progress=False,
                        dtype="float32")
    adapters = {name: load_adapter(name, save_adapter(tmp_path / name, {"r": 4, "lora_alpha": 8},
                                                      dict.fromkeys(targets, 4), seed),
                                   _config())
                for seed, (name, targets) in enumerate([("a", ("q_proj", "o_proj", "up_proj")),
                                                        ("b", ("v_proj", "down_proj"))])}
    prompts = {"x": ([5, 9, 2, 7], "a"), "y": ([3, 3, 8], ""), "z": ([1, 4, 6, 6, 2], "b")}
    greedy = SamplingParams(temperature=0)
    first = StepBatch(1, new_requests=[
        NewRequest(rid, row, [], [], len(ids), greedy, 0, lora=lora)
        for row, (rid, (ids, lora)) in enumerate(prompts.items())])
    slot = 0
    for rid, (ids, _) in prompts.items():
        first.entries.append(StepEntry(rid, ids, list(range(slot, slot + len(ids))), True))
        slot += len(ids)
    steps = [first]
    for step in range(2, 7):
        steps.append(StepBatch(step, decode_rows=array("i", [0, 1, 2]),
                               decode_slots=array("i", range(slot, slot + 3))))
        slot += 3

    def tokens(runner: ModelRunner, kernels: bool) -> list[list[int]]:
        pool = LoraPool(adapters, _config(), 2, 0, torch.float32, torch.device("cpu"))
        pool.kernels = kernels
        runner.attach_lora(pool)
        results = [runner.forward(batch) for batch in steps]
        return [[r.token_id for r in results[0].results],
                *(list(r.decode_tokens) for r in results[1:])]

    expected = tokens(ModelRunner(loaded.config, loaded.weights, torch.float32, 256,
                                  attention="torch"), False)
    graphed = ModelRunner(loaded.config, loaded.weights, torch.float32, 256,
                          attention="triton", cuda_graph_max_bs=4, eager_graphs=True)
    assert tokens(graphed, True) == expected
    assert graphed.graph_steps == 5
    # The adapters act: without them, "x" and "z" write other tokens, "y" the same.
    for new in first.new_requests:
        new.lora = ""
    bare = tokens(ModelRunner(loaded.config, loaded.weights, torch.float32, 256,
                              attention="torch"), False)
    columns = list(zip(*bare, strict=True)), list(zip(*expected, strict=True))
    assert [a != b for a, b in zip(*columns, strict=True)] == [True, False, True]
