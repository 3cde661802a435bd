"""Mistral and Phi-3: tiny random models greedy-identical to transformers in float32 through
the Engine (batched, chunked, from a cached prefix), with an explicit head_dim, a sliding
window the prompts outgrow and LongRoPE (with a partial rotary, as Phi-4-mini) capping the
context; Phi-3's fused
projections split at load; tiny GGUF files laid out as llama.cpp writes each family (F32, and
Q8_0 for Phi-3's fused tensors) loading exactly the safetensors weights; the default bf16 path
(the native whole layers where they apply) following float32."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from test_model_vs_hf import greedy
from test_native_layer import BF16_NATIVE, STEPS, assert_same, run_both_ways
from test_quantized import prompt_logits
from tiny_model import (
    hf_config,
    hf_greedy,
    save_with_word_tokenizer,
    spread_weights,
    write_tiny_gguf,
)

from radixmesh.api import Engine
from radixmesh.core.request import RequestError
from radixmesh.engine.model.model import CausalLM
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.rope import RotaryEmbedding
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.kernels.native_quant import QuantizedWeight

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 64, 96, 2, 4, 2
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
            "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 12.0]}
# (model type, config fields, the context the engine serves). Mistral: head_dim 32 where
# hidden / heads is 16, no window; a window of 16 under 256 positions. Phi-3: the 4k models'
# shape (window one short of the context, no rope scaling); the 128k ones' LongRoPE, its
# original context 48 of 512, over 12 of 16 head dims.
FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    "mistral": ("mistral", {"head_dim": 32, "sliding_window": None,
                            "max_position_embeddings": 256}, 256),
    "mistral_window": ("mistral", {"sliding_window": 16, "max_position_embeddings": 256}, 256),
    "phi3": ("phi3", {"max_position_embeddings": 256, "original_max_position_embeddings": 256,
                      "sliding_window": 255}, 256),
    "phi3_longrope": ("phi3", {"max_position_embeddings": 512,
                               "original_max_position_embeddings": 48,
                               "partial_rotary_factor": 0.75, "rope_scaling": LONGROPE}, 48),
    # YaRN as Llama/Qwen long-context files write it, and as gpt-oss does (no rounding of
    # the ramp's ends, its own betas).
    "llama_yarn": ("llama", {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}}, 256),
    "qwen3_yarn": ("qwen3", {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "beta_fast": 16.0,
        "beta_slow": 2.0, "truncate": False, "original_max_position_embeddings": 32}}, 256),
}
# llama.cpp writes Mistral as "llama".
GGUF_ARCH = {"mistral": "llama", "phi3": "phi3", "llama": "llama"}
PROMPTS = [[(7 * i + 3 * p + 1) % VOCAB for i in range(n)] for p, n in enumerate((37, 5, 21, 1))]
NEW_TOKENS = 8  # the longest prompt and its output fit every context above (45 <= 48)
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
F32 = gguf.GGMLQuantizationType.F32


def tiny_model(family: str):
    """A random transformers model of `family` (float32, eval): norms in [0.5, 1.5], matrices
    ~ fan_in^-0.5, so that every layer matters."""
    kind, fields, _ = FAMILIES[family]
    config = hf_config(
        kind, VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, rms_norm_eps=1e-5,
        rope_theta=5000.0, bos_token_id=0, eos_token_id=1, pad_token_id=0, **fields,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    spread_weights(model)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory) -> tuple[str, Any, Path]:
    """(family, the transformers model, its directory with a word-level tokenizer)."""
    family = request.param
    model = tiny_model(family)
    path = save_with_word_tokenizer(model, tmp_path_factory.mktemp(family) / "model")
    return family, model, path


# ---- config ---------------------------------------------------------------------------


def hf_dict(model_type: str, **fields: Any) -> dict[str, Any]:
    return {"model_type": model_type, "vocab_size": 8, "hidden_size": 64,
            "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4, **fields}


def test_mistral_config_fields():
    config = ModelConfig.from_hf_dict(hf_dict("mistral", head_dim=32, sliding_window=None,
                                              max_position_embeddings=32768))
    assert (config.head_dim, config.rope_dim, config.max_position_embeddings) == (32, 32, 32768)
    assert config.layer_windows == ()
    windowed = hf_dict("mistral", sliding_window=4096, max_position_embeddings=32768)
    assert ModelConfig.from_hf_dict(windowed).layer_windows == (4096,)
    # Without the key transformers' MistralConfig takes a 4096 window.
    unset = ModelConfig.from_hf_dict(hf_dict("mistral", max_position_embeddings=32768))
    assert unset.layer_windows == (4096,) and unset.max_position_embeddings == 32768
    assert unset.head_dim == 16


def test_phi3_config_fields():
    """Phi-3-mini-4k's window; Phi-3-mini-128k's "su" LongRoPE (attention factor derived as
    transformers derives it, context capped to the original 4096); Phi-4-mini's partial
    rotary given in rope_parameters, as transformers 5 writes it."""
    mini_4k = ModelConfig.from_hf_dict(hf_dict("phi3", max_position_embeddings=4096,
                                               sliding_window=2047))
    assert (mini_4k.layer_windows, mini_4k.max_position_embeddings) == ((2047,), 4096)
    short = [1.0] * 8  # 16 head dims rotate in 8 pairs
    mini_128k = ModelConfig.from_hf_dict(hf_dict(
        "phi3", max_position_embeddings=131072, original_max_position_embeddings=4096,
        sliding_window=262144,
        rope_scaling={"type": "su", "short_factor": short, "long_factor": [2.0] * 8},
    ))
    assert mini_128k.max_position_embeddings == 4096
    assert mini_128k.rope_scaling == {
        "rope_type": "longrope", "short_factor": short, "original_max_position_embeddings": 4096,
        "attention_factor": math.sqrt(1 + math.log(32) / math.log(4096)),
    }
    phi4_mini = ModelConfig.from_hf_dict(hf_dict(
        "phi3", max_position_embeddings=4096, rope_parameters={
            "rope_type": "default", "rope_theta": 250000.0, "partial_rotary_factor": 0.75},
    ))
    assert (phi4_mini.rope_dim, phi4_mini.rope_theta) == (12, 250000.0)
    assert phi4_mini.rope_scaling is None


def test_longrope_tables_never_pass_the_original_context():
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8,
               "original_max_position_embeddings": 64, "attention_factor": 1.2}
    RotaryEmbedding(16, 64, 10000.0, torch.float32, scaling)
    with pytest.raises(ValueError, match="longrope past the original context"):
        RotaryEmbedding(16, 65, 10000.0, torch.float32, scaling)
    with pytest.raises(ValueError, match="short_factor has 8 values"):
        RotaryEmbedding(16, 64, 10000.0, torch.float32, scaling, rotary_dim=12)


@pytest.mark.parametrize("rope", [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
     "beta_slow": 1.0, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1},
    {"factor": None, "original_max_position_embeddings": 1024, "attention_factor": 1.25},
])
def test_yarn_tables_are_transformers(rope):
    """YaRN's frequencies and the factor cos/sin are scaled by, as transformers computes them
    (DeepSeek's mscale pair, a factor derived from the context, a given attention factor)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4,
                                      max_position_embeddings=8192, rope_parameters=fields)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = ModelConfig.from_hf_dict(hf_dict("llama", hidden_size=256, rope_parameters=fields,
                                            max_position_embeddings=8192))
    table = RotaryEmbedding(ours.head_dim, 64, ours.rope_theta, torch.float32, ours.rope_scaling)
    angles = torch.outer(torch.arange(64, dtype=torch.float32), inv_freq)
    assert torch.allclose(table.cos[:, :32], angles.cos() * factor, atol=1e-6)
    assert torch.allclose(table.sin[:, 32:], angles.sin() * factor, atol=1e-6)
    assert ours.max_position_embeddings == 8192


