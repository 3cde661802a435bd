"""The shape of a served model (the Llama family, Gemma 2 and 3, the hybrid linear-attention
Qwen3-Next and Qwen3.5, gpt-oss, GLM-4.5 and DeepSeek-V3's latent attention), independent
of where its weights come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixmesh.core.model_info import HYBRID_FAMILIES
from radixmesh.engine.model.rope_scaling import capped_context, rope_scaling, yarn_mscale

# Hugging Face model types served; the Qwen3 family norms q and k per head.
_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "gemma2",
                "gemma3_text", "gpt_oss", "glm4_moe", "deepseek_v3", *HYBRID_FAMILIES)
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3_text", *HYBRID_FAMILIES)
# Multimodal files whose text model is served (under `text_config`), by the type it takes.
_TEXT_MODELS = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text",
                "qwen3_5_moe": "qwen3_5_moe_text"}
# Families that route as DeepSeek-V3 does (moe.grouped_route).
_GROUPED_ROUTER = ("glm4_moe", "deepseek_v3")
# Families whose attention_bias leaves o_proj without one.
_NO_O_BIAS = ("qwen2", "glm4_moe")
# Families whose every layer's MLP is the experts (no decoder_sparse_step, always renormalized).
_ALL_SPARSE = ("qwen3_5_moe_text",)
# What the hybrid configs take for a file that leaves them out (transformers' defaults): the
# share of each head RoPE rotates, and every how many layers one is full attention.
_HYBRID_PARTIAL_ROTARY = 0.25
_HYBRID_FULL_ATTENTION_INTERVAL = 4
GEMMA = ("gemma2", "gemma3_text")
# Gemma's layers windowed by default: every second from the first (Gemma 2), five of every
# six (Gemma 3), as transformers and llama.cpp lay them out when the file says nothing.
GEMMA_WINDOW_PERIOD = {"gemma2": 2, "gemma3_text": 6}
# Gemma 2's soft caps (scores, final logits) where the file gives none: both loaders'.
GEMMA2_SOFTCAPS = (50.0, 30.0)
# Gemma 3's RoPE bases when the file gives none: global layers, windowed ones.
GEMMA3_THETA = (1_000_000.0, 10_000.0)
# Model types whose transformers attention honours the config's `sliding_window`.
_WINDOWED = ("mistral", "mixtral", "qwen3_moe", "phi3")
# What MistralConfig takes for a config.json without the key (the others take None).
_MISTRAL_DEFAULT_WINDOW = 4096
@dataclass(frozen=True)
class LinearAttentionShape:
    """A Gated DeltaNet layer's shape (linear_attention.py): q/k heads and v heads (each
    q/k head serves num_v_heads / num_k_heads of the v heads) and their widths, and the
    causal depthwise convolution's kernel over the q|k|v channels."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class LatentAttentionShape:
    """Multi-head latent attention's shape (DeepSeek-V3, mla.py): queries through a low-rank
    q_lora_rank (0: a plain q_proj), keys and values from one kv_lora_rank latent per token
    plus one rotary key of qk_rope_head_dim shared by the heads; each head's query and key
    are qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim. rope_interleave: the
    rotary dims come as interleaved pairs (DeepSeek's checkpoints)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def cache_dim(self) -> int:
        """What the pool holds per token and layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 style
    decoder, dense or with sparse mixture-of-experts MLPs (Qwen3-MoE, Mixtral) in
    `sparse_layers`, and of the hybrid ones (Qwen3-Next, Qwen3.5) whose `linear_layers` mix
    tokens with a Gated DeltaNet."""

    architecture: str  # one of _MODEL_TYPES
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
    # Each layer's sliding attention window: a token sees the last `window` keys, itself
    # included (0: all of them; empty: no layer windowed).
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float = 0.0  # RoPE base of the windowed layers, unscaled (0: rope_theta)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    # Gemma: embeddings scaled by sqrt(hidden); norms around the attention and the MLP
    # outputs as well as before them; attention scaled by query_pre_attn_scalar^-0.5; scores
    # and final logits soft-capped (cap * tanh(x / cap); 0: none).
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    query_pre_attn_scalar: float = 0.0
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Hybrid linear attention (Qwen3-Next, Qwen3.5): the layers whose token mixer is a Gated
    # DeltaNet of shape `linear` instead of attention; attention gates its output by the
    # sigmoid of a second half of q_proj (attn_output_gate); a sparse MLP adds a shared
    # expert of this width, gated by a sigmoid (0: none).
    linear_layers: tuple[int, ...] = ()
    linear: LinearAttentionShape | None = None
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0
    # DeepSeek-V3's and GLM-4.5's router (moe.grouped_route): sigmoid scores, experts chosen
    # by score plus a correction bias within the best `moe_topk_groups` of `moe_groups`
    # groups, weights scaled by routed_scaling_factor; their shared experts are ungated
    # (moe_groups 0: the softmax router).
    mla: LatentAttentionShape | None = None  # latent attention's shape, or None
    softmax_scale: float = 0.0  # q . k's factor where the family sets it apart (0: derived)
    moe_groups: int = 0
    moe_topk_groups: int = 0
    routed_scaling_factor: float = 1.0
    # o_proj's bias, where attention_bias gives one (every family but Qwen2 and GLM-4.5).
    o_proj_bias: bool = False
    # gpt-oss: a learned logit per query head that joins each softmax's denominator
    # (attention sinks); routers and experts with biases; experts whose gate and up are
    # clamped to swiglu_limit and combined as (up + 1) * gate * sigmoid(swiglu_alpha * gate)
    # (0: a plain gated MLP).
    attention_sinks: bool = False
    expert_bias: bool = False
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return bool(self.sparse_layers)

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state per request instead of KV."""
        return bool(self.linear_layers)

    @property
    def num_kv_layers(self) -> int:
        """The layers that attend, and so hold KV in the pool."""
        return self.num_layers - len(self.linear_layers)

    def mixer_index(self, layer: int) -> int:
        """Layer `layer`'s place among its kind: its KV pool layer if it attends, else its
        state pool layer."""
        linear = layer in self.linear_layers
        return sum((i in self.linear_layers) == linear for i in range(layer))

    @property
    def attention_scale(self) -> float:
        """What q . k is multiplied by before the softmax."""
        if self.softmax_scale:
            return self.softmax_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_cache_dims(self) -> tuple[int, int]:
        """A token's cached key and value widths per KV head and layer: latent attention
        caches one latent-and-rotary key and reads its values from the key's latent part."""
        if self.mla is not None:
            return self.mla.cache_dim, 0
        return self.head_dim, self.head_dim

    @property
    def rope_dim(self) -> int:
        """The dims of each head RoPE rotates: all, or the leading ones of a partial rotary
        (Phi-4-mini rotates 3/4); the rest pass through."""
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        model_type = cfg.get("model_type", "llama")
        if model_type in _TEXT_MODELS and "text_config" in cfg:  # a multimodal file's text part
            outer = {k: v for k, v in cfg.items() if not k.endswith("_config")}
            model_type = _TEXT_MODELS[model_type]
            cfg = {**outer, **cfg["text_config"], "model_type": model_type}
            if "tie_word_embeddings" in outer:  # the multimodal model's own lm_head
                cfg["tie_word_embeddings"] = outer["tie_word_embeddings"]
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        # Older config.json files carry rope_theta + rope_scaling, newer ones rope_parameters
        # (theta, the partial rotary factor and any scaling in one dict).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        local_theta = 0.0
        if model_type == "gemma3_text":
            rope, local_theta = _gemma3_rope(rope, cfg)
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or cfg.get(
            "partial_rotary_factor", _HYBRID_PARTIAL_ROTARY if model_type in HYBRID_FAMILIES
            else 1.0)
        # Qwen3.5's multimodal rotary: a text token's three position axes are one, which
        # rotates as plain RoPE does.
        for key in ("mrope_section", "mrope_interleaved"):
            rope.pop(key, None)
        scaling = rope_scaling(rope, cfg, model_type)
        latent = _latent_fields(cfg, model_type, scaling, rope.get("mscale_all_dim") or 0.0)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # Qwen3.5-MoE has no dense MLP.
            intermediate_size=(cfg.get("intermediate_size", 0) if model_type in _ALL_SPARSE
                               else cfg["intermediate_size"]),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=latent.get("num_kv_heads", cfg.get("num_key_value_heads") or heads),
            head_dim=latent.get("head_dim", head_dim),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=capped_context(
                cfg.get("max_position_embeddings", 4096), scaling, name
            ),
            tie_word_embeddings=cfg.get("tie_word_embeddings", model_type in GEMMA),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            o_proj_bias=cfg.get("attention_bias", False) and model_type not in _NO_O_BIAS,
            qk_norm=model_type in _QK_NORM or bool(cfg.get("use_qk_norm")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            **_moe_shape(cfg, model_type),
            # rounded down, as transformers does
            rotary_dim=latent.get("rotary_dim", int(head_dim * partial)),
            layer_windows=_layer_windows(cfg, model_type),
            local_rope_theta=local_theta,
            **_gemma_fields(cfg, model_type),
            **_hybrid_fields(cfg, model_type),
            **_gpt_oss_fields(cfg, model_type),
            mla=latent.get("mla"),
            softmax_scale=latent.get("softmax_scale", 0.0),
        )


