"""The native decoder layer (kernels/cpu/layer.cpp) against the Python layer it replaces:
the same kernels in the same order, so the same bits, for decode, prompt and mixed steps."""

from __future__ import annotations

import pytest
import torch
from tiny_model import save_tiny_model

from radixmesh.engine.model.attention import AttentionMetadata, SeqSpan
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.torch_attention import TorchAttention
from radixmesh.engine.model.weights_hf import load_hf_dir
from radixmesh.kernels import native


def step_meta(parts: list[tuple[int, int]], seed: int):
    """A step of requests (cached tokens, new tokens) in order, over scattered slots: its
    metadata, positions and the pool size."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(c + n for c, n in parts) + 8
    order = torch.randperm(num_slots, generator=gen)
    spans, out, positions, start, row = [], [], [], 0, 0
    for cached, new in parts:
        slots = order[start : start + cached + new]
        start += cached + new
        spans.append(SeqSpan(row, new, slots))
        out.append(slots[cached:])
        positions += range(cached, cached + new)
        row += new
    meta = AttentionMetadata.from_spans(torch.cat(out), tuple(spans))
    return meta, torch.tensor(positions), num_slots


def run_both_ways(model: CausalLM, parts: list[tuple[int, int]], seed: int):
    """One step over random cached K/V, with and without the native layers: the hidden
    states and the pools each way."""
    cfg = model.cfg
    meta, positions, num_slots = step_meta(parts, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (positions.numel(),), generator=gen)
    cache = [torch.randn(num_slots, cfg.num_kv_heads, cfg.head_dim, generator=gen).bfloat16()
             for _ in range(2 * cfg.num_layers)]
    results = []
    stack = model.native_layers
    for use in (stack, None):
        pool = KVPool(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        for i in range(cfg.num_layers):
            pool.k[i].copy_(cache[2 * i])
            pool.v[i].copy_(cache[2 * i + 1])
        model.native_layers = use
        attn = TorchAttention(cfg.head_dim**-0.5)
        attn.prepare(meta)
        assert attn.native_plan() is not None
        with torch.inference_mode():
            hidden = model.forward(ids, positions, attn, pool)
        results.append((hidden, pool))
    model.native_layers = stack
    return results


def assert_same(results) -> None:
    (fused, fused_pool), (python, python_pool) = results
    assert torch.equal(fused, python)
    for a, b in zip(fused_pool.k + fused_pool.v, python_pool.k + python_pool.v, strict=True):
        assert torch.equal(a, b)


# decodes only; a prompt alone; decodes then prompts (with and without a cached prefix)
STEPS = [[(0, 1), (4, 1), (39, 1), (16, 1)], [(0, 23)], [(4, 1), (39, 1), (0, 9), (12, 6)]]
# The native layers need AVX512-BF16; without it the model runs its Python layers.
BF16_NATIVE = bool(native.library().gemm_bf16_supported(64))


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])  # q/k/v biases; q/k norms
@pytest.mark.parametrize("parts", STEPS)
def test_tiny_models_native_layers_equal_python(tmp_path, kind, parts):
    cfg, weights = load_hf_dir(save_tiny_model(tmp_path, kind), progress=False)
    model = CausalLM(cfg, weights, torch.bfloat16)
    if not BF16_NATIVE:
        assert model.native_layers is None  # no AVX512-BF16: the Python layers run
        return
    assert model.native_layers is not None
    assert_same(run_both_ways(model, parts, seed=len(parts)))


@pytest.mark.parametrize(
    "parts",
    [
        [(2 + 7 * i, 1) for i in range(32)],  # batch 32: work split per request
        [(60, 1), (5, 1), (0, 130), (50, 100)],
    ],
)
def test_smollm2_native_layers_equal_python(smollm2, parts):
    """Head dim 64: the AVX512-BF16 attention path."""
    model = CausalLM(smollm2.config, smollm2.weights, torch.bfloat16)
    if not BF16_NATIVE:
        assert model.native_layers is None  # no AVX512-BF16: the Python layers run
        return
    assert model.native_layers is not None
    assert_same(run_both_ways(model, parts, seed=2))


def test_not_used_where_a_part_is_not_native(tmp_path):
    cfg, weights = load_hf_dir(save_tiny_model(tmp_path / "l", "llama"), progress=False)
    assert CausalLM(cfg, weights, torch.float32).native_layers is None


def test_plan_only_where_the_backend_can_give_one():
    """Decodes interleaved with prompt tokens are not one run; native=False opts out."""
    meta, _, _ = step_meta([(3, 1), (0, 4), (5, 1)], seed=0)
    attn = TorchAttention(0.5)
    attn.prepare(meta)
    assert attn.native_plan() is None
    meta, _, _ = step_meta([(3, 1), (5, 1), (0, 4)], seed=0)
    attn.prepare(meta)
    plan = attn.native_plan()
    assert plan is not None
    assert [(r.first, r.count, r.width) for r in plan.runs] == [(0, 2, 6), (2, 4, 0)]
    assert plan.runs[1].lens.tolist() == [1, 2, 3, 4]
    off = TorchAttention(0.5, native=False)
    off.prepare(meta)
    assert off.native_plan() is None
