"""Gemma 2 and Gemma 3 (text): tiny random models greedy-identical to transformers in float32
through the Engine (batched, chunked, from a cached prefix, with n-gram drafts), their
sliding windows binding (prompts and outputs longer than the window), Gemma 2's soft caps
and Gemma 3's q/k norms and per-layer RoPE bases; config.json files as the hub ships them."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from process_helpers import mesh_generates
from tiny_model import hf_config, hf_greedy, save_with_word_tokenizer, spread_weights

from radixmesh.api import Engine
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.model_source import load_model

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 64, 96, 3, 4, 2
WINDOW = 8
# Soft caps small enough to bind on a tiny model's scores and logits; a query scalar other
# than head_dim (16); Gemma 3's layers windowed, windowed, global, with bases of their own.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma2": ("gemma2", {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                          "query_pre_attn_scalar": 24, "rope_theta": 5000.0}),
    "gemma3": ("gemma3_text", {
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "query_pre_attn_scalar": 24,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    }),
}
PROMPTS = [[(7 * i + 3 * p + 1) % VOCAB for i in range(n)] for p, n in enumerate((37, 5, 21, 1))]
NEW_TOKENS = 12
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def tiny_model(family: str):
    """A random transformers Gemma (float32, eval) with every weight spread so that each
    layer matters."""
    kind, fields = FAMILIES[family]
    config = hf_config(
        kind, VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, head_dim=16,
        rms_norm_eps=1e-5, sliding_window=WINDOW, max_position_embeddings=256,
        bos_token_id=0, eos_token_id=1, pad_token_id=0, **fields,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    spread_weights(model)
    with torch.no_grad():  # Gemma's norms scale by 1 + weight: spread them around 1 too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.sub_(1.0)
        # The tied embeddings scaled up by sqrt(hidden) would drown out the layers, and every
        # token would predict itself.
        model.model.embed_tokens.weight.mul_(HIDDEN**-0.5)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def saved(request, tmp_path_factory) -> tuple[str, Any, Path]:
    family = request.param
    model = tiny_model(family)
    return family, model, save_with_word_tokenizer(model, tmp_path_factory.mktemp(family))


def test_engine_greedy_matches_transformers(saved):
    """Four prompts at once through 16-token prefill chunks (windows of 8 cut into the
    prompts and the outputs), each token-identical to transformers run alone; the first
    again from the cache; the same tokens with n-gram drafts verified."""
    family, model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS
    with Engine(str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=16,
                show_progress=False) as engine:
        cfg = engine.model_config
        assert cfg.architecture == FAMILIES[family][0]
        assert engine.context_length == 256  # the window no longer caps it
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(outs, list)
        assert [o["output_ids"] for o in outs] == refs
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert isinstance(again, dict)
        assert again["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
        assert again["output_ids"] == refs[0]
    with Engine(str(path), dtype="float32", max_total_tokens=512, show_progress=False,
                speculative_algorithm="NGRAM") as drafting:
        outs = drafting.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(outs, list)
        assert [o["output_ids"] for o in outs] == refs


def variant(model, **changes: Any):
    """`model`'s weights under its config with `changes`."""
    config = copy.deepcopy(model.config)
    for key, value in changes.items():
        setattr(config, key, value)
    other = transformers.AutoModelForCausalLM.from_config(config).eval()
    other.load_state_dict(model.state_dict())
    return other


