"""The Gated DeltaNet token mixer of the hybrid linear-attention families (Qwen3-Next,
Qwen3.5): a causal depthwise convolution over q|k|v, then the gated delta rule over a
recurrent state, then a gated RMSNorm and the output projection.

Per request and layer it keeps two states (state_pool.py): the convolution's last
`conv_kernel - 1` input columns, and the recurrent state S [num_v_heads, k_head_dim,
v_head_dim]. Token t (q and k L2-normalised, q scaled by k_head_dim^-0.5; each q/k head
shared by num_v_heads / num_k_heads v heads) updates it as

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

with the decay g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0 and the write strength
beta_t = sigmoid(b_t). A decoding token takes one step of it; a prompt chunk takes it in
blocks of CHUNK tokens (`chunk_rule`), each solved in a few matrix products, and split where
the step saves a snapshot of the state inside the chunk (state_pool.Run's saves), so that
the snapshot is the state exactly there. The state math runs in float32 whatever the
activations' dtype."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixmesh.engine.model.linear import Linear, Weight
from radixmesh.engine.model.model_config import LinearAttentionShape

if TYPE_CHECKING:
    from radixmesh.engine.model.state_pool import StateStep

# Tokens of a prompt solved together by the chunked rule (transformers' block size too).
CHUNK = 64
# Added under the square root of the L2 norm of q and k.
_L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + _L2_EPS)


def causal_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A depthwise convolution over [N, C, K - 1 + T] columns (the state's, then T new ones)
    with `weight` [C, 1, K] -> silu of each new column's output, [N, C, T]."""
    return F.silu(F.conv1d(window, weight, groups=weight.shape[0]))


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of N requests: q/k [N, H, Dk], v [N, H, Dv], g/beta [N, H], state
    [N, H, Dk, Dv] (float32) -> (o [N, H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(-2)  # S^T k: what the state recalls for k
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def chunk_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one request: q/k [H, T, Dk], v [H, T, Dv], g/beta [H, T], state
    [H, Dk, Dv] (float32) -> (o [H, T, Dv], the state after the last token).

    Within a block, with G_t the decay from the block's start through token t and S0 the
    state before it, the recurrence unrolls to

        u_t = beta_t (v_t - G_t S0^T k_t - sum_{s<t} (G_t / G_s) (k_t . k_s) u_s)
        o_t = G_t S0^T q_t + sum_{s<=t} (G_t / G_s) (q_t . k_s) u_s
        S   = G_T S0 + sum_s (G_T / G_s) k_s u_s^T

    so the block's u is one unit lower-triangular solve, and o and S a few products."""
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk):
        block = slice(start, start + chunk)
        qb, kb, vb, bb = q[:, block], k[:, block], v[:, block], beta[:, block]
        log_decay = g[:, block].cumsum(-1)  # [H, n]: log G_t
        n = qb.shape[1]
        later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        # G_t / G_s for s <= t, 0 above the diagonal.
        ratio = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(
            later, float("-inf")).exp()
        decay = log_decay.exp()
        system = (bb.unsqueeze(-1) * (kb @ kb.transpose(-1, -2)) * ratio).tril(-1)
        system.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        rhs = bb.unsqueeze(-1) * (vb - decay.unsqueeze(-1) * (kb @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, block] = decay.unsqueeze(-1) * (qb @ state) + ((qb @ kb.transpose(-1, -2))
                                                              * ratio) @ u
        to_end = (log_decay[:, -1:] - log_decay).exp()  # G_T / G_s
        state = decay[:, -1, None, None] * state + (kb * to_end.unsqueeze(-1)).transpose(
            -1, -2) @ u
    return out, state


class GatedDeltaNet:
    """One layer's linear attention, `mixer(x, states, index, residual)` -> residual +
    its output for the step's tokens x [T, hidden] (input-normed), reading and advancing
    the running requests' states in the pool's layer `index`.

    Its projections are fused into one matmul: q|k|v (the convolution's channels, q and k
    by k head, v by v head), the output gate z, b and a (one of each per v head)."""

    def __init__(
        self, shape: LinearAttentionShape, w: Mapping[str, Weight], prefix: str, eps: float,
        device: torch.device,
    ) -> None:
        self.shape, self.eps = shape, eps
        self.in_proj = Linear([w[f"{prefix}.in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
        self.conv = _tensor(w, f"{prefix}.conv1d.weight")  # [conv_dim, 1, kernel]
        self.out_proj = Linear(w[f"{prefix}.out_proj.weight"])
        self.norm = _tensor(w, f"{prefix}.norm.weight")
        # The decay's parameters stay in float32, as the state math runs.
        self.neg_a = -_tensor(w, f"{prefix}.A_log").to(device, torch.float32).exp()
        self.dt_bias = _tensor(w, f"{prefix}.dt_bias").to(device, torch.float32)
        self.splits = [shape.conv_dim, shape.value_dim, shape.num_v_heads, shape.num_v_heads]

    def __call__(self, x: torch.Tensor, states: StateStep, index: int,
                 residual: torch.Tensor) -> torch.Tensor:
        s = self.shape
        tokens = x.shape[0]
        qkv, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        mixed = self._convolve(qkv, states, index)
        q, k, v = mixed.float().split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q, k = (l2_normalize(t.reshape(tokens, s.num_k_heads, s.k_head_dim))
                .repeat_interleave(group, dim=1) for t in (q, k))
        q = q * s.k_head_dim**-0.5
        v = v.reshape(tokens, s.num_v_heads, s.v_head_dim)
        beta = b.float().sigmoid()
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        out = self._delta_rule(q, k, v, g, beta, states, index)
        gated = self._gated_norm(out, z.reshape(tokens, s.num_v_heads, s.v_head_dim))
        return self.out_proj(gated.reshape(tokens, s.value_dim), residual=residual)

    def _convolve(self, qkv: torch.Tensor, states: StateStep, index: int) -> torch.Tensor:
        """Each token's convolved q|k|v [T, conv_dim], the convolution states advanced."""
        conv = states.pool.conv[index]
        out = torch.empty_like(qkv)
        if states.singles is not None:
            at, rows = states.singles
            window = torch.cat([conv.index_select(0, rows), qkv[at].unsqueeze(-1)], dim=-1)
            out[at] = causal_conv(window, self.conv).squeeze(-1)
            conv.index_copy_(0, rows, window[:, :, 1:])
            _keep(states, conv, states.pool.saved_conv, index)
        kept = conv.shape[2]
        for start, length, row, saves in states.runs:
            window = torch.cat([conv[row], qkv[start : start + length].t()], dim=-1)
            out[start : start + length] = causal_conv(window.unsqueeze(0), self.conv)[0].t()
            for after, slot in saves:  # the columns kept after `after` tokens
                states.pool.saved_conv[index][slot] = window[:, after : after + kept]
            conv[row] = window[:, window.shape[1] - kept :]
        return out

    def _delta_rule(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
        beta: torch.Tensor, states: StateStep, index: int,
    ) -> torch.Tensor:
        """Each token's o [T, Hv, Dv] (float32), the recurrent states advanced."""
        recurrent = states.pool.recurrent[index]
        out = torch.empty_like(v)
        if states.singles is not None:
            at, rows = states.singles
            o, new = recurrent_step(q[at], k[at], v[at], g[at], beta[at],
                                    recurrent.index_select(0, rows))
            out[at] = o
            recurrent.index_copy_(0, rows, new)
            _keep(states, recurrent, states.pool.saved_recurrent, index)
        for start, length, row, saves in states.runs:
            # Split where a snapshot is taken: the state after each piece is exact.
            state, begin = recurrent[row], 0
            for end, slot in (*saves, (length, -1)):
                if end > begin:
                    span = slice(start + begin, start + end)
                    o, state = chunk_rule(
                        q[span].transpose(0, 1), k[span].transpose(0, 1),
                        v[span].transpose(0, 1), g[span].t(), beta[span].t(), state)
                    out[span] = o.transpose(0, 1)
                if slot >= 0:
                    states.pool.saved_recurrent[index][slot] = state
                begin = end
            recurrent[row] = state
        return out

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output times silu of its gate z, in z's dtype."""
        normed = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + self.eps)
        return ((self.norm * normed.to(z.dtype)) * F.silu(z.float())).to(z.dtype)


def _keep(states: StateStep, pool: torch.Tensor, saved: list[torch.Tensor], index: int) -> None:
    """Copy the layer's states of the singles StateStep.kept names into their snapshot
    slots."""
    if states.kept is not None:
        rows, slots = states.kept
        saved[index].index_copy_(0, slots, pool.index_select(0, rows))


def _tensor(w: Mapping[str, Weight], name: str) -> torch.Tensor:
    weight = w[name]
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"{name}: a float tensor expected, got {type(weight).__name__}")
    return weight
