"""The native decoder layer (kernels/cpu/layer.cpp) against the Python layer it replaces on
decode-only steps: the same kernels in the same order, so the same bits."""

from __future__ import annotations

import pytest
import torch
from tiny_model import save_tiny_model

from radixmesh.services.worker.attention import AttentionMetadata, SeqSpan
from radixmesh.services.worker.kv_pool import KVPool
from radixmesh.services.worker.model import CausalLM
from radixmesh.services.worker.torch_attention import TorchAttention
from radixmesh.services.worker.weights_hf import load_hf_dir


def decode_both_ways(model: CausalLM, lens: list[int], seed: int):
    """One decode step over random cached K/V, with and without the native layers: the
    hidden states and the pools each way."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(lens) + 8
    order = torch.randperm(num_slots, generator=gen)  # scattered slots
    slots, start = [], 0
    for n in lens:
        slots.append(order[start : start + n])
        start += n
    meta = AttentionMetadata(
        torch.stack([s[-1] for s in slots]), tuple(SeqSpan(b, 1, s) for b, s in enumerate(slots))
    )
    ids = torch.randint(0, cfg.vocab_size, (len(lens),), generator=gen)
    positions = torch.tensor([n - 1 for n in lens])
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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_tiny_models_native_layers_equal_python(tmp_path, kind):
    cfg, weights = load_hf_dir(save_tiny_model(tmp_path, kind), progress=False)
    model = CausalLM(cfg, weights, torch.bfloat16)
    assert model.native_layers is not None
    assert_same(decode_both_ways(model, [1, 5, 40, 17], seed=1))


def test_smollm2_native_layers_equal_python(smollm2):
    """Head dim 64: the AVX512-BF16 attention path; batch 32 splits work per request."""
    model = CausalLM(smollm2.config, smollm2.weights, torch.bfloat16)
    assert model.native_layers is not None
    assert_same(decode_both_ways(model, [3 + 7 * i for i in range(32)], seed=2))


def test_not_used_where_a_part_is_not_native(tmp_path):
    cfg, weights = load_hf_dir(save_tiny_model(tmp_path, "qwen3"), progress=False)
    assert CausalLM(cfg, weights, torch.bfloat16).native_layers is None  # q/k norms
    cfg, weights = load_hf_dir(save_tiny_model(tmp_path / "l", "llama"), progress=False)
    assert CausalLM(cfg, weights, torch.float32).native_layers is None


def test_extends_and_disabled_attention_keep_the_python_path():
    meta = AttentionMetadata(torch.tensor([3, 4]), (SeqSpan(0, 2, torch.arange(5)),))
    attn = TorchAttention(0.5)
    attn.prepare(meta)
    assert attn.decode_plan() is None
    decode = AttentionMetadata(torch.tensor([4]), (SeqSpan(0, 1, torch.arange(5)),))
    attn.prepare(decode)
    assert attn.decode_plan() is not None
    off = TorchAttention(0.5, native=False)
    off.prepare(decode)
    assert off.decode_plan() is None
