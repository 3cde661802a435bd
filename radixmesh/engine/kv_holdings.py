"""What requests hold in the device KV pool: their own slots, the cached prefix each keeps
locked in the radix tree, and how slots come back (to the tree, or free). The scheduler,
its decodes and its KV transfers take and give back slots only through here. A hybrid
linear-attention model's holdings add snapshots of its state (state_snapshots.py): here
their hooks do nothing."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from radixmesh.core.step import StateSave
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.tiering import NoTiers
from radixmesh.engine.tree_node import TreeNode

if TYPE_CHECKING:
    from radixmesh.engine.scheduler import ScheduledBatch


class KVHoldings:
    """Requests' slots and prefix locks over one pool and its radix tree.

    A request's `slots` cover its tokens [0, len(slots)): the first `cached_len` belong to
    the tree, locked for it at `locked[rid]`, the rest to the request (its last page may be
    partial), plus `orphans` it computed for tokens another request cached first."""

    def __init__(self, allocator: KVAllocator, cache: RadixCache, page: int) -> None:
        self.allocator = allocator
        self.cache = cache
        self.page = page
        self.locked: dict[str, TreeNode] = {}  # rid -> the last node of its cached prefix
        self.tiers: NoTiers = NoTiers()  # the host and storage tiers, while attached

    def alloc(self, num_slots: int) -> list[int] | None:
        """Fresh device slots of whole pages, evicting cached prefixes if needed."""
        fresh = self.allocator.alloc(num_slots)
        if fresh is None:
            self.cache.evict(num_slots - self.allocator.available(), self.tiers.keep_on_evict)
            fresh = self.allocator.alloc(num_slots)
        return fresh

    def grow(self, req: Req, n: int) -> list[int] | None:
        """Give a request n more slots, filling its partial last page first; None if full."""
        have = len(req.slots)
        room = (-have) % self.page if have > req.cached_len else 0
        take = min(n, room)
        new = [req.slots[-1] + 1 + i for i in range(take)]
        rest = n - take
        if rest:
            fresh = self.alloc(-(-rest // self.page) * self.page)
            if fresh is None:
                return None
            new.extend(fresh[:rest])
        req.slots.extend(new)
        return new

    def hold(self, req: Req, slots: list[int], cached: int, node: TreeNode) -> None:
        """`req` holds `slots`, the first `cached` of them the tree's, locked at `node`
        (which the caller locked)."""
        req.slots, req.cached_len, self.locked[req.rid] = slots, cached, node

    def unhold(self, req: Req) -> None:
        """Undo `hold` before any slot of the request's own was written: its own slots
        free, its lock off."""
        own = req.slots[req.cached_len :]
        if own:
            self.allocator.free(own)
        self.unlock(req.rid)
        req.slots, req.cached_len = [], 0

    def unlock(self, rid: str) -> None:
        """Take the lock off the request's cached prefix, if it holds one."""
        locked = self.locked.pop(rid, None)
        if locked is not None:
            self.cache.unlock(locked)

    def cache_progress(self, req: Req, fed: int) -> None:
        """Publish a request's page-aligned progress in the tree so others can share it,
        once the step being built feeds `fed` more of its tokens (a prompt chunk).

        The worker runs batches in order and writes every new K/V of a step before any
        attention reads the pool, so slots scheduled now are safe to match from now on."""
        aligned = len(req.slots) - len(req.slots) % self.page
        if aligned <= req.cached_len:
            return
        tokens = req.tokens[:aligned]
        cached = self.cache.insert(tokens, req.slots[:aligned], req.namespace, req.priority)
        # Another request cached part of this continuation first: the tree keeps its copy
        # and ours stays private to this request until it finishes.
        req.orphans.extend(req.slots[req.cached_len : cached])
        match = self.cache.match_prefix(tokens, req.namespace, count_hit=False, whole=True)
        self.tiers.cached(match.node)
        self.cache.lock(match.node)
        self.unlock(req.rid)
        self.locked[req.rid], req.cached_len = match.node, aligned

    def release(self, req: Req) -> None:
        """Hand a request's computed tokens to the tree and free the slots the tree declines."""
        # Slots past the tokens are a verify's still in flight: none of them is kept.
        n = min(len(req.slots), req.num_tokens)
        aligned = n - n % self.page
        tokens = req.tokens[:aligned]
        cached = self.cache.insert(tokens, req.slots[:aligned], req.namespace, req.priority)
        self.allocator.free(req.slots[req.cached_len : cached] + req.slots[aligned:] + req.orphans)
        if aligned:
            self.tiers.cached_prefix(tokens, req.namespace)
        self.unlock(req.rid)
        req.slots, req.cached_len, req.orphans = [], 0, []

    def decoded(self, batch: ScheduledBatch) -> None:
        """The step being built has its decodes (and nothing else yet)."""

    def snapshot_of(self, node: TreeNode) -> int:
        """The snapshot slot of the state at node's end a request admitted there starts
        from; -1: none (a zero state, or a model without linear layers)."""
        return -1

    def take_saves(self) -> list[StateSave]:
        """The state snapshots the step just built takes."""
        return []

    def snapshot_stats(self) -> dict[str, int]:
        """The snapshot slots' part of /server_info."""
        return {}

    def trim(self, req: Req, keep: int) -> None:
        """Give back a request's slots past its first `keep` (a rejected draft's): the
        pages wholly past them free, the rest of the last page kept for its next tokens."""
        whole = -(-keep // self.page) * self.page  # the first slot past keep's page
        if whole < len(req.slots):
            self.allocator.free(req.slots[whole:])
        del req.slots[keep:]

    def held_slots(self, requests: Iterable[Req]) -> int:
        """Slots owned by these requests (not the tree, not free)."""
        held = 0
        for req in requests:
            own = req.slots[req.cached_len :]
            held += len({s // self.page for s in own}) * self.page + len(req.orphans)
        return held

    def check_invariants(self, requests: Collection[Req], running: Iterable[Req],
                         num_slots: int) -> None:
        """free + cached + held == pool; evictable + protected == cached; tree consistent;
        no running request keeps a slot past its tokens once its steps are back."""
        self.cache.check_invariants()
        for req in running:
            assert req.pending or len(req.slots) <= req.num_tokens, (
                f"{req.rid} holds {len(req.slots)} slots for {req.num_tokens} tokens"
            )
        free, cached, held = (self.allocator.available(), self.cache.total_size(),
                              self.held_slots(requests))
        assert free + cached + held == num_slots, (
            f"slot leak: free {free} + cached {cached} + held {held} != pool {num_slots}"
        )
