"""A hybrid linear-attention model's radix cache: snapshots of the linear layers' state.

The state after token N sums up every token before it, so a cached prefix's KV alone
cannot resume a request: the linear layers need their state at the prefix's end. The
worker keeps snapshot slots beside its running rows' state (model/state_pool.py); the
scheduler decides what they hold. A tree node may hold one, the state at its end
(StateSnapshots, the tree's payload): a match is cut back to the deepest node that holds
one, a request admitted there starts from it, and a node's snapshot leaves with its KV,
leaf first, in the eviction policy's order, when the KV pool or the snapshot slots run
short. A request's lock protects the snapshots above it.

Snapshots are taken where they pay (SnapshotHoldings), each saving the state exactly at a
node's end (page-aligned, like every node):
- in a prompt chunk, at its last page boundary, but for the prompt's last chunk at the last
  one before the prompt's last token, which a request with the same prompt computes itself
  (its logits are needed), so that it can start from there;
- when a request finishes or is retracted, at the end of the tokens it hands to the tree,
  so that the next turn of a chat (its prompt this one's prompt and answer, then more)
  starts after the answer. The worker's state then covers every token scheduled for it
  (with overlap, the decode of the last token may have been scheduled before the finish
  was known: then that token too, as the tree's node does); a snapshot is taken only where
  that is exactly what the node covers. With page_size 1 it is the worker's state as the
  request is released; with larger pages a decoding request keeps a snapshot slot of its
  own, refreshed at each page boundary it crosses, which its last node takes.

A snapshot saved by a step's forward is matched from the next step on (a request admitted
in the same step starts before that forward runs)."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

from radixmesh.core.step import StateSave
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.kv_holdings import KVHoldings
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.tree_node import MatchResult, TreeNode
from radixmesh.engine.tree_payload import NodePayload

if TYPE_CHECKING:
    from radixmesh.engine.scheduler import ScheduledBatch


class StateSnapshots(NodePayload):
    """The worker's `num_slots` snapshot slots as the tree holds them: a node -> the slot
    with the state at its end. Slots not in the tree are free or taken by the holdings."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # taken from the end: lowest first
        self._held: dict[TreeNode, int] = {}
        self._fresh: set[int] = set()  # slots the forward of the step being built writes

    def cut(self, match: MatchResult) -> MatchResult:
        node = match.node
        while node.parent is not None and not self._usable(node):
            node = node.parent
        if node is match.node:
            return match
        return MatchResult(match.slots[: node.depth + len(node.key)], node)

    def dropped(self, node: TreeNode) -> None:
        slot = self._held.pop(node, None)
        if slot is not None:
            self._free.append(slot)

    def has_room(self) -> bool:
        """Whether a slot is free."""
        return bool(self._free)

    def take(self) -> int:
        """A free slot, or -1."""
        return self._free.pop() if self._free else -1

    def give(self, slot: int) -> None:
        """A slot taken and not given to a node is free again."""
        self._free.append(slot)

    def attach(self, node: TreeNode, slot: int, fresh: bool = False) -> None:
        """node holds the state at its end in `slot` (which the step being built writes in
        its forward, when `fresh`)."""
        assert node not in self._held and node.slots is not None
        self._held[node] = slot
        if fresh:
            self._fresh.add(slot)

    def slot_of(self, node: TreeNode) -> int:
        """The slot holding the state at node's end, or -1."""
        return self._held.get(node, -1)

    def step_built(self) -> None:
        """The step being built is on its way: what its forward saves may be matched."""
        self._fresh.clear()

    def _usable(self, node: TreeNode) -> bool:
        slot = self._held.get(node, -1)
        return slot >= 0 and slot not in self._fresh

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        return len(self._held)

    def check(self, nodes: Collection[TreeNode]) -> None:
        walked = set(nodes)
        for node, slot in self._held.items():
            _require(node in walked and node.slots is not None,
                     f"snapshot slot {slot} held by {node}, which is not on the device")
        slots = [*self._held.values(), *self._free]
        _require(len(set(slots)) == len(slots), "a snapshot slot is held twice")
        _require(all(0 <= s < self.num_slots for s in slots), "a snapshot slot out of range")


