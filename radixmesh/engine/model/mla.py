"""Multi-head latent attention (DeepSeek-V3), served from a cache of latents.

Each token caches one vector per layer: its kv_lora_rank latent c (normed) and one rotary key
k_pe shared by every head, (kv_lora_rank + qk_rope_head_dim) values where multi-head
attention would cache every head's key and value. A head's key is W_UK c with k_pe beside it
and its value W_UV c (kv_b_proj holds W_UK and W_UV of every head), so a query's nope part
absorbs W_UK: q_nope . W_UK c = (W_UK^T q_nope) . c. Attention then runs as one KV head over
the cached vectors, the query [W_UK^T q_nope | q_pe] as wide as they are, the values their
latent part; W_UV and o_proj turn each head's attended latent into the output. Decode and
prefill both run this way (prefill over decompressed keys would cost H x (nope + v) per token
of the prompt against the latent's width, and the cache holds latents either way)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from radixmesh.engine.model.attention import AttentionBackend
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.engine.model.linear import Linear, Weight, float_weight
from radixmesh.engine.model.model_config import ModelConfig
from radixmesh.engine.model.rope import RotaryStep


class LatentAttention:
    """One layer's latent attention: `attn(layer, x, rope, backend, pool, residual)` ->
    residual + o_proj(attention of x), x already normed."""

    def __init__(self, cfg: ModelConfig, w: Mapping[str, Weight], prefix: str) -> None:
        shape = cfg.mla
        assert shape is not None
        self.shape, self.heads, self.eps = shape, cfg.num_heads, cfg.rms_norm_eps
        if shape.q_lora_rank:
            self.q_a = Linear(w[f"{prefix}.q_a_proj.weight"])
            self.q_a_norm: torch.Tensor | None = float_weight(w, f"{prefix}.q_a_layernorm.weight")
            self.q = Linear(w[f"{prefix}.q_b_proj.weight"])
        else:
            self.q_a_norm = None
            self.q = Linear(w[f"{prefix}.q_proj.weight"])
        self.kv_a = Linear(w[f"{prefix}.kv_a_proj_with_mqa.weight"])
        self.kv_a_norm = float_weight(w, f"{prefix}.kv_a_layernorm.weight")
        kv_b = float_weight(w, f"{prefix}.kv_b_proj.weight").view(
            self.heads, shape.qk_nope_head_dim + shape.v_head_dim, shape.kv_lora_rank)
        self.w_uk = kv_b[:, : shape.qk_nope_head_dim].contiguous()  # [H, nope, rank]
        self.w_uv = kv_b[:, shape.qk_nope_head_dim :].contiguous()  # [H, v, rank]
        self.o = Linear(w[f"{prefix}.o_proj.weight"])

    def __call__(self, layer: int, x: torch.Tensor, rope: RotaryStep, attn: AttentionBackend,
                 pool: KVPool, residual: torch.Tensor) -> torch.Tensor:
        shape, heads, tokens = self.shape, self.heads, x.shape[0]
        nope, rot, rank = shape.qk_nope_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank
        q_in = x
        if self.q_a_norm is not None:
            q_in = F.rms_norm(self.q_a(x), self.q_a_norm.shape, self.q_a_norm, self.eps)
        q_nope, q_pe = self.q(q_in).view(tokens, heads, nope + rot).split([nope, rot], dim=-1)
        latent, k_pe = self.kv_a(x).split([rank, rot], dim=-1)
        latent = F.rms_norm(latent, self.kv_a_norm.shape, self.kv_a_norm, self.eps)
        pe = torch.cat((q_pe, k_pe.view(tokens, 1, rot)), dim=1)
        if shape.rope_interleave:  # pairs (x0, x1), (x2, x3)... to halves, as RoPE takes them
            pe = pe.unflatten(-1, (rot // 2, 2)).transpose(-1, -2).flatten(-2)
        q_pe, k_pe = rope(pe.contiguous()).split([heads, 1], dim=1)
        query = torch.cat((torch.einsum("thn,hnr->thr", q_nope, self.w_uk), q_pe), dim=-1)
        key = torch.cat((latent.view(tokens, 1, rank), k_pe), dim=-1)
        attended = attn.forward(layer, query, key, None, pool)  # [T, H, rank]
        out = torch.einsum("thr,hvr->thv", attended, self.w_uv).reshape(tokens, -1)
        return self.o(out, residual=residual)
