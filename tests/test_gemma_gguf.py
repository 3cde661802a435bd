"""Gemma 2 and Gemma 3 (text) GGUF files laid out as llama.cpp's converter writes them: an F32
file loads every weight exactly as the safetensors directory does (norms stored plus one,
Gemma's norm names), the same config (windowed layers, RoPE bases and scaling, soft caps,
the attention scale llama.cpp derives) and greedy tokens; a Q8_0 file keeps its matrices
quantized; the metadata of the released models' shapes, with llama.cpp's defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from test_gemma import HIDDEN, PROMPTS, WINDOW, tiny_model, variant
from test_model_families import assert_q8_0_as_dequantized
from test_model_vs_hf import greedy
from tiny_model import hf_greedy, write_tiny_gguf

from radixmesh.core.gguf import read_gguf
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.runner import ModelRunner
from radixmesh.engine.model.weights_gguf import config_from_gguf

pytest.importorskip("transformers")

NEW_TOKENS = 12
FAMILIES = ("gemma2", "gemma3")  # test_gemma's, named as llama.cpp names the architectures
# What a GGUF cannot carry, set to what llama.cpp derives: the attention scale (head_dim 16
# here) and, for Gemma 2, the RoPE base (its converter writes none: 10000). Gemma 3 keeps its
# bases and linear scaling; its layers (windowed, windowed, global) are not llama.cpp's
# default period of 6, so the file gives them as a pattern.
GGUF_EXPRESSIBLE: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 16,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "gemma3": {"query_pre_attn_scalar": 16},
}
CONFIG_FIELDS = (
    "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "rope_dim",
    "intermediate_size", "max_position_embeddings", "rms_norm_eps", "layer_windows",
    "rope_theta", "local_rope_theta", "rope_scaling", "attn_logit_softcap",
    "final_logit_softcap", "query_pre_attn_scalar", "embed_scale", "hidden_act",
    "sandwich_norms", "qk_norm", "tie_word_embeddings",
)


def gguf_model(family: str):
    """test_gemma's tiny model of `family`, its config what a GGUF can express."""
    return variant(tiny_model(family), **GGUF_EXPRESSIBLE[family])


def greedy_ids(config: ModelConfig, weights: dict) -> list[list[int]]:
    """Greedy tokens of each prompt (37, 5, 21 and 1 tokens; windows of 8), each through a
    float32 runner of its own."""
    return [greedy(ModelRunner(config, weights, torch.float32, num_slots=64), ids, NEW_TOKENS)
            for ids in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_loads_exactly_and_generates_the_same(family: str, tmp_path: Path):
    """Every weight exactly as the directory loads it, the same config, and the same greedy
    tokens as the directory and transformers."""
    model = gguf_model(family)
    model.save_pretrained(tmp_path / "hf")
    path = write_tiny_gguf(tmp_path, family, model, gguf.GGMLQuantizationType.F32)
    loaded = load_model(str(path), progress=False)
    reference = load_model(str(tmp_path / "hf"), progress=False)
    ours, theirs = loaded.config, reference.config
    assert {f: getattr(ours, f) for f in CONFIG_FIELDS} == {
        f: getattr(theirs, f) for f in CONFIG_FIELDS}
    if family == "gemma2":
        assert ours.layer_windows == (WINDOW, 0, WINDOW)
        assert (ours.attn_logit_softcap, ours.final_logit_softcap) == (2.0, 3.0)
    else:
        assert ours.layer_windows == (WINDOW, WINDOW, 0)
        assert (ours.rope_theta, ours.local_rope_theta) == (50000.0, 500.0)
        assert ours.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert ours.query_pre_attn_scalar == 16 and ours.tie_word_embeddings
    assert set(loaded.weights) == set(reference.weights)
    for name, w in reference.weights.items():
        assert torch.equal(loaded.weights[name], w), name
    outs = greedy_ids(ours, loaded.weights)
    assert len({t for out in outs for t in out}) > NEW_TOKENS  # the model says something
    assert outs == greedy_ids(theirs, reference.weights)
    assert outs == [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_gguf_keeps_matrices_quantized(family: str, tmp_path: Path):
    """Every matrix stays Q8_0 and dequantizes to exactly what the float path loads from the
    same file; the norms (plus one) are as they are."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    dense = assert_q8_0_as_dequantized(write_tiny_gguf(tmp_path, family, gguf_model(family), q8))
    assert "model.layers.0.pre_feedforward_layernorm.weight" in dense


def write_metadata(path: Path, arch: str, layers: int, hidden: int, heads: int,
                   head_dim: int, **keys: Any) -> ModelConfig:
    """The config a GGUF of this shape with these `{arch}.` keys (and no tensors) loads as."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(heads // 2)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(256)
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return config_from_gguf(read_gguf(path))


def test_released_shapes_and_llama_cpp_defaults(tmp_path: Path):
    """The attention scale by layer count (27B: hidden / heads; else head_dim); Gemma 2's
    window and soft caps when the file has none; Gemma 3's period of 6 and local base of
    10000 when it has none, or a period and a base of its own."""
    gemma2_9b = write_metadata(tmp_path / "a.gguf", "gemma2", 42, 3584, 16, 256)
    assert gemma2_9b.layer_windows == (4096, 0) * 21
    assert (gemma2_9b.attn_logit_softcap, gemma2_9b.final_logit_softcap) == (50.0, 30.0)
    assert gemma2_9b.query_pre_attn_scalar == 256 and gemma2_9b.local_rope_theta == 0.0
    assert gemma2_9b.embed_scale == 3584**0.5 and gemma2_9b.hidden_act == "gelu_tanh"
    gemma2_27b = write_metadata(tmp_path / "b.gguf", "gemma2", 46, 4608, 32, 128,
                                sliding_window=4096, attn_logit_softcapping=50.0,
                                final_logit_softcapping=30.0)
    assert gemma2_27b.query_pre_attn_scalar == 144 and gemma2_27b.architecture == "gemma2"
    gemma3_27b = write_metadata(tmp_path / "c.gguf", "gemma3", 62, 5376, 32, 128,
                                sliding_window=1024, rope_freq_base=1e6)
    assert gemma3_27b.architecture == "gemma3_text" and gemma3_27b.sandwich_norms
    assert gemma3_27b.query_pre_attn_scalar == 168
    assert gemma3_27b.layer_windows == tuple(0 if i % 6 == 5 else 1024 for i in range(62))
    assert (gemma3_27b.rope_theta, gemma3_27b.local_rope_theta) == (1e6, 1e4)
    assert (gemma3_27b.attn_logit_softcap, gemma3_27b.final_logit_softcap) == (0.0, 0.0)
    periodic = write_metadata(tmp_path / "d.gguf", "gemma3", 7, HIDDEN, 4, 16,
                              sliding_window=512, sliding_window_pattern=3,
                              rope_freq_base_swa=2000.0, final_logit_softcapping=30.0)
    assert periodic.layer_windows == (512, 512, 0, 512, 512, 0, 512)
    assert (periodic.local_rope_theta, periodic.final_logit_softcap) == (2000.0, 30.0)
    assert periodic.query_pre_attn_scalar == 16
