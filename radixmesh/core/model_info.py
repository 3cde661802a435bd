"""What /get_model_info and /server_info say of the served model, built alike by the
tokenizer's HTTP API and the in-process Engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixmesh.core.tokenizer import Tokenizer

# Hybrid linear-attention families (Hugging Face model types of their text models): some
# layers keep a recurrent state per request instead of KV, which a cached prefix's KV cannot
# rebuild.
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Latent-attention families: the KV pool holds one latent per token and layer.
LATENT_FAMILIES = ("deepseek_v3",)

# The model's shape as users see it: attributes named alike on the worker's ModelConfig, its
# WorkerInfo, the engine's EngineStatus heartbeat and the tokenizer's record of it.
MODEL_SHAPE = ("architecture", "num_experts", "num_experts_per_tok", "hidden_size")


def model_shape(source: object) -> dict[str, Any]:
    """The MODEL_SHAPE attributes of `source`: the model family, for a mixture of experts
    the experts per sparse layer and per token (0 and 0 for a dense model), and the width
    of its final hidden states (an embedding's dimensions)."""
    return {name: getattr(source, name) for name in MODEL_SHAPE}


def model_info(model_path: str, served_model_name: str, shape: dict[str, Any],
               tokenizer: Tokenizer, lora_adapters: Iterable[str] = (),
               is_generation: bool = True) -> dict[str, Any]:
    """The /get_model_info answer: SGLang's keys (what its frontend reads to pick a chat
    template; is_generation false for an embedding model), the model's shape and its LoRA
    adapters, then its chat template and the
    tokens the template reads, so that radixmesh.lang renders role messages exactly as chat
    requests are."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": served_model_name,
        "is_generation": is_generation,
        "preferred_sampling_params": None,
        **shape,
        "lora_adapters": sorted(lora_adapters),
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
    }
