"""DeepSeek-V3 (deepseek_v3): multi-head latent attention served from a cache of latents
(one kv_lora_rank + qk_rope_head_dim vector per token and layer, no values apart) with the
key up-projection absorbed into the query, and DeepSeekMoE. Tiny random checkpoints greedy-
identical to transformers in float32 through the Engine (batched, alone, in small chunks,
with pages of 2, from a cached prefix): with and without the low-rank query, interleaved
rotary or not, YaRN with DeepSeek's mscale in the softmax scale; through the mesh's
processes; the pool's size; what it cannot run with yet, refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from process_helpers import mesh_generates
from tiny_model import hf_greedy, random_hf_model, save_with_word_tokenizer, spread_weights

from radixmesh.api import Engine
from radixmesh.core.settings import ReplicaSettings
from radixmesh.engine.model.attention_choice import make_attention
from radixmesh.engine.scheduler_config import SchedulerConfig

transformers = pytest.importorskip("transformers")

VOCAB, NEW_TOKENS, RANK, ROPE, LAYERS = 256, 8, 32, 8, 3
PROMPTS = [[(3 * i + 11 * p + 2) % VOCAB for i in range(n)] for p, n in enumerate((27, 3, 14, 1))]
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
VARIANTS: dict[str, dict[str, Any]] = {
    "lora_q": {},
    "plain_q_yarn": {"q_lora_rank": None, "rope_interleave": False, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 64}},
}


def tiny_config(**fields: Any):
    return transformers.DeepseekV3Config(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "n_shared_experts": 1, "q_lora_rank": 24,
        "kv_lora_rank": RANK, "qk_nope_head_dim": 16, "qk_rope_head_dim": ROPE,
        "v_head_dim": 16, "max_position_embeddings": 256, "bos_token_id": 0,
        "eos_token_id": 1, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, **fields})


@pytest.fixture(scope="module", params=list(VARIANTS))
def saved(request, tmp_path_factory) -> tuple[object, Path]:
    model = random_hf_model(tiny_config(**VARIANTS[request.param]))
    spread_weights(model, router_scale=4.0)
    return model, save_with_word_tokenizer(model, tmp_path_factory.mktemp(request.param) / "m")


@pytest.mark.parametrize(("chunk", "page"), [(16, 1), (5, 2)])
def test_engine_greedy_matches_transformers(saved, chunk, page):
    model, path = saved
    refs = [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS]
    assert len({t for ref in refs for t in ref}) > NEW_TOKENS  # the model says something
    with Engine(str(path), dtype="float32", max_total_tokens=512, chunked_prefill_size=chunk,
                page_size=page, show_progress=False) as engine:
        # One latent and one rotary key per token and layer, no values apart.
        pool = engine.runner.pool
        assert [tuple(k.shape[1:]) for k in pool.k] == [(1, RANK + ROPE)] * LAYERS
        assert all(v.numel() == 0 for v in pool.v)
        outs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs
        alone = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
        assert alone["output_ids"] == refs[2]
        again = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] == (len(PROMPTS[0]) - 1) // page * page
        assert again["output_ids"] == refs[0]


def test_the_mesh_serves_deepseek_v3(saved, tmp_path):
    model, path = saved
    info, outputs = mesh_generates(path, tmp_path / "logs", PROMPTS[:2], GREEDY)
    assert info["architecture"] == "deepseek_v3"
    assert outputs == [hf_greedy(model, ids, NEW_TOKENS) for ids in PROMPTS[:2]]


def test_what_it_cannot_run_with_is_refused():
    with pytest.raises(ValueError, match="torch attention backend"):
        make_attention("triton", 1.0, torch.device("cpu"), latent=RANK)
    for fields, named in (({"enable_hierarchical_cache": True}, "enable_hierarchical_cache"),
                          ({}, "disaggregation_mode prefill")):
        with pytest.raises(ValueError, match=f"caches latents.*{named}"):
            SchedulerConfig.from_settings(
                ReplicaSettings(**fields), 1, 64, 256, [1], architecture="deepseek_v3",
                disaggregation_mode="prefill" if not fields else "null")
