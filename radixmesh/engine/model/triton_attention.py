"""Attention from the Triton kernels: the GPU backend (on CPU only under TRITON_INTERPRET=1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixmesh.engine.model.attention import AttentionBackend, AttentionMetadata, SeqSpan
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.kernels.decode_attention import decode_attention
from radixmesh.kernels.extend_attention import extend_attention
from radixmesh.kernels.kv_store import store_kv
from radixmesh.kernels.paging import page_table


@dataclass(frozen=True)
class DecodeTables:
    """What a decode-only step's kernels read; fixed buffers of these back a CUDA graph."""

    out_slots: torch.Tensor  # [B] int32 slot of each new token; -1 on a padding row
    page_table: torch.Tensor  # [B, W] int32 slots (page_size 1) or pages of each request
    seq_lens: torch.Tensor  # [B] int32 tokens each request attends to; 0 on a padding row

    @classmethod
    def empty(cls, batch: int, width: int, device: torch.device) -> DecodeTables:
        """Buffers for up to `batch` requests of up to `width` table entries each."""

        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        return cls(ints(batch) - 1, ints(batch, width), ints(batch))

    def narrow(self, batch: int) -> DecodeTables:
        """The first `batch` rows (views: writes reach the full buffers)."""
        return DecodeTables(self.out_slots[:batch], self.page_table[:batch], self.seq_lens[:batch])


@dataclass(frozen=True)
class _DecodePart:
    page_table: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(frozen=True)
class _ExtendPart:
    page_table: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    prefix_lens: torch.Tensor
    max_q_len: int


class TritonAttention(AttentionBackend):
    """Split-K decode for one-token requests, prefix + causal extend for the rest.

    Requests' slots must come in whole pages when page_size > 1 (see kernels.paging).
    `windows` gives each layer's sliding window (a token sees its last `window` keys, itself
    included; 0 or none given: all), `softcap` caps scores to softcap * tanh(s / softcap)
    (0: not at all)."""

    def __init__(
        self,
        scale: float,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        windows: Sequence[int] = (),
        softcap: float = 0.0,
    ) -> None:
        self.scale = scale
        self.page_size = page_size
        self.device = torch.device(device)
        self.windows = tuple(windows)
        self.softcap = softcap
        self._out_slots = torch.empty(0, dtype=torch.int32)
        self._decode: _DecodePart | None = None
        self._decode_rows: torch.Tensor | None = None  # None: every row of the step decodes
        self._extend: _ExtendPart | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self._out_slots = self._ints(meta.out_slots)
        decodes = [s for s in meta.seqs if s.q_len == 1]
        extends = [s for s in meta.seqs if s.q_len > 1]
        self._decode = self._decode_rows = self._extend = None
        if decodes:
            rows = [s.q_start for s in decodes]
            if extends or rows != list(range(len(rows))):
                self._decode_rows = torch.tensor(rows, device=self.device)
            self._decode = _DecodePart(
                self._table(decodes),
                self._ints(torch.tensor([s.kv_slots.numel() for s in decodes])),
            )
        if extends:
            q_lens = [s.q_len for s in extends]
            self._extend = _ExtendPart(
                self._table(extends),
                self._ints(torch.tensor([s.q_start for s in extends])),
                self._ints(torch.tensor(q_lens)),
                self._ints(torch.tensor([s.kv_slots.numel() - s.q_len for s in extends])),
                max(q_lens),
            )

    def bind_decode(self, tables: DecodeTables) -> None:
        """Read every following step from `tables` (no prepare): what a CUDA graph replays."""
        self._out_slots = tables.out_slots
        self._decode = _DecodePart(tables.page_table, tables.seq_lens)
        self._decode_rows = self._extend = None

    def write_decode(self, meta: AttentionMetadata, tables: DecodeTables) -> None:
        """Fill `tables` from a decode-only step; rows past its requests become padding."""
        assert all(s.q_len == 1 for s in meta.seqs), "only decode steps fit decode tables"
        n = len(meta.seqs)
        table = page_table([s.kv_slots for s in meta.seqs], self.page_size)
        tables.out_slots[:n].copy_(meta.out_slots)
        tables.out_slots[n:].fill_(-1)
        tables.seq_lens[:n].copy_(torch.tensor([s.kv_slots.numel() for s in meta.seqs]))
        tables.seq_lens[n:].zero_()
        tables.page_table[:n, : table.shape[1]].copy_(table)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool
    ) -> torch.Tensor:
        assert self._decode is not None or self._extend is not None, "prepare() must run first"
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        store_kv(k, v, k_pool, v_pool, self._out_slots)
        window, softcap = self.windows[layer] if self.windows else 0, self.softcap
        d = self._decode
        if d is not None and self._decode_rows is None:
            return self._decode_attention(q, k_pool, v_pool, d, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if d is not None and self._decode_rows is not None:
            rows = self._decode_rows
            out[rows] = self._decode_attention(q[rows], k_pool, v_pool, d, window)
        e = self._extend
        if e is not None:
            extend_attention(
                q,
                k,
                v,
                k_pool,
                v_pool,
                e.page_table,
                e.q_starts,
                e.q_lens,
                e.prefix_lens,
                e.max_q_len,
                self.scale,
                self.page_size,
                out=out,
                window=window,
                softcap=softcap,
            )
        return out

    def _decode_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: _DecodePart,
        window: int,
    ) -> torch.Tensor:
        return decode_attention(q, k_pool, v_pool, d.page_table, d.seq_lens, self.scale,
                                self.page_size, window=window, softcap=self.softcap)

    def _table(self, seqs: list[SeqSpan]) -> torch.Tensor:
        return page_table([s.kv_slots for s in seqs], self.page_size).to(self.device)

    def _ints(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(device=self.device, dtype=torch.int32)