def test_what_each_part_does(saved):
    """Without the window, the soft caps or Gemma 3's local base transformers' answers
    change: each part matters to the prompts above. The config as loaded."""
    family, model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    unwindowed = variant(model, sliding_window=4096)
    assert [hf_greedy(unwindowed, ids, NEW_TOKENS) for ids in PROMPTS] != refs
    if family == "gemma2":
        uncapped = variant(model, attn_logit_softcapping=None, final_logit_softcapping=None)
        assert [hf_greedy(uncapped, ids, NEW_TOKENS) for ids in PROMPTS] != refs
    else:
        one_base = copy.deepcopy(model.config.rope_parameters)
        one_base["sliding_attention"]["rope_theta"] = 50000.0
        global_base = variant(model, rope_parameters=one_base)
        assert [hf_greedy(global_base, ids, NEW_TOKENS) for ids in PROMPTS] != refs
    loaded = load_model(str(path), progress=False)
    cfg = loaded.config
    windowed = (WINDOW, 0, WINDOW) if family == "gemma2" else (WINDOW, WINDOW, 0)
    assert cfg.layer_windows == windowed
    assert (cfg.hidden_act, cfg.sandwich_norms) == ("gelu_tanh", True)
    assert cfg.query_pre_attn_scalar == 24
    assert cfg.embed_scale == HIDDEN**0.5
    if family == "gemma2":
        assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.qk_norm) == (2.0, 3.0, False)
    else:
        assert (cfg.rope_theta, cfg.local_rope_theta, cfg.qk_norm) == (50000.0, 500.0, True)
        assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # Norm weights are stored plus one, as llama.cpp's files hold them.
    theirs = model.state_dict()["model.layers.0.pre_feedforward_layernorm.weight"]
    assert torch.equal(loaded.weights["model.layers.0.pre_feedforward_layernorm.weight"],
                       theirs + 1)


def hub_gemma3_config(**fields: Any) -> dict[str, Any]:
    """google/gemma-3-1b-it's config.json, as the hub ships it (older keys)."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144, "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "eos_token_id": [1, 106], **fields,
    }


def test_hub_config_files():
    """Gemma 3 1B's config.json: five windowed layers to a global one, 10k and 1M bases, no
    soft caps, tied embeddings; a multimodal Gemma 3 file's text_config with linear scaling
    on the global layers only; Gemma 2's caps and alternating windows by default."""
    one_b = ModelConfig.from_hf_dict(hub_gemma3_config())
    assert one_b.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))
    assert (one_b.rope_theta, one_b.local_rope_theta, one_b.rope_scaling) == (1e6, 1e4, None)
    assert (one_b.attn_logit_softcap, one_b.final_logit_softcap) == (0.0, 0.0)
    assert one_b.tie_word_embeddings and one_b.max_position_embeddings == 32768
    assert one_b.attention_scale == 256**-0.5 and one_b.eos_token_ids == (1, 106)
    text = hub_gemma3_config(rope_scaling={"factor": 8.0, "rope_type": "linear"})
    del text["model_type"], text["eos_token_id"]
    four_b = ModelConfig.from_hf_dict({"model_type": "gemma3", "eos_token_id": [1, 106],
                                       "text_config": text, "vision_config": {}})
    assert four_b.architecture == "gemma3_text" and four_b.eos_token_ids == (1, 106)
    assert four_b.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    gemma2 = ModelConfig.from_hf_dict({
        "model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "vocab_size": 256000, "sliding_window": 4096,
        "max_position_embeddings": 8192,
    })
    assert gemma2.layer_windows == (4096, 0, 4096, 0)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)


def test_bf16_default_path(saved):
    """bf16 (the default dtype) serves the model: the Python layers run (Gemma's norms and
    activation have no native whole-layer kernel) and the answers have their length."""
    _, _, path = saved
    with Engine(str(path), max_total_tokens=256, show_progress=False) as engine:
        assert engine.runner.model.dtype == torch.bfloat16
        assert engine.runner.model.native_layers is None
        out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert isinstance(out, list)
        assert all(len(o["output_ids"]) == NEW_TOKENS for o in out)


def test_the_mesh_serves_gemma(tmp_path):
    """The mesh's processes (worker, scheduler, tokenizer, detokenizer) serve the Gemma 2
    model through /generate: the same tokens as transformers, soft caps and windows
    binding."""
    model = tiny_model("gemma2")
    path = save_with_word_tokenizer(model, tmp_path / "model")
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS[:2]]
    info, outputs = mesh_generates(path, tmp_path / "logs", PROMPTS[:2], GREEDY)
    assert info["architecture"] == "gemma2"
    assert outputs == refs
