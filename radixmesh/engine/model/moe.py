"""A sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k
experts, each a gated SiLU MLP, and the token's output is their weighted sum.

On a CUDA device with dense expert weights, the experts are stacked once into [E, 2I, H]
(gate|up) and [E, H, I] (down) and the Triton fused MoE kernel (kernels/fused_moe.py) runs
them all in two grouped GEMMs. On the CPU with every expert quantized (GGUF types), one
native call runs all of a step's experts (kernels/cpu/moe.cpp) with bf16 activations.
Otherwise each expert's weights, in whatever form the loader gave (float tensors or GGUF
`QuantizedWeight`s), are wrapped in a `Linear`, so the same dense or native quantized
kernels as the dense MLP run them, one expert after another. Experts are named one by one,
as Hugging Face's per-expert checkpoints spell them:
`{prefix}.experts.{e}.{gate,up,down}_proj.weight`, router `{prefix}.gate.weight`; the
loaders bring every other layout to these names.

DeepSeek-V3 and GLM-4.5 route by sigmoid scores within groups (grouped_route; the
correction bias `{prefix}.gate.e_score_correction_bias`) and add shared experts
`{prefix}.shared_experts.*` ungated.

gpt-oss's router has a bias (`{prefix}.gate.bias`) and its experts are biased, clamped
SwiGLUs (mlp.clamped_swiglu; biases named as the weights, `.bias`), run one by one.

Qwen3-Next and Qwen3.5-MoE add a shared expert every token goes through, a gated MLP
`{prefix}.shared_expert.{gate,up,down}_proj.weight` whose output is scaled by
sigmoid(x . `{prefix}.shared_expert_gate.weight`) and added to the routed experts'."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import torch
import torch.nn.functional as F

from radixmesh.engine.model.linear import Weight, float_weight
from radixmesh.engine.model.mlp import GatedMLP
from radixmesh.engine.model.parallel import TensorParallel
from radixmesh.kernels.native_quant import ExpertWeights, moe_experts, moe_route

# An expert's projections, in the order GatedMLP takes them.
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_weight_name(prefix: str, expert: int, projection: str) -> str:
    """The name one expert's projection goes by: `prefix` is the layer's `...mlp`."""
    return f"{prefix}.experts.{expert}.{projection}.weight"


class Routing(NamedTuple):
    """Each token's chosen experts, best first, and their weights (float32), [T, k] each."""

    experts: torch.Tensor
    weights: torch.Tensor


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Router logits [T, E] -> the top-k experts of the softmax over all E (in float32, as
    transformers does), their probabilities rescaled to sum to 1 if `renormalize`.

    torch.topk decides ties, exactly as in transformers."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(experts, weights)


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek-V3's and GLM-4.5's router settings (see grouped_route)."""

    groups: int
    topk_groups: int
    scale: float


def grouped_route(logits: torch.Tensor, correction: torch.Tensor, top_k: int,
                  spec: GroupedRouting, renormalize: bool) -> Routing:
    """Router logits [T, E] (float32) -> each token's experts and weights as DeepSeek-V3
    routes: sigmoid scores; for choosing, the scores plus a per-expert correction bias; each
    of `groups` groups of experts scored by its two best, only the best `topk_groups` groups
    open; the top-k experts there; their weights the plain scores (renormalized to sum to 1
    if asked) times `scale`."""
    scores = torch.sigmoid(logits.float())
    choice = scores + correction
    tokens, experts = choice.shape
    grouped = choice.view(tokens, spec.groups, experts // spec.groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    best = group_scores.topk(spec.topk_groups, dim=-1, sorted=False).indices
    open_groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~open_groups.repeat_interleave(experts // spec.groups, 1),
                                float("-inf"))
    chosen = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, chosen)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(chosen, weights * spec.scale)


def stack_experts(
    experts: Iterable[tuple[Weight, ...]], num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's (gate, up, down) copied into [E, 2I, H] (gate rows, then up) and
    [E, H, I], one expert at a time: only one expert's weights are held besides the stacks."""
    gate_up = down = torch.empty(0)
    for e, weights in enumerate(experts):
        gate, up, proj = weights
        if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)
                and isinstance(proj, torch.Tensor)):
            raise ValueError("the fused MoE kernel takes dense expert weights, not quantized ones")
        inter = gate.shape[0]
        if e == 0:
            gate_up = gate.new_empty(num_experts, 2 * inter, gate.shape[1])
            down = proj.new_empty(num_experts, *proj.shape)
        gate_up[e, :inter] = gate
        gate_up[e, inter:] = up
        down[e] = proj
    return gate_up, down


