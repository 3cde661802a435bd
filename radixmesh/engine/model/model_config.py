"""The shape of a Llama-family model, independent of where its weights come from."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("radixmesh.worker")

# Hugging Face model types served; the Qwen3 family norms q and k per head.
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3")
_QK_NORM = ("qwen3", "qwen3_moe")
# Model types whose transformers attention honours the config's `sliding_window`.
_WINDOWED = ("mistral", "mixtral", "qwen3_moe", "phi3")
# What MistralConfig takes for a config.json without the key (the others take None).
_MISTRAL_DEFAULT_WINDOW = 4096
# Phi-3's original context when config.json leaves it out (Phi3Config's default).
_PHI3_ORIGINAL_CONTEXT = 4096


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama / Mistral / Qwen2 / Qwen3 / Phi-3 style decoder, dense or
    with sparse mixture-of-experts MLPs (Qwen3-MoE, Mixtral) in `sparse_layers`."""

    architecture: str  # "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3"
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
    rotary_dim: int = 0  # leading dims of each head RoPE rotates (0: all of head_dim)

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return bool(self.sparse_layers)

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE rotates: all, or the leading ones of a partial rotary
        (Phi-4-mini rotates 3/4); the rest pass through."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # Older config.json files carry rope_theta + rope_scaling, newer ones rope_parameters
        # (theta, the partial rotary factor and any scaling in one dict).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor", 1.0)
        scaling = _rope_scaling(rope, cfg, model_type)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=_context_length(cfg, model_type, scaling, name),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type in _QK_NORM,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            **_moe_shape(cfg, model_type),
            rotary_dim=int(head_dim * partial),  # rounded down, as transformers does
        )


def _rope_scaling(
    rope: dict[str, Any], cfg: dict[str, Any], model_type: str
) -> dict[str, Any] | None:
    """A config.json's rope scaling (None for plain RoPE), LongRoPE's as longrope_scaling
    gives it. Its old names are read as transformers reads them: "su" always, and "yarn" in
    a Phi-3 config."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return None
    if kind == "su" or (model_type == "phi3" and kind == "yarn"):
        kind = "longrope"
    if kind != "longrope":
        return rope
    context = cfg.get("max_position_embeddings", 4096)
    if model_type == "phi3":  # its top-level value wins, as in transformers
        original = cfg.get("original_max_position_embeddings", _PHI3_ORIGINAL_CONTEXT)
    else:
        original = rope.get("original_max_position_embeddings") or context
    return longrope_scaling(rope["short_factor"], original, context,
                            rope.get("attention_factor"), rope.get("factor"))


def longrope_scaling(
    short_factor: list[float],
    original_context: int,
    context: int,
    attention_factor: float | None = None,
    factor: float | None = None,
) -> dict[str, Any]:
    """LongRoPE's rope scaling as rope.py takes it: the per-frequency divisors of sequences
    within `original_context` (its short factors) and the factor cos and sin are scaled by;
    without one, that comes from the context's growth as transformers derives it (`context`:
    the uncapped max_position_embeddings).

    Its long factors are left out: transformers rotates a sequence that outgrows the original
    context with them, all of it again (Phi-3's generate drops its KV cache at that step), so
    no per-position table reproduces it, and a token's K would change as its sequence grows,
    which a prefix cache cannot hold. The context is capped to the original one instead (see
    capped_context), within which this is exact."""
    if factor is None:
        factor = context / original_context
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0
            else math.sqrt(1 + math.log(factor) / math.log(original_context))
        )
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in short_factor],
        "original_max_position_embeddings": int(original_context),
        "attention_factor": float(attention_factor),
    }


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


def _context_length(
    cfg: dict[str, Any], model_type: str, rope_scaling: dict[str, Any] | None, name: str
) -> int:
    """max_position_embeddings, capped to the sliding attention window transformers applies
    for this config and to LongRoPE's original context (see capped_context)."""
    window = cfg.get("sliding_window")
    if model_type == "mistral" and "sliding_window" not in cfg:
        window = _MISTRAL_DEFAULT_WINDOW
    if model_type not in _WINDOWED:
        window = None
    if model_type == "qwen3_moe" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen3-MoE uses its window only when use_sliding_window is set
    return capped_context(cfg.get("max_position_embeddings", 4096), window, rope_scaling, name)


def capped_context(
    context: int, window: int | None, rope_scaling: dict[str, Any] | None, name: str
) -> int:
    """`context`, capped to a sliding attention `window` smaller than it (None or 0: none)
    and to a LongRoPE scaling's original context (see longrope_scaling).

    Attention here is always full: within the window the two agree exactly, beyond it they
    do not. Capping (rather than refusing the model) keeps such models servable, exactly,
    with contexts up to the cap; the engine's context length never exceeds this value."""
    if window and window < context:
        log.warning("%s: sliding_window %d < max_position_embeddings %d: context capped to "
                    "%d (sliding-window attention is not implemented)", name, window,
                    context, window)
        context = window
    original = (rope_scaling or {}).get("original_max_position_embeddings", context)
    if (rope_scaling or {}).get("rope_type") == "longrope" and original < context:
        log.warning("%s: longrope rope scaling: context capped to its original %d (its long "
                    "factors, for longer sequences, are not implemented)", name, original)
        context = original
    return int(context)