# ---- the Engine against transformers ----------------------------------------------------


def test_engine_greedy_matches_transformers(saved):
    """Four prompts at once (37, 5, 21 and 1 tokens) through 16-token prefill chunks, each
    token-identical to transformers run alone; the first again, from the cache; the context
    the engine serves, and a request past it refused."""
    family, model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS  # the model says something
    with Engine(str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=16,
                show_progress=False) as engine:
        assert engine.model_config.architecture == FAMILIES[family][0]
        assert engine.context_length == FAMILIES[family][2]
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(outs, list)
        assert [o["output_ids"] for o in outs] == refs
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert isinstance(again, dict)
        assert again["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
        assert again["output_ids"] == refs[0]
        too_long = [3] * (engine.context_length - NEW_TOKENS + 1)
        with pytest.raises(RequestError, match="context length"):
            engine.generate(input_ids=too_long, sampling_params=GREEDY)


def test_phi3_fused_projections_split_at_load(tmp_path):
    model = tiny_model("phi3")
    model.save_pretrained(tmp_path)
    weights = load_model(str(tmp_path), progress=False).weights
    assert not any(".qkv_proj." in n or ".gate_up_proj." in n for n in weights)
    theirs = model.state_dict()
    q, kv = HEADS * 16, KV_HEADS * 16
    for i in range(LAYERS):
        qkv = theirs[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        gate_up = theirs[f"model.layers.{i}.mlp.gate_up_proj.weight"]
        ours = [weights[f"model.layers.{i}.{n}.weight"] for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
            "mlp.up_proj")]
        expected = [*qkv.split([q, kv, kv]), *gate_up.chunk(2)]
        assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))


