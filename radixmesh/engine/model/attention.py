"""The attention-backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from radixmesh.engine.model.kv_pool import KVPool


@dataclass(frozen=True)
class SeqSpan:
    """One sequence of a step spelled out: its new query tokens and the KV they attend to."""

    q_start: int  # first row of this request's tokens in the step's token dimension
    q_len: int  # new tokens (1 for a decode step)
    kv_slots: torch.Tensor  # slots of every token it attends to: cached prefix + new tokens


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's new K/V go and what each of its sequences attends to.

    Sequence b (a request's new tokens, or one draft node) is q_lens[b] consecutive tokens
    of the step from row q_starts[b] on; it attends to the first kv_lens[b] slots of row b of
    kv_index: its cached keys, then its own new ones, causally. The runner gathers kv_index
    from its request table; the per-sequence tensors stay on the host."""

    out_slots: torch.Tensor  # [T] slot of each new token, on the device
    q_starts: torch.Tensor  # [B] int64
    q_lens: torch.Tensor  # [B] int64
    kv_lens: torch.Tensor  # [B] int64
    kv_index: torch.Tensor  # [B, W] int32 slots, W >= every kv_len, on the device
    # Every sequence is one decoding token, sequence b at row b, and W is the longest
    # kv_len: what a plain decode step (or a CUDA graph) runs, read without checks.
    decode_only: bool = False
    device_kv_lens: torch.Tensor | None = None  # kv_lens already on the device, if at hand

    @classmethod
    def decodes(
        cls, out_slots: torch.Tensor, kv_lens: torch.Tensor, kv_index: torch.Tensor,
        device_kv_lens: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """A step of one-token decodes, in row order (kv_index exactly as wide as the
        longest of kv_lens)."""
        n = kv_lens.numel()
        rows = _DECODE_ROWS.get(n)
        if rows is None:
            rows = _DECODE_ROWS[n] = (torch.arange(n), torch.ones(n, dtype=torch.long))
        return cls(out_slots, *rows, kv_lens, kv_index, decode_only=True,
                   device_kv_lens=device_kv_lens)

    def lens_on(self, device: torch.device) -> torch.Tensor:
        """kv_lens on `device`."""
        lens = self.device_kv_lens
        return lens if lens is not None and lens.device == device else self.kv_lens.to(device)

    @classmethod
    def from_spans(cls, out_slots: torch.Tensor, spans: Sequence[SeqSpan]) -> AttentionMetadata:
        """The metadata of sequences given one by one."""
        lens = torch.tensor([s.kv_slots.numel() for s in spans], dtype=torch.long)
        return cls(
            out_slots,
            torch.tensor([s.q_start for s in spans], dtype=torch.long),
            torch.tensor([s.q_len for s in spans], dtype=torch.long),
            lens,
            padded_rows([s.kv_slots for s in spans], out_slots.device),
        )

    @property
    def num_seqs(self) -> int:
        return self.q_lens.numel()

    def kv_slots(self, seq: int) -> torch.Tensor:
        """Every slot sequence `seq` attends to, as int64."""
        return self.kv_index[seq, : int(self.kv_lens[seq])].long()

    def spans(self) -> list[SeqSpan]:
        """The sequences spelled out one by one (from_spans' input)."""
        return [SeqSpan(int(self.q_starts[b]), int(self.q_lens[b]), self.kv_slots(b))
                for b in range(self.num_seqs)]


# A decode step's q_starts and q_lens by batch size (never written).
_DECODE_ROWS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def padded_rows(rows: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Slot lists as one int32 [len(rows), longest] tensor on `device`, zero padded."""
    width = max((r.numel() for r in rows), default=0)
    table = torch.zeros(len(rows), max(width, 1), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : r.numel()] = r
    return table.to(device)


def in_order(rows: torch.Tensor, first: int = 0) -> bool:
    """Whether token rows are first, first + 1, ... in turn."""
    n = rows.numel()
    return n == 0 or (int(rows[0]) == first and int(rows[-1]) == first + n - 1
                      and bool((rows.diff() == 1).all()))


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
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq, D].
        `sinks` [Hq] (float32): a logit per query head that joins each softmax's
        denominator and weighs no value (gpt-oss); None: none."""

    def native_plan(self) -> NativePlan | None:
        """The prepared step as a NativePlan where this backend lets the model run whole
        layers natively (kernels/cpu/layer.cpp); else None."""
        return None
