"""Tensor parallelism: the rank group, the collectives the model needs, and weight sharding.

Attention heads and MLP columns are split across ranks (Megatron-style): q/k/v and
gate/up are column-parallel, o_proj and down_proj row-parallel and summed over the
group; embeddings, norms and the LM head are replicated. Each expert of a sparse MLP is
split the same way (its weights carry the same projection names) and its router is
replicated (moe.SparseMoE)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from radixmesh.engine.model.linear import Linear, Weight
from radixmesh.engine.model.model_config import ModelConfig

# Projections split by output rows (column-parallel) and by input columns (row-parallel).
ROW_SPLIT = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
COLUMN_SPLIT = ("o_proj", "down_proj")
# A rank that waits this long on a collective is stuck behind a dead peer.
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in an initialised tensor-parallel group."""

    rank: int
    size: int
    device: torch.device = torch.device("cpu")

    @property
    def is_leader(self) -> bool:
        """Rank 0 samples; the others take its tokens."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place."""
        dist.all_reduce(x)
        return x

    def smallest(self, value: int) -> int:
        """The smallest of the ranks' values, on every rank."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def broadcast_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's tokens on every rank (the others pass a placeholder of the same length)."""
        t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        dist.broadcast(t, src=0)
        return t.tolist()


class RowParallelLinear(Linear):
    """A Linear over this rank's slice of the input features, summed over the group."""

    def __init__(self, weight: Weight, tp: TensorParallel) -> None:
        super().__init__(weight)
        self.tp = tp

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                 extra: Callable[[torch.Tensor, torch.Tensor], None] | None = None
                 ) -> torch.Tensor:
        """The group's sum of x @ W.T, plus `residual`; `extra(x, out)` adds this rank's
        share of something more to its partial output before the sum (a LoRA adapter's)."""
        out = super().__call__(x)
        if extra is not None:
            extra(x, out)
        out = self.tp.all_reduce(out)
        return out if residual is None else residual + out


def row_parallel(weight: Weight, tp: TensorParallel | None) -> Linear:
    """A plain Linear without tensor parallelism, else its row-parallel form."""
    return Linear(weight) if tp is None else RowParallelLinear(weight, tp)


def init_tensor_parallel(
    init_addr: str, rank: int, size: int, device: torch.device | None = None
) -> TensorParallel:
    """Join the group (blocks until every rank has joined): gloo on CPU, NCCL on CUDA."""
    device = device or torch.device("cpu")
    if not 0 <= rank < size:
        raise ValueError(f"tp_rank must be in [0, {size}), got {rank}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=init_addr, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT
    )
    return TensorParallel(rank, size, device)


def destroy_tensor_parallel() -> None:
    """Leave the group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless heads, KV heads and the MLP widths (the experts' too) split
    evenly over `size`, and the model has no linear-attention layer, o_proj or expert biases,
    attention sinks or shared experts (none split yet)."""
    if config.is_hybrid:
        raise ValueError(f"{config.architecture}: a hybrid linear-attention model is not split "
                         "over tensor-parallel ranks")
    if (config.o_proj_bias or config.attention_sinks or config.expert_bias
            or config.shared_expert_intermediate_size):
        raise ValueError(f"{config.architecture}: a model with biases on o_proj or its experts, "
                         "attention sinks or shared experts is not split over tensor-parallel "
                         "ranks")
    names = ("num_heads", "num_kv_heads", "intermediate_size") + (
        ("moe_intermediate_size",) if config.is_moe else ()
    )
    for name in names:
        value = getattr(config, name)
        if value % size:
            experts = (f" and expert intermediate size {config.moe_intermediate_size}"
                       if config.is_moe else "")
            raise ValueError(
                f"tensor parallel size {size} does not divide the model's {name} ({value}); "
                f"it must divide {config.num_heads} heads, {config.num_kv_heads} KV heads, "
                f"intermediate size {config.intermediate_size}{experts}"
            )


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's share of the model."""
    check_divisible(config, size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=config.num_kv_heads // size,
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
    )


def shard_weights(config: ModelConfig, weights: dict[str, Weight], rank: int, size: int) -> None:
    """Replace each split weight in `weights` by this rank's slice, in place, so the full
    tensors are freed one by one."""
    check_divisible(config, size)
    for name in list(weights):
        dim = _split_dim(name)
        if dim is None:
            continue
        full = weights[name]
        part = full.shape[dim] // size
        shard = full.narrow(dim, rank * part, part)
        weights[name] = shard.clone() if isinstance(shard, torch.Tensor) else shard


def _split_dim(name: str) -> int | None:
    """The dimension a parameter is split along, or None when it is replicated."""
    parts = name.split(".")
    if len(parts) < 2:
        return None
    proj, kind = parts[-2], parts[-1]
    if proj in ROW_SPLIT and kind in ("weight", "bias"):
        return 0
    if proj in COLUMN_SPLIT and kind == "weight":
        return 1
    return None
