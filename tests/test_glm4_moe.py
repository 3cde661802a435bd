"""GLM-4.5 (glm4_moe): DeepSeek-V3's router (sigmoid scores, a correction bias for choosing,
the best groups of experts, scaled weights) with ordinary attention (partial rotary, q/k
biases, q/k norms), dense first layers and an ungated shared expert. The router against
transformers' on random logits; a tiny random checkpoint greedy-identical to transformers in
float32 through the Engine (batched, alone, in small chunks, from a cached prefix) and
through the mesh's processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from process_helpers import mesh_generates
from tiny_model import hf_greedy, random_hf_model, save_with_word_tokenizer, spread_weights

from radixmesh.api import Engine
from radixmesh.engine.model.model_source import load_model
from radixmesh.engine.model.moe import GroupedRouting, grouped_route
from radixmesh.engine.model.parallel import check_divisible

transformers = pytest.importorskip("transformers")

VOCAB, NEW_TOKENS = 256, 8
PROMPTS = [[(3 * i + 11 * p + 2) % VOCAB for i in range(n)] for p, n in enumerate((27, 3, 14, 1))]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


def tiny_config(**fields: object):
    return transformers.Glm4MoeConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
        "n_shared_experts": 1, "routed_scaling_factor": 2.5, "attention_bias": True,
        "use_qk_norm": True, "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0,
                            "partial_rotary_factor": 0.5},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, **fields})


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_route_is_transformers(renormalize: bool) -> None:
    config = tiny_config(norm_topk_prob=renormalize)
    router = transformers.models.glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter(config)
    torch.manual_seed(3)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(64, 64)
    _, weights, experts = router(x)
    ours = grouped_route(torch.nn.functional.linear(x, router.weight),
                         router.e_score_correction_bias, 3, GroupedRouting(4, 2, 2.5),
                         renormalize)
    order, theirs = ours.experts.sort(dim=-1), experts.sort(dim=-1)
    assert torch.equal(order.values, theirs.values)
    assert torch.allclose(ours.weights.gather(1, order.indices),
                          weights.gather(1, theirs.indices), atol=1e-6)
    groups = (ours.experts // 2).unique(dim=None)
    assert groups.numel() > 2  # the tokens between them open every group


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[object, Path]:
    model = random_hf_model(tiny_config())
    spread_weights(model, router_scale=4.0)
    with torch.no_grad():  # a correction that changes choices
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    return model, save_with_word_tokenizer(model, tmp_path_factory.mktemp("glm4-moe") / "m")


@pytest.mark.parametrize("chunk", [16, 5])
def test_engine_greedy_matches_transformers(saved, chunk):
    model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS  # the model says something
    with Engine(str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=chunk,
                show_progress=False) as engine:
        cfg = engine.model_config
        assert (cfg.architecture, cfg.sparse_layers, cfg.moe_groups) == ("glm4_moe", (1, 2), 4)
        assert (cfg.rope_dim, cfg.qk_norm, cfg.attention_bias, cfg.o_proj_bias) == (
            8, True, True, False)
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs
        alone = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
        assert alone["output_ids"] == refs[2]
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] == len(PROMPTS[0]) - 1
        assert again["output_ids"] == refs[0]


def test_the_mesh_serves_glm4_moe(saved, tmp_path):
    model, path = saved
    info, outputs = mesh_generates(path, tmp_path / "logs", PROMPTS[:2], GREEDY)
    assert info["architecture"] == "glm4_moe"
    assert outputs == [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS[:2]]


def test_bf16_and_tensor_parallel(saved):
    _, path = saved
    loaded = load_model(str(path), progress=False)
    with pytest.raises(ValueError, match="shared experts is not split"):
        check_divisible(loaded.config, 2)
    with Engine(str(path), max_total_tokens=256, show_progress=False) as engine:
        out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert len(out["output_ids"]) == NEW_TOKENS
