"""Attention from the Triton kernels: the GPU backend (on CPU only under TRITON_INTERPRET=1)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixmesh.engine.model.attention import AttentionBackend, AttentionMetadata, in_order
from radixmesh.engine.model.kv_pool import KVPool
from radixmesh.kernels.decode_attention import decode_attention
from radixmesh.kernels.extend_attention import extend_attention
from radixmesh.kernels.kv_store import store_kv


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
        if meta.decode_only:
            self._decode_rows = self._extend = None
            lens = self._ints(meta.lens_on(self.device))
            self._decode = _DecodePart(self._pages(meta.kv_index, None), lens)
            return
        is_decode = meta.q_lens == 1
        extends = (~is_decode).nonzero().flatten()
        self._decode = self._decode_rows = self._extend = None
        if extends.numel() < meta.num_seqs:
            decodes = is_decode.nonzero().flatten() if extends.numel() else None
            rows = meta.q_starts if decodes is None else meta.q_starts[decodes]
            if decodes is not None or not in_order(rows):
                self._decode_rows = rows.to(self.device)
            self._decode = _DecodePart(
                self._pages(meta.kv_index, decodes), self._ints(meta.kv_lens, decodes)
            )
        if extends.numel():
            q_lens = meta.q_lens[extends]
            self._extend = _ExtendPart(
                self._pages(meta.kv_index, extends),
                self._ints(meta.q_starts, extends),
                self._ints(q_lens),
                self._ints(meta.kv_lens[extends] - q_lens),
                int(q_lens.max()),
            )

    def bind_decode(self, tables: DecodeTables) -> None:
        """Read every following step from `tables` (no prepare): what a CUDA graph replays."""
        self._out_slots = tables.out_slots
        self._decode = _DecodePart(tables.page_table, tables.seq_lens)
        self._decode_rows = self._extend = None

    def write_decode(self, meta: AttentionMetadata, tables: DecodeTables) -> None:
        """Fill `tables` from a decode-only step in row order; rows past its requests become
        padding."""
        n = meta.num_seqs
        pages = self._pages(meta.kv_index, None)
        tables.out_slots[:n].copy_(meta.out_slots)
        tables.out_slots[n:].fill_(-1)
        tables.seq_lens[:n].copy_(meta.lens_on(tables.seq_lens.device))
        tables.seq_lens[n:].zero_()
        tables.page_table[:n, : pages.shape[1]].copy_(pages)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert self._decode is not None or self._extend is not None, "prepare() must run first"
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        store_kv(k, v, k_pool, v_pool, self._out_slots)
        window, softcap = self.windows[layer] if self.windows else 0, self.softcap
        d = self._decode
        if d is not None and self._decode_rows is None:
            return self._decode_attention(q, k_pool, v_pool, d, window, sinks)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if d is not None and self._decode_rows is not None:
            rows = self._decode_rows
            out[rows] = self._decode_attention(q[rows], k_pool, v_pool, d, window, sinks)
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
                sinks=sinks,
            )
        return out

    def _decode_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, d: _DecodePart,
        window: int, sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        return decode_attention(q, k_pool, v_pool, d.page_table, d.seq_lens, self.scale,
                                self.page_size, window=window, softcap=self.softcap,
                                sinks=sinks)

    def _pages(self, index: torch.Tensor, seqs: torch.Tensor | None) -> torch.Tensor:
        """The page-table rows of `seqs` (None: all) from their slot rows: the slots
        themselves with page_size 1, else each page's first slot over page_size (the
        scheduler allocates whole pages, in order)."""
        if seqs is not None:
            index = index.index_select(0, seqs.to(index.device))
        if self.page_size > 1:
            index = index[:, :: self.page_size] // self.page_size
        return self._ints(index)

    def _ints(self, values: torch.Tensor, seqs: torch.Tensor | None = None) -> torch.Tensor:
        if seqs is not None:
            values = values[seqs]
        return values.to(device=self.device, dtype=torch.int32).contiguous()
