"""The shape of a Llama-family model, independent of where its weights come from."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("radixmesh.worker")

# Hugging Face model types served; the Qwen3 family norms q and k per head.
_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
_QK_NORM = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama / Qwen2 / Qwen3 style decoder, dense or with sparse
    mixture-of-experts MLPs (Qwen3-MoE, Mixtral) in `sparse_layers`."""

    architecture: str  # "llama", "qwen2", "qwen3", "qwen3_moe" or "mixtral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"
    num_experts: int = 0  # experts per sparse layer (0: a dense model)
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the experts; the rest dense

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return bool(self.sparse_layers)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}")
        heads = cfg["num_attention_heads"]
        # Older config.json files carry rope_theta + rope_scaling, newer ones rope_parameters.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope = {}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # transformers 5 writes rope scaling into `rope_parameters` (with rope_theta) instead of
        # `rope_scaling`; a "default" rope type there means no scaling.
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope or None,
            max_position_embeddings=_context_length(cfg, model_type, name),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type in _QK_NORM,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            **_moe_shape(cfg, model_type),
        )


def _moe_shape(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts config.json (none for dense types).

    Mixtral routes every layer through experts as wide as `intermediate_size` and always
    renormalizes; Qwen3-MoE makes every `decoder_sparse_step`-th layer sparse except
    `mlp_only_layers` (dense MLPs of `intermediate_size` there) with experts of
    `moe_intermediate_size`."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return {}
    layers = cfg["num_hidden_layers"]
    # transformers 5 writes num_local_experts for both; Qwen's own files say num_experts.
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if model_type == "mixtral":
        sparse = tuple(range(layers)) if experts else ()
        width, renormalize = cfg["intermediate_size"], True
    else:
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers)
                       if experts and i not in dense and (i + 1) % step == 0)
        width, renormalize = cfg["moe_intermediate_size"], cfg.get("norm_topk_prob", False)
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": width,
        "norm_topk_prob": renormalize,
        "sparse_layers": sparse,
    }


def _context_length(cfg: dict[str, Any], model_type: str, name: str) -> int:
    """max_position_embeddings, capped to a sliding attention window the model has.

    Attention here is always full: within the window the two agree exactly, beyond it they
    do not. Capping (rather than refusing the model) keeps such models servable with
    contexts up to the window; the engine's context length never exceeds this value."""
    context = cfg.get("max_position_embeddings", 4096)
    window = cfg.get("sliding_window")
    if model_type == "qwen3_moe" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen3-MoE uses its window only when use_sliding_window is set
    if model_type in ("mixtral", "qwen3_moe") and window and window < context:
        log.warning("%s: sliding_window %d < max_position_embeddings %d: context capped to "
                    "%d (sliding-window attention is not implemented)", name, window,
                    context, window)
        return int(window)
    return int(context)
