"""A tiny random-weight Hugging Face model directory, a fixed run of StepBatches, and
transformers configs and random models of any tiny size."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixmesh.core.request import LogprobRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.step import NewRequest, StepBatch, StepEntry, StepResult

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 64, 128, 2, 4, 2, 16
EOS = 255


def save_tiny_model(path: Path, kind: str = "llama", seed: int = 0) -> Path:
    """Write config.json + model.safetensors of a random Llama / Qwen2 / Qwen3 model."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": kind,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": kind == "qwen3",
        "eos_token_id": EOS,
    }
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1 + rand(n, scale=0.1)

    w = {
        "model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=HIDDEN**-0.5),
        "model.norm.weight": norm(HIDDEN),
    }
    if kind != "qwen3":
        w["lm_head.weight"] = rand(VOCAB, HIDDEN, scale=HIDDEN**-0.5)
    sizes = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = norm(HIDDEN)
        w[f"{p}.post_attention_layernorm.weight"] = norm(HIDDEN)
        for name, rows in sizes.items():
            w[f"{p}.self_attn.{name}_proj.weight"] = rand(rows, HIDDEN, scale=HIDDEN**-0.5)
            if kind == "qwen2":
                w[f"{p}.self_attn.{name}_proj.bias"] = rand(rows, scale=0.1)
        w[f"{p}.self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM, scale=HIDDEN**-0.5)
        if kind == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = norm(HEAD_DIM)
            w[f"{p}.self_attn.k_norm.weight"] = norm(HEAD_DIM)
        w[f"{p}.mlp.gate_proj.weight"] = rand(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5)
        w[f"{p}.mlp.up_proj.weight"] = rand(INTERMEDIATE, HIDDEN, scale=HIDDEN**-0.5)
        w[f"{p}.mlp.down_proj.weight"] = rand(HIDDEN, INTERMEDIATE, scale=INTERMEDIATE**-0.5)
    save_file(w, str(path / "model.safetensors"))
    return path


def forward_script(decode_steps: int = 6) -> list[StepBatch]:
    """Two requests: "a" prefilled whole with prompt logprobs, "b" sampled with a seed and
    prefilled in two chunks, then both decode together."""
    a_ids = [(7 * i + 3) % VOCAB for i in range(12)]
    b_ids = [(11 * i + 5) % VOCAB for i in range(9)]
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=0.8, top_k=20)
    first = StepBatch(
        1,
        new_requests=[
            NewRequest("a", [], [], len(a_ids), greedy, 0, LogprobRequest(True, 3, 0)),
            NewRequest("b", [], [], len(b_ids), sampled, 1234),
        ],
        entries=[
            StepEntry("a", a_ids, list(range(12)), True),
            StepEntry("b", b_ids[:4], list(range(100, 104)), False),
        ],
    )
    second = StepBatch(2, entries=[
        StepEntry("a", [], [12], True), StepEntry("b", b_ids[4:], list(range(104, 109)), True)
    ])
    batches = [first, second]
    for s in range(decode_steps):
        batches.append(StepBatch(3 + s, entries=[
            StepEntry("a", [], [13 + s], True), StepEntry("b", [], [109 + s], True)
        ]))
    return batches


def tokens(results: list[StepResult]) -> list[list[int]]:
    """Each step's sampled token per entry."""
    return [[r.token_id for r in result.results] for result in results]


def hf_config(
    kind: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int,
    kv_heads: int, **fields: object,
):
    """A transformers config of `kind` ("llama", "qwen2" or "qwen3") of these sizes, with
    `fields` (rope, norms, tokens, ...) as given."""
    import transformers

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[kind]
    return config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        **fields,
    )


def random_hf_model(config):
    """transformers' causal LM for `config`, its weights drawn after torch.manual_seed(0), in
    eval mode."""
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()