# ---- GGUF ---------------------------------------------------------------------------------


def greedy_ids(config: ModelConfig, weights: dict) -> list[int]:
    """Greedy tokens of the first prompt through a float32 runner."""
    return greedy(ModelRunner(config, weights, torch.float32, num_slots=128), PROMPTS[0],
                  NEW_TOKENS)


# llama.cpp's converter writes no window for Mistral: mistral_window's file is mistral's.
@pytest.mark.parametrize("family", ["mistral", "phi3", "phi3_longrope", "llama_yarn"])
def test_f32_gguf_loads_exactly_and_generates_the_same(family, tmp_path):
    """Every weight exactly (Phi-3's fused attn_qkv and ffn_up split), the same shape,
    context (Phi-3's window and LongRoPE's cap) and rope tables (LongRoPE's short factors
    read from their tensor), the same greedy tokens."""
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf")
    gguf_path = write_tiny_gguf(tmp_path, GGUF_ARCH[FAMILIES[family][0]], model, F32)
    loaded = load_model(str(gguf_path), progress=False)
    reference = load_model(str(tmp_path / "hf"), progress=False)
    fields = ("num_heads", "num_kv_heads", "head_dim", "rope_dim", "intermediate_size",
              "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rms_norm_eps",
              "layer_windows")
    ours, theirs = loaded.config, reference.config
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]
    tables = [RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, torch.float32,
                              c.rope_scaling, rotary_dim=c.rope_dim) for c in (ours, theirs)]
    assert torch.equal(tables[0].cos, tables[1].cos) and torch.equal(tables[0].sin, tables[1].sin)
    assert set(loaded.weights) == set(reference.weights)
    for name, w in reference.weights.items():
        assert torch.equal(loaded.weights[name], w), name
    assert greedy_ids(ours, loaded.weights) == greedy_ids(theirs, reference.weights)


def test_q8_0_gguf_splits_phi3_fused_tensors_quantized(tmp_path):
    """attn_qkv and ffn_up stay Q8_0, cut into q/k/v and gate/up by whole rows of blocks:
    each part dequantizes to exactly what the float path loads from the same file."""
    model = tiny_model("phi3")
    gguf_path = write_tiny_gguf(tmp_path, "phi3", model, gguf.GGMLQuantizationType.Q8_0)
    assert_q8_0_as_dequantized(gguf_path)


def assert_q8_0_as_dequantized(gguf_path: Path) -> dict:
    """Every matrix of a Q8_0 file stays Q8_0 and dequantizes to exactly what the float path
    loads from it; every other tensor is the same. The float path's weights."""
    quantized = load_model(str(gguf_path), progress=False, quantization="gguf").weights
    dense = load_model(str(gguf_path), progress=False, quantization="bf16").weights
    assert set(quantized) == set(dense)
    for name, w in dense.items():
        got = quantized[name]
        if w.dim() == 2:
            assert isinstance(got, QuantizedWeight) and got.qtype.name == "Q8_0", name
            assert torch.equal(got.dequantize(), w), name
        else:
            assert torch.equal(got, w), name
    return dense


# ---- bf16, the default ------------------------------------------------------------------


def test_bf16_default_path(saved):
    """bf16 (the default dtype) follows float32 within bf16's precision. The native whole
    layers run Mistral's head_dim 32 (q wider than the hidden size) and Phi-3, bit for bit as
    the Python layers do; a partial rotary falls back to the Python layers. The Engine serves
    the directory with no dtype given."""
    family, _, path = saved
    loaded = load_model(str(path), progress=False)
    bf16 = CausalLM(loaded.config, loaded.weights, torch.bfloat16)
    partial = loaded.config.rope_dim < loaded.config.head_dim
    assert (bf16.native_layers is not None) == (BF16_NATIVE and not partial)
    ids = torch.tensor(PROMPTS[2])
    ref = prompt_logits(CausalLM(loaded.config, loaded.weights, torch.float32), ids)
    got = prompt_logits(bf16, ids)
    assert (got - ref).abs().max() / ref.abs().max() < 0.05
    if bf16.native_layers is not None:
        for parts in STEPS:
            assert_same(run_both_ways(bf16, parts, seed=len(parts)))
    with Engine(str(path), max_total_tokens=256, show_progress=False) as engine:
        assert engine.runner.model.dtype == torch.bfloat16
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(out, list)
        assert all(len(o["output_ids"]) == NEW_TOKENS for o in out)