def _moe_shape(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields of a mixture-of-experts config.json (none for dense types).

    Mixtral routes every layer through experts as wide as `intermediate_size` and always
    renormalizes; Qwen3-MoE and Qwen3-Next make every `decoder_sparse_step`-th layer sparse
    except `mlp_only_layers` (dense MLPs of `intermediate_size` there) with experts of
    `moe_intermediate_size`; Qwen3.5-MoE makes every layer sparse and always renormalizes.
    Qwen3-Next's and Qwen3.5-MoE's sparse layers add a shared expert."""
    if model_type not in ("qwen3_moe", "mixtral", "qwen3_next", "gpt_oss", *_GROUPED_ROUTER,
                          *_ALL_SPARSE):
        return {}
    layers = cfg["num_hidden_layers"]
    # transformers 5 writes num_local_experts for both; Qwen's own files say num_experts.
    experts = (cfg.get("num_local_experts") or cfg.get("num_experts")
               or cfg.get("n_routed_experts") or 0)
    if model_type in _GROUPED_ROUTER:  # the first first_k_dense_replace layers dense
        dense = cfg.get("first_k_dense_replace", 0)
        return {
            "num_experts": experts,
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": cfg.get("norm_topk_prob", True),
            "sparse_layers": tuple(range(dense, layers)) if experts else (),
            "shared_expert_intermediate_size":
                cfg.get("n_shared_experts", 0) * cfg["moe_intermediate_size"],
            "moe_groups": cfg.get("n_group", 1),
            "moe_topk_groups": cfg.get("topk_group", 1),
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        }
    if model_type in ("mixtral", "gpt_oss"):
        # gpt-oss takes the softmax of the chosen experts' logits: the renormalized top-k of
        # the softmax over all of them.
        sparse = tuple(range(layers)) if experts else ()
        width, renormalize = cfg["intermediate_size"], True
    elif model_type in _ALL_SPARSE:
        sparse = tuple(range(layers)) if experts else ()
        width, renormalize = cfg["moe_intermediate_size"], True
    else:
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        sparse = tuple(i for i in range(layers)
                       if experts and i not in dense and (i + 1) % step == 0)
        # Qwen3-Next renormalizes unless its file says not to; Qwen3-MoE only if it says to.
        width = cfg["moe_intermediate_size"]
        renormalize = cfg.get("norm_topk_prob", model_type == "qwen3_next")
    return {
        "num_experts": experts,
        "num_experts_per_tok": cfg["num_experts_per_tok"],
        "moe_intermediate_size": width,
        "norm_topk_prob": renormalize,
        "sparse_layers": sparse,
        "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0,
    }


def _latent_fields(cfg: dict[str, Any], model_type: str, scaling: dict[str, Any] | None,
                   mscale_all_dim: float) -> dict[str, Any]:
    """The ModelConfig fields of a latent-attention family (none for the others): its
    shape, one KV head (the latent) and heads as wide as the rotary key for RoPE, and the
    softmax scale over the whole query width, times YaRN's mscale_all_dim factor squared."""
    if model_type != "deepseek_v3":
        return {}
    if cfg.get("attention_bias"):
        raise ValueError("deepseek_v3 with attention_bias is not served")
    shape = LatentAttentionShape(
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        kv_lora_rank=cfg["kv_lora_rank"],
        qk_nope_head_dim=cfg["qk_nope_head_dim"],
        qk_rope_head_dim=cfg["qk_rope_head_dim"],
        v_head_dim=cfg["v_head_dim"],
        rope_interleave=cfg.get("rope_interleave", True),
    )
    scale = (shape.qk_nope_head_dim + shape.qk_rope_head_dim) ** -0.5
    if scaling is not None and scaling.get("rope_type") == "yarn" and mscale_all_dim:
        scale *= yarn_mscale(scaling["factor"], mscale_all_dim) ** 2
    return {"mla": shape, "num_kv_heads": 1, "head_dim": shape.qk_rope_head_dim,
            "rotary_dim": shape.qk_rope_head_dim, "softmax_scale": scale}


def _gpt_oss_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields only gpt-oss sets (none for the other families), with
    transformers' GptOssConfig defaults."""
    if model_type != "gpt_oss":
        return {}
    return {"attention_sinks": True, "expert_bias": True,
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0))}