class SnapshotHoldings(KVHoldings):
    """KVHoldings that also take snapshots of a hybrid model's state for the tree, and the
    snapshot slot a decoding request keeps with page_size > 1 (`rolling`)."""

    def __init__(self, allocator: KVAllocator, cache: RadixCache, page: int,
                 snapshots: StateSnapshots) -> None:
        super().__init__(allocator, cache, page)
        self.snapshots = snapshots
        # rid -> its own slot and the tokens whose state the slot holds (once its step runs).
        self.rolling: dict[str, tuple[int, int]] = {}
        self._saves: list[StateSave] = []

    def snapshot_of(self, node: TreeNode) -> int:
        return self.snapshots.slot_of(node)

    def take_saves(self) -> list[StateSave]:
        saves, self._saves = self._saves, []
        self.snapshots.step_built()
        return saves

    def cache_progress(self, req: Req, fed: int) -> None:
        super().cache_progress(req, fed)
        end = len(req.slots)
        start = end - fed
        target = self._aligned(min(end, req.num_tokens - 1))
        if target > start:
            node = self._node_at(req, target)  # its lock protects it as slots are taken
            if self.snapshots.slot_of(node) < 0:
                slot = self.take_slot()
                if slot >= 0:
                    self.snapshots.attach(node, slot, fresh=True)
                    self._saves.append(StateSave(req.row, target - start, slot))
        if self.page > 1 and end == req.num_tokens:  # the prompt's last chunk
            self._roll(req, start, target)

    def decoded(self, batch: ScheduledBatch) -> None:
        if self.page == 1:
            return  # the state as a request is released is the state at its last node
        for req in batch.decodes:
            self._roll(req, len(req.slots) - 1)
        for req, entry in zip(batch.reqs, batch.batch.entries, strict=True):
            self._roll(req, len(req.slots) - len(entry.slots))

    def release(self, req: Req) -> None:
        fed = len(req.slots)
        n = min(fed, req.num_tokens)
        aligned = n - n % self.page
        rolling = self.rolling.pop(req.rid, None)
        slot, save = -1, False
        if rolling is not None and rolling[1] == aligned:
            (slot, _), rolling = rolling, None
        elif aligned and fed == aligned and req.on_worker and not self._held_at(req, aligned):
            # Taken before the tokens go to the tree, where making room could evict them.
            slot = self.take_slot()
            save = True
        if rolling is not None:
            self.snapshots.give(rolling[0])
        tokens = req.tokens[:aligned]
        super().release(req)
        if slot < 0:
            return
        node = self.cache.match_prefix(tokens, req.namespace, count_hit=False, whole=True).node
        if self.snapshots.slot_of(node) >= 0:
            self.snapshots.give(slot)
            return
        self.snapshots.attach(node, slot)
        if save:
            self._saves.append(StateSave(req.row, 0, slot))

    def snapshot_stats(self) -> dict[str, int]:
        s = self.snapshots
        return {"num_snapshots": s.num_slots, "free_snapshots": s.free,
                "cached_snapshots": s.cached}

    def check_invariants(self, requests: Collection[Req], running: Iterable[Req],
                         num_slots: int) -> None:
        """KVHoldings' invariants, and free + cached + requests' own == snapshot slots."""
        super().check_invariants(requests, running, num_slots)
        s = self.snapshots
        _require(s.free + s.cached + len(self.rolling) == s.num_slots,
                 f"snapshot leak: free {s.free} + cached {s.cached} + requests' "
                 f"{len(self.rolling)} != {s.num_slots}")

    def _roll(self, req: Req, start: int, skip: int = 0) -> None:
        """The step being built feeds the request's tokens [start, len(slots)): its own slot
        takes the state at the last page boundary they cross (unless `skip`, which a node
        takes)."""
        top = self._aligned(len(req.slots))
        if top <= start or top == skip:
            return
        held = self.rolling.get(req.rid)
        slot = self.take_slot() if held is None else held[0]
        if slot < 0:
            return
        self.rolling[req.rid] = (slot, top)
        self._saves.append(StateSave(req.row, top - start, slot))

    def take_slot(self) -> int:
        """A free snapshot slot, or -1 when every one is held: cached ones are evicted for
        it, one unlocked leaf at a time in the eviction policy's order, KV and snapshot."""
        while not self.snapshots.has_room() and self.cache.evict(1):
            pass
        return self.snapshots.take()

    def _held_at(self, req: Req, n: int) -> bool:
        """Whether a node ending after the request's first n tokens holds a snapshot."""
        node = self.cache.match_prefix(req.tokens[:n], req.namespace, count_hit=False,
                                       whole=True).node
        return node.depth + len(node.key) == n and self.snapshots.slot_of(node) >= 0

    def _aligned(self, n: int) -> int:
        return n - n % self.page

    def _node_at(self, req: Req, n: int) -> TreeNode:
        """The node whose edge ends after the request's first n tokens (cached)."""
        node = self.cache.match_prefix(req.tokens[:n], req.namespace, count_hit=False,
                                       whole=True).node
        assert node.depth + len(node.key) == n, f"{req.rid}: no node ends at token {n}"
        return node


def make_holdings(allocator: KVAllocator, config: SchedulerConfig) -> KVHoldings:
    """A scheduler's holdings over its pool and a fresh radix tree: with snapshots of the
    state for a hybrid linear-attention model (SnapshotHoldings)."""
    snapshots = StateSnapshots(config.state_snapshots) if config.hybrid else None
    cache = RadixCache(allocator, config.page_size, config.eviction_policy,
                       protected_ratio=config.slru_protected_ratio, payload=snapshots)
    if snapshots is None:
        return KVHoldings(allocator, cache, config.page_size)
    return SnapshotHoldings(allocator, cache, config.page_size, snapshots)


def _require(condition: bool, message: str) -> None:
    # Not `assert`: the checks must still run under python -O.
    if not condition:
        raise AssertionError(message)
