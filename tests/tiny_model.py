"""A tiny random-weight Hugging Face model directory and a fixed run of ForwardBatches."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.proto import worker_pb2 as pb
from radixmesh.proto.convert import sampling_to_proto

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


def forward_script(decode_steps: int = 6) -> list[pb.ForwardBatch]:
    """Two requests: "a" prefilled whole with prompt logprobs, "b" sampled with a seed and
    prefilled in two chunks, then both decode together."""
    a_ids = [(7 * i + 3) % VOCAB for i in range(12)]
    b_ids = [(11 * i + 5) % VOCAB for i in range(9)]
    greedy = sampling_to_proto(SamplingParams(temperature=0), seed=0)
    sampled = sampling_to_proto(SamplingParams(temperature=0.8, top_k=20), seed=1234)
    first = pb.ForwardBatch(step=1)
    first.new_requests.add(
        rid="a",
        prompt_len=len(a_ids),
        sampling=greedy,
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
    )
    first.new_requests.add(rid="b", prompt_len=len(b_ids), sampling=sampled, logprob_start_len=-1)
    first.entries.add(rid="a", input_ids=a_ids, slots=list(range(12)), sample=True)
    first.entries.add(rid="b", input_ids=b_ids[:4], slots=list(range(100, 104)), sample=False)
    second = pb.ForwardBatch(step=2)
    second.entries.add(rid="a", slots=[12], sample=True)
    second.entries.add(rid="b", input_ids=b_ids[4:], slots=list(range(104, 109)), sample=True)
    batches = [first, second]
    for s in range(decode_steps):
        step = pb.ForwardBatch(step=3 + s)
        step.entries.add(rid="a", slots=[13 + s], sample=True)
        step.entries.add(rid="b", slots=[109 + s], sample=True)
        batches.append(step)
    return batches


def tokens(results: list[pb.ForwardResult]) -> list[list[int]]:
    """Each step's sampled token per entry."""
    return [[r.token_id for r in result.results] for result in results]
