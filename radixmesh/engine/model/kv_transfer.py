"""A prompt's KV as it travels between engines (prefill/decode disaggregation): read out of
one worker's pool as a tensor of whole heads, written into another's slots.

A transfer's tensor is [2 * layers, tokens, heads, head_dim] in the pool's dtype: each
layer's K, then its V, for the model's KV heads [head_start, head_end). Under tensor
parallelism a rank holds heads [rank * h, (rank + 1) * h); a sending rank cuts its heads
into the pieces each receiving rank holds (`head_overlaps`), so the two sides need not have
the same number of ranks.

`KVInbox` is the receiving worker's record of what it accepts: only the slots its scheduler
set aside for a request, under the key it expects, until the scheduler releases the request.
The worker runs the inbox's changes and the writes on the thread that runs its steps, so a
write can never land in a slot the scheduler has handed to another request."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixmesh.core.step import KVExpect
from radixmesh.engine.model.kv_pool import KVPool


def head_overlaps(total: int, ours: int, theirs: int, rank: int) -> list[tuple[int, int, int]]:
    """For a rank `rank` of `ours` ranks holding an even share of `total` KV heads: the
    (their rank, first head, end head) pieces each of `theirs` ranks holds of our heads."""
    mine = total // ours
    lo, hi = rank * mine, (rank + 1) * mine
    size = total // theirs
    out = []
    for other in range(theirs):
        a, b = max(lo, other * size), min(hi, (other + 1) * size)
        if a < b:
            out.append((other, a, b))
    return out


class KVPorter:
    """Reads and writes a pool's KV for transfers; the pool holds heads [first, end) of the
    model's `total_kv_heads` (this rank's share)."""

    def __init__(self, pool: KVPool, total_kv_heads: int, rank: int = 0, ranks: int = 1) -> None:
        self.pool = pool
        self.total_kv_heads = total_kv_heads
        self.rank, self.ranks = rank, ranks
        heads = pool.k[0].shape[1]
        self.heads = (rank * heads, (rank + 1) * heads)
        self.num_layers = len(pool.k)
        self.dtype = pool.k[0].dtype
        self.device = pool.k[0].device

    def read(self, slots: list[int]) -> torch.Tensor:
        """This rank's heads of `slots`: [2 * layers, len(slots), heads, head_dim], on the CPU."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        parts = [t.index_select(0, index) for kv in zip(self.pool.k, self.pool.v, strict=True)
                 for t in kv]
        return torch.stack(parts).cpu()

    def write(self, slots: list[int], head_start: int, data: torch.Tensor) -> None:
        """Write heads [head_start, head_start + data.shape[2]) of `slots` (checked to be
        this rank's by the caller)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        a = head_start - self.heads[0]
        b = a + data.shape[2]
        data = data.to(self.device)
        for layer, (k, v) in enumerate(zip(self.pool.k, self.pool.v, strict=True)):
            k[:, a:b].index_copy_(0, index, data[2 * layer])
            v[:, a:b].index_copy_(0, index, data[2 * layer + 1])

    def piece_bytes(self, slots: int, heads: int) -> int:
        """Bytes of `heads` KV heads of `slots` tokens over every layer, in this pool's dtype."""
        head = self.pool.k[0]
        return 2 * self.num_layers * slots * heads * head.shape[2] * head.itemsize

    def check(self, slots: int, head_start: int, head_end: int, num_layers: int, dtype: str,
              nbytes: int) -> str:
        """Why a piece of this shape cannot be written here ("" when it can)."""
        if num_layers != self.num_layers or getattr(torch, dtype, None) != self.dtype:
            return (f"KV of {num_layers} layers in {dtype} does not fit this pool "
                    f"({self.num_layers} layers of {self.dtype})")
        if not self.heads[0] <= head_start < head_end <= self.heads[1]:
            return f"heads [{head_start}, {head_end}) are not this rank's {list(self.heads)}"
        want = self.piece_bytes(slots, head_end - head_start)
        if nbytes != want:
            return f"a piece of {slots} tokens holds {nbytes} bytes, not {want}"
        return ""


@dataclass
class _Expected:
    slots: set[int]
    key: str
    received: int = 0  # bytes written so far


class KVInbox:
    """The KV a decode worker accepts, by request (see the module's docstring)."""

    def __init__(self) -> None:
        self._expected: dict[str, _Expected] = {}

    def expect(self, expect: KVExpect) -> None:
        self._expected[expect.rid] = _Expected(set(expect.slots), expect.key)

    def release(self, rid: str) -> None:
        self._expected.pop(rid, None)

    def clear(self) -> None:
        self._expected.clear()

    def admit(self, rid: str, key: str, slots: list[int], nbytes: int) -> str:
        """Why KV for `rid` into `slots` under `key` is refused ("" when it is accepted and
        counted)."""
        expected = self._expected.get(rid)
        if expected is None:
            return f"this worker expects no KV for request {rid!r} (released or never set aside)"
        if key != expected.key:
            return f"request {rid!r}: KV for other tokens (key {key}, expected {expected.key})"
        if not expected.slots.issuperset(slots):
            return f"request {rid!r}: slots outside those set aside for it"
        expected.received += nbytes
        return ""

    def __len__(self) -> int:
        return len(self._expected)