def _hybrid_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields of a hybrid linear-attention family (none for the others): its
    Gated DeltaNet layers, from `layer_types` or else one full-attention layer closing each
    `full_attention_interval`, their shape, and attention's output gate."""
    if model_type not in HYBRID_FAMILIES:
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % cfg.get("full_attention_interval",
                                               _HYBRID_FULL_ATTENTION_INTERVAL) == 0
        else "linear_attention"
        for i in range(layers)
    ]
    unknown = set(types) - {"linear_attention", "full_attention"}
    if len(types) != layers or unknown:
        raise ValueError(f"layer_types: expected {layers} of linear_attention and "
                         f"full_attention, got {types}")
    shape = LinearAttentionShape(
        num_k_heads=cfg["linear_num_key_heads"],
        num_v_heads=cfg["linear_num_value_heads"],
        k_head_dim=cfg["linear_key_head_dim"],
        v_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4),
    )
    if shape.num_v_heads % shape.num_k_heads:
        raise ValueError(f"linear_num_value_heads {shape.num_v_heads} is not a multiple of "
                         f"linear_num_key_heads {shape.num_k_heads}")
    return {
        "linear_layers": tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        "linear": shape,
        "attn_output_gate": True,
    }


def _layer_windows(cfg: dict[str, Any], model_type: str) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it for this config (empty: none,
    or one no smaller than the context, which never binds)."""
    window = cfg.get("sliding_window")
    if model_type == "mistral" and "sliding_window" not in cfg:
        window = _MISTRAL_DEFAULT_WINDOW
    if model_type not in (*_WINDOWED, *GEMMA, "gpt_oss"):
        window = None
    if model_type == "qwen3_moe" and not cfg.get("use_sliding_window", False):
        window = None  # Qwen3-MoE uses its window only when use_sliding_window is set
    if not window or window >= cfg.get("max_position_embeddings", 4096):
        return ()
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if model_type == "gpt_oss":  # every other layer, from the first, unless layer_types says
        types = types or ["sliding_attention" if i % 2 == 0 else "full_attention"
                          for i in range(layers)]
    elif model_type not in GEMMA:
        return (int(window),) * layers
    windowed = (
        [t == "sliding_attention" for t in types] if types
        else windowed_every(cfg.get("sliding_window_pattern") or GEMMA_WINDOW_PERIOD[model_type],
                            layers)
    )
    return tuple(int(window) if w else 0 for w in windowed)


def windowed_every(period: int, layers: int) -> list[bool]:
    """Which of `layers` are windowed when all but the last of each `period` are (0: all)."""
    return [not period or i % period < period - 1 for i in range(layers)]


def _gemma3_rope(rope: dict[str, Any], cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """Gemma 3's rope parameters: (those of its global layers, the windowed layers' base).
    transformers 5 writes one dict per layer type; older files rope_theta,
    rope_local_base_freq and a rope_scaling for the global layers."""
    if "full_attention" in rope or "sliding_attention" in rope:
        local = rope.get("sliding_attention") or {}
        full = dict(rope.get("full_attention") or {})
        full.setdefault("rope_theta", GEMMA3_THETA[0])
        return full, float(local.get("rope_theta", GEMMA3_THETA[1]))
    rope.setdefault("rope_theta", cfg.get("rope_theta", GEMMA3_THETA[0]))
    return rope, float(cfg.get("rope_local_base_freq", GEMMA3_THETA[1]))


def _gemma_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelConfig fields only Gemma sets (none for the other families); Gemma 2's soft
    caps default to transformers' Gemma2Config values, Gemma 3 has none by default."""
    if model_type not in GEMMA:
        return {}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported Gemma hidden_activation {act!r}")
    caps = GEMMA2_SOFTCAPS if model_type == "gemma2" else (None, None)
    attn_cap = cfg.get("attn_logit_softcapping", caps[0])
    final_cap = cfg.get("final_logit_softcapping", caps[1])
    return gemma_fields(cfg["hidden_size"], cfg.get("query_pre_attn_scalar", 256),
                        attn_cap or 0.0, final_cap or 0.0)


def gemma_fields(
    hidden: int, query_pre_attn_scalar: float, attn_cap: float, final_cap: float
) -> dict[str, Any]:
    """The ModelConfig fields every Gemma sets, with its file's scalar and soft caps."""
    return {
        "hidden_act": "gelu_tanh",
        "embed_scale": hidden**0.5,
        "sandwich_norms": True,
        "query_pre_attn_scalar": float(query_pre_attn_scalar),
        "attn_logit_softcap": float(attn_cap),
        "final_logit_softcap": float(final_cap),
    }
