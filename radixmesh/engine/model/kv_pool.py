"""The worker's KV cache: one K and one V tensor per layer, indexed by slot."""

from __future__ import annotations

import torch

from radixmesh.engine.model.memory import lazy_zeros


class KVPool:
    """K/V storage for `num_slots` tokens; the scheduler decides which slot holds what.

    On the CPU its memory is committed as slots are first written (memory.lazy_zeros): a
    pool sized for a full load costs only what the cache has held. On a GPU it is all
    allocated at once."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        value_dim: int | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.k = [lazy_zeros((num_slots, num_kv_heads, head_dim), dtype, device)
                  for _ in range(num_layers)]
        # value_dim 0: no values kept (latent attention reads them from the keys).
        values = (num_slots, num_kv_heads, head_dim if value_dim is None else value_dim)
        self.v = [lazy_zeros(values, dtype, device) for _ in range(num_layers)]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor | None) -> None:
        """Write new tokens' K/V [T, Hkv, D] into their slots [T] (v None: keys only)."""
        self.k[layer].index_copy_(0, slots, k)
        if v is not None:
            self.v[layer].index_copy_(0, slots, v)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of slots `src` to slots `dst` in every layer (accepted draft tokens
        to the positions they were accepted at)."""
        for k, v in zip(self.k, self.v, strict=True):
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))
