"""gpt-oss: a tiny random checkpoint greedy-identical to transformers in float32 through the
Engine: attention sinks, a sliding window on every other layer that the prompts outgrow,
YaRN, biased attention and experts, the clamped SwiGLU; batched, alone, in small prefill
chunks, with pages of 2 and from a cached prefix. Its checkpoint's fused experts load one by
one, dense or MXFP4 (as gpt-oss ships them); the Triton kernels (under the interpreter)
give the same tokens; tensor parallelism is refused by name."""

from __future__ import annotations

import copy
import os

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported: @triton.jit reads it

from pathlib import Path

import pytest
import torch
from process_helpers import mesh_generates
from tiny_model import hf_greedy, random_hf_model, save_with_word_tokenizer, spread_weights

from radixmesh.api import Engine
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.parallel import check_divisible

transformers = pytest.importorskip("transformers")

VOCAB, WINDOW, NEW_TOKENS = 256, 8, 8
LIMIT = 0.5  # the experts' clamp, low enough to bind in a tiny model (gpt-oss: 7)
PROMPTS = [[(5 * i + 7 * p + 3) % VOCAB for i in range(n)] for p, n in enumerate((29, 4, 17, 1))]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def tiny_config(**fields: object):
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                         "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64},
        swiglu_limit=LIMIT, bos_token_id=0, eos_token_id=1, pad_token_id=0, **fields)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[object, Path]:
    model = random_hf_model(tiny_config())
    spread_weights(model, router_scale=4.0)
    with torch.no_grad():  # sinks that matter: some heads give most of their weight away
        for layer in model.model.layers:
            layer.self_attn.sinks.uniform_(-1.0, 3.0)
            layer.mlp.router.weight.mul_(4.0)
    return model, save_with_word_tokenizer(model, tmp_path_factory.mktemp("gpt-oss") / "m")


@pytest.mark.parametrize(("chunk", "page"), [(16, 1), (5, 2)])
def test_engine_greedy_matches_transformers(saved, chunk, page):
    model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS  # the model says something
    with Engine(str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=chunk,
                page_size=page, show_progress=False) as engine:
        assert engine.model_config.architecture == "gpt_oss"
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs
        alone = [engine.generate(input_ids=ids, sampling_params=GREEDY) for ids in PROMPTS[1:]]
        assert [o["output_ids"] for o in alone] == refs[1:]
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        hit = (len(PROMPTS[0]) - 1) // page * page
        assert again["meta_info"]["cached_tokens"] == hit
        assert again["output_ids"] == refs[0]


def test_the_triton_backend_serves_gpt_oss(saved):
    """The Triton kernels' sinks and windows (on the CPU under the interpreter, as on a
    GPU): the same tokens."""
    model, path = saved
    with Engine(str(path), dtype="float32", max_total_tokens=256, attention_backend="triton",
                chunked_prefill_size=16, show_progress=False) as engine:
        outs = engine.generate(input_ids=PROMPTS[:3], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == [hf_greedy(model, ids, NEW_TOKENS)
                                                   for ids in PROMPTS[:3]]


def test_the_mesh_serves_gpt_oss(saved, tmp_path):
    """Through `radixmesh up --model-path`'s processes: the same tokens."""
    model, path = saved
    info, outputs = mesh_generates(path, tmp_path / "logs", PROMPTS[:3], GREEDY)
    assert info["architecture"] == "gpt_oss"
    assert outputs == [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS[:3]]


def test_config_and_weights(saved):
    model, path = saved
    loaded = load_model(str(path), progress=False)
    cfg = loaded.config
    assert cfg.layer_windows == (WINDOW, 0, WINDOW)
    assert (cfg.attention_sinks, cfg.expert_bias, cfg.o_proj_bias) == (True, True, True)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.norm_topk_prob) == (1.702, LIMIT, True)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["truncate"] is False
    experts = model.model.layers[1].mlp.experts
    w = loaded.weights
    for e in range(4):
        name = f"model.layers.1.mlp.experts.{e}"
        assert torch.equal(w[f"{name}.gate_proj.weight"], experts.gate_up_proj[e][:, 0::2].t())
        assert torch.equal(w[f"{name}.up_proj.weight"], experts.gate_up_proj[e][:, 1::2].t())
        assert torch.equal(w[f"{name}.down_proj.weight"], experts.down_proj[e].t())
        assert torch.equal(w[f"{name}.up_proj.bias"], experts.gate_up_proj_bias[e][1::2])
    assert torch.equal(w["model.layers.1.mlp.gate.bias"], model.model.layers[1].mlp.router.bias)
    with pytest.raises(ValueError, match="not split over tensor-parallel ranks"):
        check_divisible(cfg, 2)



def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's dense expert tensor [E, in, out] as gpt-oss's MXFP4 parts: blocks
    [E, out, in / 32, 16] and scales [E, out, in / 32] (each block's power of two puts its
    largest value within FP4's 6, each value rounded to the nearest FP4 one)."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    rows = weight.transpose(1, 2)  # [E, out, in]
    groups = rows.reshape(*rows.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(saved, tmp_path):
    """A checkpoint whose experts are MXFP4, as gpt-oss ships them: dequantized exactly as
    transformers dequantizes them, the same greedy tokens as transformers run on those
    weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from radixmesh.engine.model.weights_hf import mxfp4_dequantize

    model = copy.deepcopy(saved[0])  # its experts are replaced below
    path = save_with_word_tokenizer(model, tmp_path / "dense")
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4(tensors.pop(name))
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(mxfp4_dequantize(blocks, scales), theirs)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        layer, _, param = name.removeprefix("model.layers.").partition(".mlp.experts.")
        with torch.no_grad():  # transformers' model on the weights the file now holds
            getattr(model.model.layers[int(layer)].mlp.experts, param).copy_(theirs)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS[:2]]
    with Engine(str(path), dtype="float32", max_total_tokens=256, show_progress=False) as engine:
        outs = engine.generate(input_ids=PROMPTS[:2], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs
