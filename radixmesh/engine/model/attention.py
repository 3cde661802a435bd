"""The attention-backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixmesh.engine.model.kv_pool import KVPool


@dataclass(frozen=True)
class SeqSpan:
    """One request's share of a step: its new query tokens and the KV they attend to."""

    q_start: int  # first row of this request's tokens in the step's token dimension
    q_len: int  # new tokens (1 for a decode step)
    kv_slots: torch.Tensor  # slots of every token it attends to: cached prefix + new tokens


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's new K/V go and what each request attends to."""

    out_slots: torch.Tensor  # [T] slot of each new token
    seqs: tuple[SeqSpan, ...]


class AttentionRun(NamedTuple):
    """Attention of `count` consecutive tokens from row `first` on: token i reads row i of
    `index` (rows `width` apart; 0: every token shares row 0) up to lens[i] slots."""

    first: int
    count: int
    index: torch.Tensor
    width: int
    lens: torch.Tensor


@dataclass(frozen=True)
class NativePlan:
    """A step as the native decoder layer takes it (kernels/native_layer.py)."""

    out_slots: torch.Tensor  # [T] where each token's K/V go
    runs: tuple[AttentionRun, ...]  # covering every token once
    scale: float


class AttentionBackend(ABC):
    """Stores new K/V into the pool and computes attention for a step's tokens."""

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute what every layer of this step shares."""

    @abstractmethod
    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq, D]."""

    def native_plan(self) -> NativePlan | None:
        """The prepared step as a NativePlan where this backend lets the model run whole
        layers natively (kernels/cpu/layer.cpp); else None."""
        return None
