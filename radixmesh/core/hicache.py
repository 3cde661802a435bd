"""The host (L2) KV tier's contract: what the scheduler, the worker and cachectl agree on.

cachectl owns one shared-memory segment per engine; the worker on the same host maps it
and copies pages between it and its device KV pool; the scheduler decides what goes where
and allocates the segment's slots (it already owns every other slot decision). A host slot
holds one token's K and V of every layer and every KV head; a tensor-parallel rank copies
its own heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

LAYOUTS = ("layer_first", "page_first")
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class KVGeometry:
    """The shape of one token's KV across the whole model (every rank's heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPE_BYTES
    page_size: int = 1

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K and V over every layer and head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class HostPoolSpec:
    """Where an engine's host pool lives and how its bytes are laid out.

    layer_first: [num_layers, 2 (K, V), num_slots, num_kv_heads, head_dim], so one layer's
    slots are contiguous; page_first: [num_pages, num_layers, 2, page_size, num_kv_heads,
    head_dim], so one page of every layer is contiguous (what a storage tier moves)."""

    name: str  # the shared-memory segment's name (under /dev/shm on Linux)
    path: str  # the segment file's full path, which the worker maps
    num_slots: int  # tokens; a multiple of the page size
    layout: str  # one of LAYOUTS
    geometry: KVGeometry

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.geometry.token_bytes

    def shape(self) -> tuple[int, ...]:
        """The segment as an array of dtype elements, per the layout."""
        g = self.geometry
        if self.layout == "layer_first":
            return (g.num_layers, 2, self.num_slots, g.num_kv_heads, g.head_dim)
        pages = self.num_slots // g.page_size
        return (pages, g.num_layers, 2, g.page_size, g.num_kv_heads, g.head_dim)


def host_pool_slots(
    device_slots: int, geometry: KVGeometry, ratio: float, size_gb: float
) -> int:
    """Host slots for a device pool of `device_slots`: `size_gb` GB when set (> 0), else
    `ratio` times the device pool; rounded down to whole pages."""
    if size_gb > 0:
        slots = int(size_gb * 1e9) // geometry.token_bytes
    else:
        slots = int(device_slots * ratio)
    return slots - slots % geometry.page_size


class HostTierClient(Protocol):
    """The scheduler's handle on the owner of its engine's host tier: cachectl over gRPC,
    or in process. Both raise ValueError for a request the pool cannot satisfy (a bug), and
    an OSError when the tier cannot be had or is lost (the gRPC client's is a
    ConnectionError): the scheduler then carries on without the host tier."""

    async def open(
        self, engine_id: str, geometry: KVGeometry, num_slots: int, layout: str
    ) -> HostPoolSpec:
        """A fresh segment for the engine, replacing the one it had; no slot in use."""

    async def record(self, slots: list[int]) -> None:
        """Host slots the scheduler now holds."""

    async def forget(self, slots: list[int]) -> None:
        """Host slots the scheduler no longer holds."""

    async def close(self) -> None:
        """Let go of the host tier."""
