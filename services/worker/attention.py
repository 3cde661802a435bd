"""The attention-backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from radixmesh.services.worker.kv_pool import KVPool


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


@dataclass(frozen=True)
class DecodePlan:
    """A decode-only step as the native decoder layer takes it: token b is request b."""

    out_slots: torch.Tensor  # [B] where each token's K/V go
    index: torch.Tensor  # [B, W] each request's slots, the new token's included
    lens: torch.Tensor  # [B] live entries of each index row
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

    def decode_plan(self) -> DecodePlan | None:
        """The prepared step as a DecodePlan, where this backend lets the model run whole
        layers natively (cpu/layer.cpp) and the step is decode-only; else None."""
        return None
