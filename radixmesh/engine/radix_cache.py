"""Radix tree over token ids that maps cached prefixes to their KV slots, on the device
and, with the host tier, in host memory.

A node's tokens may be on the device (`slots`), in the host tier (`host_slots`) or both.
Device-resident nodes form a subtree around each root: a match reads the device part of a
prefix first, then may continue into host-only nodes, whose children are host-only too."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator, Sequence

from radixmesh.engine.eviction import DEFAULT_PROTECTED_RATIO, eviction_policy
from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_invariants import Books, check_tree
from radixmesh.engine.tree_node import ChildKey, MatchResult, TreeNode, child_key
from radixmesh.engine.tree_payload import NodePayload


class RadixCache:
    """Prefix cache of KV slots, one radix tree per namespace, with locking and eviction.

    `host` is the host tier's slot allocator while the tier is attached (attach_host);
    `protected_ratio`: the share of the pool the slru policy's protected segment may hold;
    `payload`: what nodes hold beside their KV, plugged in (tree_payload.py; none default)."""

    def __init__(
        self,
        allocator: KVAllocator,
        page_size: int = 1,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
        protected_ratio: float = DEFAULT_PROTECTED_RATIO,
        payload: NodePayload | None = None,
    ) -> None:
        if page_size != allocator.page_size:
            # Evicting frees whole allocator pages, so tree pages and pool pages must coincide.
            raise ValueError(
                f"page_size {page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.host: KVAllocator | None = None
        self.page_size = page_size
        self.policy = policy
        self.payload = NodePayload() if payload is None else payload
        self._eviction = eviction_policy(policy, allocator.num_slots, protected_ratio)
        self._clock = clock
        self._roots: dict[str | None, TreeNode] = {}
        # Unlocked device nodes with no device child and no backup running: what device
        # eviction may take. A dict as an insertion-ordered set for stable ties.
        self._evictable_leaves: dict[TreeNode, None] = {}
        self._evictable = 0
        self._protected = 0
        self._host_nodes: dict[TreeNode, None] = {}  # nodes with host slots
        self._host_size = 0
        self._backups: dict[int, set[TreeNode]] = {}  # copy id -> the nodes it writes
        self._next_created = 0

    # ---- matching and inserting ----------------------------------------------------------

    def match_prefix(
        self, key: Sequence[int], namespace: str | None = None, count_hit: bool = True,
        whole: bool = False,
    ) -> MatchResult:
        """Longest page-aligned cached prefix of key; splits the edge the match ends inside.
        `count_hit`: an admission that uses the match (not a look, e.g. for ordering). Cut
        back where the payload says, unless `whole` (a request's own progress, to lock)."""
        tokens = list(key)
        end = len(tokens) - len(tokens) % self.page_size
        device = self._root(namespace)
        slots: list[int] = []
        host_nodes: list[TreeNode] = []
        now = self._clock()
        path: list[TreeNode] = []
        for child, _ in self._descend(device, tokens, end):
            child.last_access = now
            if count_hit:
                child.hit_count += 1
            if child.slots is not None:
                slots.extend(child.slots)
                device = child
            else:
                host_nodes.append(child)
            path.append(child)
        self._eviction.accessed(path, count_hit)
        match = MatchResult(slots, device, host_nodes)
        return match if whole else self.payload.cut(match)

    def insert(
        self,
        key: Sequence[int],
        slots: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
    ) -> int:
        """Caches key -> slots; returns how many leading tokens were already on the device.

        The caller still owns slots[:returned] (duplicates to free); the tree owns the rest,
        including the part of a host-only node it now also holds on the device."""
        tokens = list(key)
        new_slots = list(slots)
        if len(tokens) != len(new_slots):
            raise ValueError(f"{len(tokens)} tokens but {len(new_slots)} slots")
        if len(tokens) % self.page_size:
            raise ValueError(
                f"key length {len(tokens)} is not a multiple of page_size {self.page_size}"
            )
        self._check_whole_pages(new_slots)
        node = self._root(namespace)
        now = self._clock()
        start, end = 0, len(tokens)
        adopted: int | None = None
        path: list[TreeNode] = []
        for child, at in self._descend(node, tokens, end):
            child.last_access = now
            child.priority = max(child.priority, priority)
            if child.slots is None:
                adopted = at if adopted is None else adopted
                self._set_device(child, new_slots[at : at + len(child.key)])
            node, start = child, at + len(child.key)
            path.append(child)
        self._eviction.accessed(path, False)
        if start < end:
            filed = child_key(tokens, start, self.page_size)
            self._add_leaf(node, filed, tokens[start:], new_slots[start:], now, priority)
        return start if adopted is None else adopted

    # ---- locking ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """Protects node and its ancestors, all on the device, from eviction."""
        self._check_in_tree(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            self._refresh_leaf(node)
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undoes one lock of node."""
        self._check_in_tree(node)
        if node.parent is not None and node.lock_ref == 0:
            raise ValueError(f"unlock of {node}, which is not locked")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.key)
                self._evictable += len(node.key)
            self._refresh_leaf(node)
            node = node.parent

    # ---- device eviction --------------------------------------------------------------------

    def evict(self, num_slots: int, keep: Callable[[TreeNode], bool] | None = None) -> int:
        """Frees device slots of unlocked leaves in policy order until num_slots are freed;
        returns slots freed. A leaf backed up on the host stays in the tree, host-only;
        `keep(leaf)` may start a backup of one that is not (it then stays, and frees its
        slots once the backup is done); any other leaf leaves the tree."""
        order = self._eviction.key
        heap = [(order(leaf), seq, leaf) for seq, leaf in enumerate(self._evictable_leaves)]
        heapq.heapify(heap)
        seq = len(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._evictable_leaves:
                continue  # a backup started on it since it was pushed
            parent = node.parent
            assert parent is not None and node.slots is not None
            if node.host_slots is not None:
                freed += len(node.slots)
                self._set_device(node, None)
            elif keep is not None and keep(node):
                continue
            else:
                freed += len(node.slots)
                self._remove(node)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (order(parent), seq, parent))
                seq += 1
        return freed

    # ---- the host tier ------------------------------------------------------------------

    def load_host(self, nodes: Sequence[TreeNode], slots: Sequence[int]) -> None:
        """Host-only nodes continuing a device prefix now also live in these device slots
        (the caller copies their KV there before anything reads it)."""
        at = 0
        for node in nodes:
            assert node.slots is None and node.host_slots is not None
            self._set_device(node, list(slots[at : at + len(node.key)]))
            at += len(node.key)
        if at != len(slots):
            raise ValueError(f"{len(slots)} slots for {at} host tokens")

    def start_backup(self, node: TreeNode, host_slots: list[int], copy_id: int) -> None:
        """A copy of node's device KV into host_slots is on its way."""
        assert node.slots is not None and node.host_slots is None and len(host_slots) == len(
            node.key
        )
        node.host_slots = host_slots
        node.backup = copy_id
        self._host_nodes[node] = None
        self._host_size += len(host_slots)
        self._backups.setdefault(copy_id, set()).add(node)
        self._refresh_leaf(node)

    def finish_backup(self, copy_id: int) -> list[TreeNode]:
        """The copy is done: its nodes are backed up on the host (unknown ids are ignored:
        a flush or a lost host tier forgot them). Returns those nodes."""
        nodes = list(self._backups.pop(copy_id, ()))
        for node in nodes:
            node.backup = 0
            self._refresh_leaf(node)
        return nodes

    def evict_host(self, num_slots: int) -> int:
        """Frees host slots in policy order: a host-only leaf leaves the tree, a node also on
        the device keeps only its device copy. Returns host slots freed."""
        assert self.host is not None
        order = self._eviction.key
        # Numbered after filtering: the numbers pushed below must not repeat one of these.
        candidates = [n for n in self._host_nodes if self._host_evictable(n)]
        heap = [(order(n), seq, n) for seq, n in enumerate(candidates)]
        heapq.heapify(heap)
        seq = len(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            assert node.host_slots is not None
            freed += len(node.host_slots)
            parent = node.parent
            if node.slots is not None:
                self._drop_host(node)
                continue
            self._remove(node)
            assert parent is not None
            # A parent on the device was a candidate from the start: only a host-only one
            # becomes one now (pushing the other again would drop its host copy twice).
            if parent.slots is None and parent.parent is not None and self._host_evictable(parent):
                heapq.heappush(heap, (order(parent), seq, parent))
                seq += 1
        return freed

    def attach_host(self, allocator: KVAllocator) -> None:
        """The host tier's slots, from now on (empty: nothing is cached there yet)."""
        if allocator.page_size != self.page_size:
            raise ValueError("the host tier's pages must match the device pool's")
        self.drop_host()
        self.host = allocator

    def drop_host(self) -> None:
        """Forget the host tier (its memory is gone): host-only nodes leave the tree, the
        rest keep their device copies; running backups are forgotten."""
        for node in list(self._host_nodes):
            if node in self._host_nodes:  # not removed with a host-only ancestor
                if node.slots is None:
                    self._remove(node)
                else:
                    self._drop_host(node)
        self._backups.clear()
        self.host = None

    def insert_host(
        self, key: Sequence[int], start: int, host_slots: Sequence[int], namespace: str | None
    ) -> list[int]:
        """Cache tokens key[start:] as held by these host slots (read from storage), below
        the prefix key[:start], which the tree must hold in some tier. The part the tree
        holds already is skipped; returns the host slots it did not take (the caller frees
        them): all of them when the prefix is not cached (it was evicted meanwhile)."""
        tokens = list(key)
        if len(tokens) - start != len(host_slots) or len(tokens) % self.page_size:
            raise ValueError(f"{len(host_slots)} host slots for tokens {start}..{len(tokens)}")
        assert self.host is not None
        node = self._root(namespace)
        at, end = 0, len(tokens)
        for child, edge_start in self._descend(node, tokens, end):
            node, at = child, edge_start + len(child.key)
        if at < start or at == end:
            return list(host_slots)
        leaf = TreeNode(tokens[at:], None, node, self._next_created, self._clock(), 0)
        self._next_created += 1
        leaf.host_slots = list(host_slots[at - start :])
        node.children[child_key(tokens, at, self.page_size)] = leaf
        self._host_nodes[leaf] = None
        self._host_size += len(leaf.host_slots)
        return list(host_slots[: at - start])

    def namespace_of(self, node: TreeNode) -> str | None:
        """The namespace of the tree that holds node."""
        while node.parent is not None:
            node = node.parent
        return next(ns for ns, root in self._roots.items() if root is node)

    def host_size(self) -> int:
        """Tokens the host tier holds."""
        return self._host_size

    def pending_backups(self) -> int:
        """Device-to-host copies not yet done."""
        return len(self._backups)

    # ---- sizes -------------------------------------------------------------------------------

    def evictable_size(self) -> int:
        """Cached device tokens that no lock protects."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached device tokens under a lock."""
        return self._protected

    def total_size(self) -> int:
        """Cached tokens on the device."""
        return self._evictable + self._protected

    def reset(self) -> None:
        """Drops every cached prefix on both tiers and frees its slots; nothing may be locked."""
        if self._protected:
            raise RuntimeError(f"cannot reset the radix cache: {self._protected} tokens are locked")
        for root in self._roots.values():
            for child in list(root.children.values()):
                self._remove(child)
        self._roots.clear()
        self._backups.clear()

    # ---- invariants ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Walks every tree and raises AssertionError on the first broken invariant."""
        backups = [node for nodes in self._backups.values() for node in nodes]
        self._eviction.check(check_tree(Books(
            self._roots, self.page_size, self._evictable, self._protected, self._host_size,
            self._evictable_leaves, self._host_nodes, backups, self.payload,
        )))

    # ---- internals -----------------------------------------------------------------------

    def _descend(self, node: TreeNode, tokens: list[int], end: int
                 ) -> Iterator[tuple[TreeNode, int]]:
        """Walk down from node along tokens[:end], splitting the edge the walk ends inside;
        yields each node reached with the position its edge starts at."""
        start = 0
        while start < end:
            child = node.children.get(child_key(tokens, start, self.page_size))
            if child is None:
                return
            matched = self._common_length(child.key, tokens, start, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            yield child, start
            node = child
            start += matched

    def _root(self, namespace: str | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode([], [], None, -1, self._clock())
        return root

    def _common_length(self, edge: list[int], tokens: list[int], start: int, end: int) -> int:
        """Page-aligned length of the common prefix of edge and tokens[start:end]."""
        limit = min(len(edge), end - start)
        # One C-level comparison settles the common case of a full match.
        if edge[:limit] == tokens[start : start + limit]:
            return limit
        matched = 0
        while edge[matched] == tokens[start + matched]:
            matched += 1
        return matched - matched % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cuts node's edge at `at`; returns the new upper node, node keeps the lower part.

        Node keeps its identity so references that callers hold (and locked) stay valid."""
        parent = node.parent
        assert parent is not None
        # The lower part keeps node's end, and with it what node holds there (its payload).
        upper = TreeNode(node.key[:at], None if node.slots is None else node.slots[:at], parent,
                         node.created, node.last_access, node.priority)
        upper.lock_ref = node.lock_ref
        upper.hit_count = node.hit_count
        if node.host_slots is not None:
            upper.host_slots = node.host_slots[:at]
            node.host_slots = node.host_slots[at:]
            self._host_nodes[upper] = None
        upper.backup = node.backup
        if node.backup:
            self._backups[node.backup].add(upper)
        upper.children[child_key(node.key, at, self.page_size)] = node
        parent.children[child_key(node.key, 0, self.page_size)] = upper
        node.key = node.key[at:]
        node.depth += at
        if node.slots is not None:
            node.slots = node.slots[at:]
        node.parent = upper
        self._eviction.split(upper, node)
        return upper

    def _add_leaf(
        self,
        parent: TreeNode,
        filed: ChildKey,
        key: list[int],
        slots: list[int],
        now: float,
        priority: int,
    ) -> None:
        leaf = TreeNode(key, slots, parent, self._next_created, now, priority)
        self._next_created += 1
        parent.children[filed] = leaf
        self._evictable += len(key)
        self._eviction.cached(leaf)
        self._refresh_leaf(leaf)
        self._refresh_leaf(parent)

    def _set_device(self, node: TreeNode, slots: list[int] | None) -> None:
        """Give node device slots (from the host tier, or a request that computed them), or
        take them (freeing them) when it is evicted to the host tier."""
        if slots is None:
            assert node.slots is not None and node.lock_ref == 0
            self.allocator.free(node.slots)
            self._evictable -= len(node.key)
            self._eviction.dropped(node)
            self.payload.dropped(node)
        else:
            assert node.slots is None
            self._evictable += len(node.key)
            self._eviction.cached(node)
        node.slots = slots
        self._refresh_leaf(node)
        if node.parent is not None:
            self._refresh_leaf(node.parent)

    def _drop_host(self, node: TreeNode) -> None:
        assert node.host_slots is not None and node.slots is not None
        if self.host is not None:
            self.host.free(node.host_slots)
        self._host_size -= len(node.host_slots)
        node.host_slots = None
        node.backup = 0
        del self._host_nodes[node]
        self._refresh_leaf(node)

    def _remove(self, node: TreeNode) -> None:
        """Takes an unlocked node and its subtree out of the tree, freeing every slot."""
        parent = node.parent
        assert parent is not None
        subtree = [node]
        for n in subtree:
            subtree.extend(n.children.values())
        # Free first: should an allocator object (a double free), the tree is still intact.
        self.allocator.free([s for n in subtree if n.slots is not None for s in n.slots])
        if self.host is not None:
            self.host.free([s for n in subtree if n.host_slots is not None for s in n.host_slots])
        del parent.children[child_key(node.key, 0, self.page_size)]
        for n in subtree:
            if n.slots is not None:
                assert n.lock_ref == 0, f"{n} is locked"
                self._evictable -= len(n.key)
                self._eviction.dropped(n)
                self.payload.dropped(n)
            if n.host_slots is not None:
                self._host_size -= len(n.host_slots)
                del self._host_nodes[n]
            self._evictable_leaves.pop(n, None)
            n.parent = None
        self._refresh_leaf(parent)

    def _refresh_leaf(self, node: TreeNode) -> None:
        if node.evictable_leaf:
            self._evictable_leaves[node] = None
        else:
            self._evictable_leaves.pop(node, None)

    def _host_evictable(self, node: TreeNode) -> bool:
        return (
            node.host_slots is not None
            and node.backup == 0
            and (node.slots is not None or not node.children)
        )

    def _check_whole_pages(self, slots: list[int]) -> None:
        """Rejects slots that do not come in whole pool pages, which eviction could not free."""
        size = self.page_size
        if size == 1:
            return
        for first, last in zip(slots[::size], slots[size - 1 :: size], strict=True):
            if first % size or last != first + size - 1:
                raise ValueError(f"slots {first}..{last} are not one whole page of {size}")

    def _check_in_tree(self, node: TreeNode) -> None:
        if node.parent is None and node.key:
            raise ValueError(f"{node} was evicted or reset out of the cache")