class SparseMoE:
    """The sparse MLP of one layer: `block(x, residual)` -> residual + MoE(x).

    `fused` runs the experts through the fused Triton kernel (None: when their weights are
    dense tensors on a CUDA device; True on the CPU runs it under TRITON_INTERPRET=1), else
    one GatedMLP per expert.

    Under tensor parallelism every expert is split like the dense MLP (gate/up by output
    rows, down by input columns; parallel.shard_weights does it, by name) and the router is
    replicated: each rank routes the same tokens the same way, sums its experts' partial
    outputs (the fused path stacks this rank's shards), and one all-reduce per layer
    completes them."""

    def __init__(
        self,
        w: Mapping[str, Weight],
        prefix: str,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        tp: TensorParallel | None = None,
        fused: bool | None = None,
        shared: bool = False,
        swiglu: tuple[float, float] | None = None,
        grouped: GroupedRouting | None = None,
    ) -> None:
        router = w[f"{prefix}.gate.weight"]
        # The router runs as transformers runs it (F.linear on the float weight, in the
        # activations' dtype): routing is discontinuous, so its logits should differ from
        # the reference's as little as they can. It is tiny (experts x hidden).
        if not isinstance(router, torch.Tensor) or router.shape[0] != num_experts:
            raise ValueError(f"{prefix}.gate.weight must be a float [{num_experts}, hidden] "
                             f"router, got {type(router).__name__} {list(router.shape)}")
        self.router = router
        self.router_bias = float_weight(w, f"{prefix}.gate.bias") if swiglu else None
        self.grouped = grouped
        self.correction = (float_weight(w, f"{prefix}.gate.e_score_correction_bias").float()
                           if grouped else None)
        # Fetched one expert at a time (the model's weight mapping may move each to the GPU).
        experts = (
            tuple(w[expert_weight_name(prefix, e, p)] for p in EXPERT_PROJECTIONS)
            for e in range(num_experts)
        )
        first = next(experts)
        if swiglu is not None:
            # gpt-oss's experts (biased, clamped SwiGLU): one GatedMLP each, on any device.
            self.experts = [
                GatedMLP(*weights, swiglu=swiglu, biases=tuple(  # type: ignore[arg-type]
                    float_weight(w, expert_weight_name(prefix, e, p).replace(".weight", ".bias"))
                    for p in EXPERT_PROJECTIONS))
                for e, weights in enumerate(chain([first], experts))
            ]
            self.fused, self.native, self.shared = False, None, None
            self.top_k, self.renormalize, self.tp = top_k, renormalize, tp
            return
        if fused is None:
            fused = all(isinstance(t, torch.Tensor) and t.is_cuda for t in first)
        self.fused = fused
        # No reduction per expert: the block reduces their weighted sum once.
        self.experts: list[GatedMLP] = []
        self.native: ExpertWeights | None = None
        if fused:
            self.w_gate_up, self.w_down = stack_experts(chain([first], experts), num_experts)
        else:
            weights = [first, *experts]
            self.experts = [GatedMLP(*expert) for expert in weights]
            # Every expert quantized: all of a step's experts in one native call.
            self.native = ExpertWeights.of(weights)
        self.top_k, self.renormalize, self.tp = top_k, renormalize, tp
        self.shared: GatedMLP | None = None
        self.shared_gate: torch.Tensor | None = None
        if shared and grouped is not None:  # DeepSeek's and GLM's: added as it is
            self.shared = GatedMLP(*(w[f"{prefix}.shared_experts.{p}.weight"]
                                     for p in EXPERT_PROJECTIONS))
        elif shared:
            self.shared = GatedMLP(*(w[f"{prefix}.shared_expert.{p}.weight"]
                                     for p in EXPERT_PROJECTIONS))
            self.shared_gate = float_weight(w, f"{prefix}.shared_expert_gate.weight")

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, lora: object = None,
                 layer: int = 0) -> torch.Tensor:
        """x [T, hidden] (post-attention-normed), residual [T, hidden] -> the layer's output.
        The experts take no LoRA adapter (one that targets them is refused at load)."""
        if self.grouped is not None:
            assert self.correction is not None
            # In float32, as transformers routes (the router weight kept in float32 too).
            routing = grouped_route(F.linear(x.float(), self.router.float()), self.correction,
                                    self.top_k, self.grouped, self.renormalize)
            mixed = (moe_experts(x, *routing, self.native)
                     if self.native is not None and x.dtype == torch.bfloat16
                     else self._fused(x, routing) if self.fused
                     else self._expert_by_expert(x, routing))
        elif self.native is not None and x.dtype == torch.bfloat16:
            # Routed and run natively, as the native whole layers (cpu/layer.cpp) do.
            experts, weights = moe_route(x, self.router, self.top_k, self.renormalize)
            mixed = moe_experts(x, experts, weights, self.native)
        else:
            routing = route(F.linear(x, self.router, self.router_bias), self.top_k,
                            self.renormalize)
            mixed = (self._fused(x, routing) if self.fused
                     else self._expert_by_expert(x, routing))
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            mixed = mixed + shared.to(mixed.dtype)
        if self.tp is not None:
            mixed = self.tp.all_reduce(mixed)
        return residual + mixed.to(residual.dtype)

    def _fused(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' weighted sum [T, hidden] through the fused kernel, in x's dtype."""
        # Imported here: triton is an optional dependency that a CPU-only install may lack.
        from radixmesh.kernels.fused_moe import fused_moe

        return fused_moe(x, self.w_gate_up, self.w_down, routing.experts, routing.weights)

    def _expert_by_expert(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The experts' weighted sum [T, hidden], one GatedMLP per expert, in float32."""
        tokens, k = routing.experts.shape
        # Sort the T*k (token, expert) picks by expert: each expert's tokens are one
        # contiguous run, so its two GEMMs run once over all of them.
        picks = routing.experts.flatten()
        order = torch.argsort(picks, stable=True)
        counts = torch.bincount(picks, minlength=len(self.experts)).tolist()
        rows = x[order // k]
        out = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                run = slice(start, start + count)
                out[run] = expert(rows[run])
                start += count
        # Back to (token, pick) order, then each token's weighted sum over its k picks,
        # accumulated in float32.
        unsorted = torch.empty_like(out)
        unsorted[order] = out
        return torch.bmm(
            routing.weights.unsqueeze(1), unsorted.view(tokens, k, -1).float()
        ).squeeze(1)
