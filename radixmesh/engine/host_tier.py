"""The scheduler's side of the host (L2) KV tier: its slots, the write policy, and the
device<->host copies each step carries to the worker.

Write policies: write_through backs up every prefix as soon as the tree caches it;
write_through_selective once `threshold` admissions have hit it; write_back only when
device eviction would drop it, keeping its device slots until the backup is done. A hit
in the host tier is loaded back into fresh device slots in the step that admits the
request (the worker copies loads before it computes)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from radixmesh.core.step import KVCopy
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.tree_node import TreeNode


class _TrackedAllocator(KVAllocator):
    """Host slots, noting every change in order: the tier's owner (cachectl) is told which
    slots the scheduler holds. Slots being read (busy: on their way to storage) are freed
    only once the read is done."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        super().__init__(num_slots, page_size)
        self.changes: list[tuple[bool, list[int]]] = []  # (taken, slots)
        self.busy: Counter[int] = Counter()  # slot -> reads still running
        self.deferred: set[int] = set()  # freed while busy

    def hold(self, slots: Iterable[int]) -> None:
        """A read of these slots started."""
        self.busy.update(slots)

    def release(self, slots: Iterable[int]) -> None:
        """A read of these slots is done: those freed meanwhile are free now."""
        done = []
        for slot in slots:
            self.busy[slot] -= 1
            if self.busy[slot] == 0:
                del self.busy[slot]
                if slot in self.deferred:
                    self.deferred.discard(slot)
                    done.append(slot)
        self.free(done)

    def alloc(self, num_slots: int) -> list[int] | None:
        slots = super().alloc(num_slots)
        if slots:
            self.changes.append((True, slots))
        return slots

    def free(self, slots: Collection[int]) -> None:
        freed = []
        for slot in slots:
            if slot in self.busy:
                self.deferred.add(slot)
            else:
                freed.append(slot)
        super().free(freed)
        if freed:
            self.changes.append((False, freed))


@dataclass
class HostStats:
    """Cumulative counts of what the host tier moved."""

    backups: int = 0  # device -> host copies started
    backup_tokens: int = 0
    loads: int = 0  # host -> device copies
    load_tokens: int = 0
    backups_skipped: int = 0  # wanted, but the host tier had no room


class HostTier:
    """One engine's host tier: `num_slots` host slots behind `cache`."""

    def __init__(
        self, cache: RadixCache, num_slots: int, write_policy: str, threshold: int
    ) -> None:
        self.cache = cache
        self.allocator = _TrackedAllocator(num_slots, cache.page_size)
        self.write_policy = write_policy
        self.threshold = threshold
        self.stats = HostStats()
        self._copies: list[KVCopy] = []
        self._ids = itertools.count(1)
        cache.attach_host(self.allocator)

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    def take_copies(self) -> list[KVCopy]:
        """The copies to send with the next step."""
        copies, self._copies = self._copies, []
        return copies

    def has_copies(self) -> bool:
        return bool(self._copies)

    def take_changes(self) -> list[tuple[bool, list[int]]]:
        """Host slots taken (True) and freed (False) since the last call, in order."""
        changes, self.allocator.changes = self.allocator.changes, []
        return changes

    def done(self, copy_ids: Sequence[int]) -> list[TreeNode]:
        """Backups the worker (every rank) finished; returns the nodes now backed up."""
        return [node for copy_id in copy_ids for node in self.cache.finish_backup(copy_id)]

    # ---- what the policies decide ------------------------------------------------------

    def cached(self, node: TreeNode) -> None:
        """The tree just cached the device prefix ending at node."""
        if self.write_policy == "write_through":
            self._back_up_path(node)

    def admitted(self, node: TreeNode) -> None:
        """An admission hit the device prefix ending at node (hit counts already updated)."""
        if self.write_policy != "write_through_selective":
            return
        while node.parent is not None:
            if node.hit_count >= self.threshold:
                self._back_up(node)
            node = node.parent

    def keep_on_evict(self, node: TreeNode) -> bool:
        """Device eviction is about to drop node: under write_back, back it up instead."""
        return self.write_policy == "write_back" and self._back_up(node)

    def load(self, nodes: Sequence[TreeNode], device_slots: list[int]) -> None:
        """Host-only nodes go back to the device, into these fresh slots."""
        host_slots = [s for n in nodes for s in n.host_slots or ()]
        self.cache.load_host(nodes, device_slots)
        self._copies.append(KVCopy(next(self._ids), False, device_slots, host_slots))
        self.stats.loads += 1
        self.stats.load_tokens += len(device_slots)

    # ---- internals -------------------------------------------------------------------------

    def _back_up_path(self, node: TreeNode) -> None:
        while node.parent is not None and node.host_slots is None:
            if not self._back_up(node):
                return
            node = node.parent

    def _back_up(self, node: TreeNode) -> bool:
        """Start copying node's device KV to fresh host slots; False without room."""
        if node.host_slots is not None or node.slots is None:
            return node.host_slots is not None
        n = len(node.key)
        slots = self.allocator.alloc(n)
        if slots is None:
            self.cache.evict_host(n - self.allocator.available())
            slots = self.allocator.alloc(n)
        if slots is None:
            self.stats.backups_skipped += 1
            return False
        copy_id = next(self._ids)
        self._copies.append(KVCopy(copy_id, True, list(node.slots), slots))
        self.cache.start_backup(node, slots, copy_id)
        self.stats.backups += 1
        self.stats.backup_tokens += n
        return True
