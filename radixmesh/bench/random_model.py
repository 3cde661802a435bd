"""A Llama-shaped model with random weights and a word-level tokenizer ("t0 t1 ..."), written
as a Hugging Face directory the engine loads: what the host-path and GPU benchmarks serve;
and random LoRA adapters in PEFT's format for any model (`python -m
radixmesh.bench.random_model lora PATH`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch


class LlamaShape(NamedTuple):
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def kv_bytes_per_token(self, element_size: int = 2) -> int:
        """K and V of one token over every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size


def write_random_llama(path: Path, shape: LlamaShape, dtype: torch.dtype = torch.float32,
                       device: str = "cpu") -> int:
    """Write config.json, model.safetensors (weights N(0, 1/fan_in), drawn on `device`, norms
    1, embeddings tied) and tokenizer.json at `path`; returns the weights' bytes."""
    import tokenizers
    from safetensors.torch import save_file
    from tokenizers import decoders, models, pre_tokenizers

    s = shape
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": s.vocab,
        "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": True, "eos_token_id": s.vocab - 1,
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        w = torch.randn(*dims, generator=g, device=device, dtype=dtype)
        return (w * dims[-1] ** -0.5).cpu()

    def ones() -> torch.Tensor:
        return torch.ones(s.hidden, dtype=dtype)

    weights = {"model.embed_tokens.weight": rand(s.vocab, s.hidden), "model.norm.weight": ones()}
    for i in range(s.layers):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.input_layernorm.weight": ones(),
            f"{p}.post_attention_layernorm.weight": ones(),
            f"{p}.self_attn.q_proj.weight": rand(s.heads * s.head_dim, s.hidden),
            f"{p}.self_attn.k_proj.weight": rand(s.kv_heads * s.head_dim, s.hidden),
            f"{p}.self_attn.v_proj.weight": rand(s.kv_heads * s.head_dim, s.hidden),
            f"{p}.self_attn.o_proj.weight": rand(s.hidden, s.heads * s.head_dim),
            f"{p}.mlp.gate_proj.weight": rand(s.intermediate, s.hidden),
            f"{p}.mlp.up_proj.weight": rand(s.intermediate, s.hidden),
            f"{p}.mlp.down_proj.weight": rand(s.hidden, s.intermediate),
        }
    save_file(weights, str(path / "model.safetensors"))
    # Byte-level, as the families served (Llama 3, Qwen, SmolLM2): each id a word, " t<id>".
    tokenizer = tokenizers.Tokenizer(
        models.WordLevel({f"\u0120t{i}": i for i in range(s.vocab)}, unk_token="\u0120t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path / "tokenizer.json"))
    return sum(w.numel() * w.element_size() for w in weights.values())


def write_random_lora(path: Path, model_path: str | None = None, rank: int = 8,
                      targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0,
                      scale: float = 0.04) -> Path:
    """A PEFT LoRA adapter with random A and B (N(0, scale^2)) for the model at `model_path`
    (None: the bundled one), rank `rank` on each of `targets` in every layer: for trying the
    LoRA routes and benchmarking them without a trained adapter."""
    from safetensors.torch import save_file

    from radixmesh.core.model_files import is_gguf, resolve_model_path
    from radixmesh.engine.model.lora import module_name, target_shapes
    from radixmesh.engine.model.model_config import ModelConfig

    source = resolve_model_path(model_path)
    if is_gguf(source):
        from radixmesh.core.gguf import read_gguf
        from radixmesh.engine.model.weights_gguf import config_from_gguf

        config = config_from_gguf(read_gguf(source, tensors=False))
    else:
        config = ModelConfig.from_hf_dict(json.loads((source / "config.json").read_text()))
    shapes = target_shapes(config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in targets:
            fan_in, fan_out = shapes[target]
            key = f"base_model.model.{module_name(layer, target)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none"}))
    return path


def main() -> None:
    """python -m radixmesh.bench.random_model lora PATH [--model M] [--rank R] [--seed S]"""
    import argparse

    parser = argparse.ArgumentParser(description="write a random LoRA adapter (PEFT format)")
    parser.add_argument("what", choices=["lora"])
    parser.add_argument("path", type=Path)
    parser.add_argument("--model", default=None, help="its base model (default: the bundled one)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    written = write_random_lora(args.path, args.model, args.rank,
                                tuple(args.targets.split(",")), args.seed)
    print(written)


if __name__ == "__main__":
    main()
