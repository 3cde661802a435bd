"""A Llama-family decoder (Llama/SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, the
mixture-of-experts Qwen3-MoE and Mixtral, and the hybrid linear-attention Qwen3-Next and
Qwen3.5) over a slot-indexed KV pool and, for the hybrids, a per-request state pool."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixmesh.engine.model.attention import AttentionBackend
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.linear import Linear, Weight, float_weight
from radixmesh.engine.model.linear_attention import GatedDeltaNet
from radixmesh.engine.model.mla import LatentAttention
from radixmesh.engine.model.mlp import GatedMLP
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.moe import GroupedRouting, SparseMoE
from radixmesh.engine.model.parallel import TensorParallel, row_parallel
from radixmesh.engine.model.rope import RotaryEmbedding, RotaryStep
from radixmesh.engine.model.state_pool import StateStep
from radixmesh.kernels import native
from radixmesh.kernels.native_layer import LayerStack, SparseLayer
from radixmesh.kernels.native_quant import QuantizedWeight

if TYPE_CHECKING:
    from radixmesh.engine.model.lora import LoraBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in float32: the native kernel where it is built
    (one pass instead of torch's several), else torch's."""
    if native.rms_norm_supported(x, weight):
        return native.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


class _Cast(Mapping[str, Weight]):
    """Weights moved to the model's device and dtype one at a time as the model takes them,
    so no second full copy is ever held (on the host or the device). Quantized weights stay
    as they are (CPU only)."""

    def __init__(
        self, weights: Mapping[str, Weight], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.weights, self.dtype, self.device = weights, dtype, device

    def __getitem__(self, name: str) -> Weight:
        weight = self.weights[name]
        if isinstance(weight, QuantizedWeight):
            if self.device.type != "cpu":
                raise ValueError(f"{name}: quantized weights run on the CPU only")
            return weight
        return weight.to(device=self.device, dtype=self.dtype)

    def tensor(self, name: str) -> torch.Tensor:
        """A weight that is never quantized (norms, biases)."""
        return float_weight(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


class DecoderLayer:
    """A token mixer + MLP with pre-norms (and Gemma's norms of their outputs too). The mixer
    is attention, q/k/v fused into one matmul (with the hybrids' output gate, a fourth part
    of it), or a hybrid's Gated DeltaNet (`layer` in cfg.linear_layers); gate/up are fused
    too. The MLP is dense, or the experts of a sparse layer (`sparse`).

    Under tensor parallelism `cfg` is this rank's share (see parallel.local_config)."""

    def __init__(
        self,
        cfg: ModelConfig,
        w: _Cast,
        prefix: str,
        tp: TensorParallel | None = None,
        sparse: bool = False,
        layer: int = 0,
    ) -> None:
        attn = f"{prefix}.self_attn"
        self.cfg = cfg
        # Its layer in the KV pool (attention) or in the state pool (a Gated DeltaNet).
        self.mixer_index = cfg.mixer_index(layer)
        self.input_norm = w.tensor(f"{prefix}.input_layernorm.weight")
        # Without sandwich norms post_attention_layernorm is the MLP's pre-norm; with them it
        # norms the attention's output, and the MLP has a norm on each side.
        self.post_norm = w.tensor(f"{prefix}.post_attention_layernorm.weight")
        self.mlp_norms = (
            (w.tensor(f"{prefix}.pre_feedforward_layernorm.weight"),
             w.tensor(f"{prefix}.post_feedforward_layernorm.weight"))
            if cfg.sandwich_norms else None
        )
        mlp = f"{prefix}.mlp"
        self.mlp: GatedMLP | SparseMoE = (
            SparseMoE(w, mlp, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, tp,
                      shared=cfg.shared_expert_intermediate_size > 0,
                      swiglu=(cfg.swiglu_alpha, cfg.swiglu_limit) if cfg.expert_bias else None,
                      grouped=GroupedRouting(cfg.moe_groups, cfg.moe_topk_groups,
                                             cfg.routed_scaling_factor)
                      if cfg.moe_groups else None)
            if sparse
            else GatedMLP(w[f"{mlp}.gate_proj.weight"], w[f"{mlp}.up_proj.weight"],
                          w[f"{mlp}.down_proj.weight"], tp, cfg.hidden_act)
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.linear_attn: GatedDeltaNet | None = None
        self.latent_attn: LatentAttention | None = None
        if cfg.mla is not None:
            self.latent_attn = LatentAttention(cfg, w, attn)
            return
        if layer in cfg.linear_layers:
            assert cfg.linear is not None
            self.linear_attn = GatedDeltaNet(cfg.linear, w, f"{prefix}.linear_attn",
                                             cfg.rms_norm_eps, w.device)
            return
        parts = [w[f"{attn}.{p}_proj.weight"] for p in "qkv"]
        biases = [w.tensor(f"{attn}.{p}_proj.bias") for p in "qkv"] if cfg.attention_bias else []
        if cfg.attn_output_gate:  # q_proj's output gate rows (and bias) go last
            parts[0], gate = _query_and_gate(parts[0], cfg.num_heads, cfg.head_dim)
            parts.append(gate)
            if biases:
                biases[0], gate_bias = _query_and_gate(biases[0], cfg.num_heads, cfg.head_dim)
                biases.append(gate_bias)
        self.qkv = Linear(parts, torch.cat(biases) if biases else None)
        self.o = (Linear(w[f"{attn}.o_proj.weight"], w.tensor(f"{attn}.o_proj.bias"))
                  if cfg.o_proj_bias else row_parallel(w[f"{attn}.o_proj.weight"], tp))
        self.sinks = w.tensor(f"{attn}.sinks").float() if cfg.attention_sinks else None
        self.q_norm = w.tensor(f"{attn}.q_norm.weight") if cfg.qk_norm else None
        self.k_norm = w.tensor(f"{attn}.k_norm.weight") if cfg.qk_norm else None

    def __call__(
        self,
        layer: int,
        hidden: torch.Tensor,
        rope: RotaryStep,
        attn: AttentionBackend,
        pool: KVPool,
        lora: LoraBatch | None = None,
        states: StateStep | None = None,
    ) -> torch.Tensor:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = rms_norm(hidden, self.input_norm, eps)
        if self.linear_attn is not None:
            if states is None:
                raise ValueError("a linear-attention layer needs the step's states")
            hidden = self.linear_attn(x, states, self.mixer_index, hidden)
            return self.mlp(rms_norm(hidden, self.post_norm, eps), hidden, lora, layer)
        if self.latent_attn is not None:
            hidden = self.latent_attn(self.mixer_index, x, rope, attn, pool, hidden)
            return self.mlp(rms_norm(hidden, self.post_norm, eps), hidden, lora, layer)
        qkv = self.qkv(x, extra=None if lora is None else functools.partial(lora.add, layer, "qkv"))
        gate = None
        if cfg.attn_output_gate:
            qkv, gate = qkv.split([self.q_size + 2 * self.kv_size, self.q_size], dim=-1)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(-1, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat(
                (
                    rms_norm(q, self.q_norm, eps),
                    rms_norm(k, self.k_norm, eps),
                ),
                dim=1,
            )
        # q and k heads rotate together: one set of elementwise ops instead of two.
        q, k = rope(qk).split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        out = attn.forward(self.mixer_index, q, k, v, pool, self.sinks).reshape(-1, self.q_size)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        extra = None if lora is None else functools.partial(lora.add, layer, "o")
        if self.mlp_norms is None:
            hidden = self.o(out, residual=hidden, extra=extra)
            return self.mlp(rms_norm(hidden, self.post_norm, eps), hidden, lora, layer)
        pre, post = self.mlp_norms
        hidden = hidden + rms_norm(self.o(out, extra=extra), self.post_norm, eps)
        return hidden + rms_norm(self.mlp(rms_norm(hidden, pre, eps), None, lora, layer), post,
                                 eps)


def _query_and_gate(q_proj: Weight, heads: int, head_dim: int) -> tuple[torch.Tensor,
                                                                          torch.Tensor]:
    """A gated attention's q_proj weight [heads x (query | gate) x head_dim, hidden] (or its
    bias) split into the queries' rows and the output gate's, [heads x head_dim, ...] each."""
    if not isinstance(q_proj, torch.Tensor):
        raise ValueError("a gated attention's q_proj must be a float tensor")
    rest = q_proj.shape[1:]
    query, gate = q_proj.view(heads, 2, head_dim, *rest).unbind(1)
    return query.reshape(heads * head_dim, *rest), gate.reshape(heads * head_dim, *rest)


class CausalLM:
    """Embeddings, decoder layers, final norm and the output projection, on `device`."""

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Mapping[str, Weight],
        dtype: torch.dtype,
        tp: TensorParallel | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        w = _Cast(weights, dtype, self.device)
        self.cfg = cfg
        self.dtype = dtype
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = Linear(self.embed if cfg.tie_word_embeddings else w["lm_head.weight"])
        self.norm = w.tensor("model.norm.weight")
        self.layers = [
            DecoderLayer(cfg, w, f"model.layers.{i}", tp, i in cfg.sparse_layers, i)
            for i in range(cfg.num_layers)
        ]
        self.native_layers = self._native_layers(tp)
        self.rope = RotaryEmbedding(
            cfg.head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            dtype,
            cfg.rope_scaling,
            device=self.device,
            rotary_dim=cfg.rope_dim,
        )
        # Gemma 3's windowed layers rotate with a base of their own, unscaled.
        self.local_rope = (
            RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                            dtype, device=self.device, rotary_dim=cfg.rope_dim)
            if cfg.local_rope_theta else None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        pool: KVPool,
        lora: LoraBatch | None = None,
        states: StateStep | None = None,
    ) -> torch.Tensor:
        """Token ids [T] at positions [T] -> final hidden states [T, hidden], each token's
        LoRA adapter (`lora`, if any) added to the projections it targets; a hybrid model's
        linear layers advance the requests' `states`."""
        if isinstance(self.embed, QuantizedWeight):
            hidden = self.embed.rows(input_ids, self.dtype)
        else:
            hidden = self.embed[input_ids]
        if self.cfg.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.cfg.embed_scale, dtype=hidden.dtype)
        if (self.native_layers is not None and (lora is None or not lora.pool.kernels)
                and (plan := attn.native_plan()) is not None):
            self.native_layers.forward(
                hidden, pool.k, pool.v, positions, self.rope.cos, self.rope.sin,
                plan.out_slots, plan.runs, plan.scale,
                None if lora is None else lora.native_args(),
            )
        else:
            rope = RotaryStep(self.rope, positions)
            local = rope if self.local_rope is None else RotaryStep(self.local_rope, positions)
            windows = self.cfg.layer_windows
            for i, layer in enumerate(self.layers):
                hidden = layer(i, hidden, local if windows and windows[i] else rope, attn, pool,
                               lora, states)
        return rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)

    def _native_layers(self, tp: TensorParallel | None) -> LayerStack | None:
        """Every layer as one native call, where each of its parts runs natively here (bf16
        activations, weights in bf16 on an AVX512-BF16 CPU or quantized, RoPE over whole
        heads, one rank, SiLU MLPs with pre-norms only, experts all quantized and none
        shared, no linear attention, attention sinks or o_proj bias: Gemma's, gpt-oss's and
        the hybrids' layers run layer by layer in Python) and the attention backend plans
        it."""
        cfg = self.cfg
        if (tp is not None or cfg.rope_dim != cfg.head_dim or cfg.is_hybrid
                or cfg.shared_expert_intermediate_size or cfg.attention_sinks or cfg.o_proj_bias
                or cfg.moe_groups or cfg.mla is not None
                or cfg.sandwich_norms or cfg.hidden_act != "silu" or cfg.embed_scale != 1.0
                or self.dtype != torch.bfloat16):
            return None
        stack: list[dict[str, torch.Tensor | list[QuantizedWeight] | SparseLayer | None]] = []
        for layer in self.layers:
            linears = {"qkv": layer.qkv, "o": layer.o}
            experts = None
            if isinstance(layer.mlp, GatedMLP):
                linears |= {"gate_up": layer.mlp.gate_up, "down": layer.mlp.down}
            elif layer.mlp.native is not None:
                mlp = layer.mlp
                experts = SparseLayer(mlp.router, mlp.top_k, mlp.renormalize, mlp.native)
            else:
                return None
            projections = {name: linear.native_weight() for name, linear in linears.items()}
            if any(p is None for p in projections.values()):
                return None
            stack.append({"input_norm": layer.input_norm, "post_norm": layer.post_norm,
                          "qkv_bias": layer.qkv.bias, "q_norm": layer.q_norm,
                          "k_norm": layer.k_norm, "experts": experts, **projections})
        return LayerStack(
            stack,
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.rms_norm_eps,
        )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [N, hidden] -> float32 logits [N, vocab] (soft-capped where
        the model caps them)."""
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcap
        return logits if not cap else torch.tanh(logits / cap).mul_(cap)
