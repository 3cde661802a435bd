"""Radix tree over token ids that maps cached prefixes to their KV slots."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from radixmesh.services.scheduler.eviction import eviction_key
from radixmesh.services.scheduler.kv_allocator import KVAllocator

# First token of an edge when page_size == 1, else its first page of tokens.
ChildKey = int | tuple[int, ...]


class TreeNode:
    """One edge of the tree: its tokens, their KV slots, and eviction bookkeeping."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "slots",
        "lock_ref",
        "last_access",
        "hit_count",
        "priority",
        "created",
    )

    def __init__(
        self,
        key: list[int],
        slots: list[int],
        parent: TreeNode | None,
        created: int,
        last_access: float,
        priority: int = 0,
    ) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        # None for a namespace root and for a node no longer in the tree (its key is non-empty).
        self.parent = parent
        self.key = key
        self.slots = slots
        self.lock_ref = 0
        self.last_access = last_access
        self.hit_count = 0
        self.priority = priority
        self.created = created

    def __repr__(self) -> str:
        shown = f"{self.key[:8]}..." if len(self.key) > 8 else f"{self.key}"
        return f"TreeNode(key={shown}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """The longest cached prefix of a key."""

    slots: list[int]  # KV slots of the matched prefix, one per matched token
    node: TreeNode  # deepest matched node (a root when nothing matched); what the caller locks


class RadixCache:
    """Prefix cache of KV slots, one radix tree per namespace, with locking and eviction."""

    def __init__(
        self,
        allocator: KVAllocator,
        page_size: int = 1,
        policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if page_size != allocator.page_size:
            # Evicting frees whole allocator pages, so tree pages and pool pages must coincide.
            raise ValueError(
                f"page_size {page_size} differs from the allocator's {allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.policy = policy
        self._eviction_key = eviction_key(policy)
        self._clock = clock
        self._roots: dict[str | None, TreeNode] = {}
        # Unlocked childless non-root nodes; a dict as an insertion-ordered set for stable ties.
        self._evictable_leaves: dict[TreeNode, None] = {}
        self._evictable = 0
        self._protected = 0
        self._next_created = 0

    def match_prefix(self, key: Sequence[int], namespace: str | None = None) -> MatchResult:
        """Longest page-aligned cached prefix of key; splits the edge the match ends inside."""
        tokens = list(key)
        end = len(tokens) - len(tokens) % self.page_size
        node = self._root(namespace)
        slots: list[int] = []
        now = self._clock()
        start = 0
        while start < end:
            child = node.children.get(self._child_key(tokens, start))
            if child is None:
                break
            matched = self._common_length(child.key, tokens, start, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            child.hit_count += 1
            slots.extend(child.slots)
            node = child
            start += matched
        return MatchResult(slots, node)

    def insert(
        self,
        key: Sequence[int],
        slots: Sequence[int],
        namespace: str | None = None,
        priority: int = 0,
    ) -> int:
        """Caches key -> slots; returns how many leading tokens were already cached.

        The caller still owns slots[:returned] (duplicates to free); the tree owns the rest.
        """
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
        while start < end:
            child_key = self._child_key(tokens, start)
            child = node.children.get(child_key)
            if child is None:
                self._add_leaf(node, child_key, tokens[start:], new_slots[start:], now, priority)
                return start
            matched = self._common_length(child.key, tokens, start, end)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access = now
            child.priority = max(child.priority, priority)
            node = child
            start += matched
        return end

    def lock(self, node: TreeNode) -> None:
        """Protects node and its ancestors from eviction."""
        self._check_in_tree(node)
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                self._evictable_leaves.pop(node, None)
            node.lock_ref += 1
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
                if not node.children:
                    self._evictable_leaves[node] = None
            node = node.parent

    def evict(self, num_slots: int) -> int:
        """Evicts unlocked leaves in policy order until num_slots are freed; returns slots freed."""
        order = self._eviction_key
        heap = [(order(leaf), seq, leaf) for seq, leaf in enumerate(self._evictable_leaves)]
        heapq.heapify(heap)
        seq = len(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, node = heapq.heappop(heap)
            # Free first: should the allocator object, the tree is still intact.
            self.allocator.free(node.slots)
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0)]
            del self._evictable_leaves[node]
            node.parent = None
            freed += len(node.slots)
            self._evictable -= len(node.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                self._evictable_leaves[parent] = None
                heapq.heappush(heap, (order(parent), seq, parent))
                seq += 1
        return freed

    def evictable_size(self) -> int:
        """Cached tokens that no lock protects."""
        return self._evictable

    def protected_size(self) -> int:
        """Cached tokens under a lock."""
        return self._protected

    def total_size(self) -> int:
        """Cached tokens."""
        return self._evictable + self._protected

    def reset(self) -> None:
        """Drops every cached prefix and frees its slots; nothing may be locked."""
        if self._protected:
            raise RuntimeError(f"cannot reset the radix cache: {self._protected} tokens are locked")
        slots: list[int] = []
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                slots.extend(node.slots)
                node.parent = None
                stack.extend(node.children.values())
        self.allocator.free(slots)
        self._roots.clear()
        self._evictable_leaves.clear()
        self._evictable = 0

    def check_invariants(self) -> None:
        """Walks every tree and raises AssertionError on the first broken invariant."""
        evictable = protected = 0
        owned: set[int] = set()
        leaves: set[TreeNode] = set()
        for namespace, root in self._roots.items():
            _require(
                root.parent is None and not root.key and not root.slots and root.lock_ref == 0,
                f"root of namespace {namespace!r} is not an empty unlocked root",
            )
            stack = [root]
            while stack:
                node = stack.pop()
                for child_key, child in node.children.items():
                    where = f"{child} in namespace {namespace!r}"
                    _require(child.parent is node, f"{where}: parent link is broken")
                    _require(bool(child.key), f"{where}: empty non-root node")
                    _require(
                        len(child.key) == len(child.slots),
                        f"{where}: {len(child.key)} tokens but {len(child.slots)} slots",
                    )
                    _require(
                        len(child.key) % self.page_size == 0,
                        f"{where}: edge is not whole pages of {self.page_size}",
                    )
                    _require(
                        child_key == self._child_key(child.key, 0),
                        f"{where}: filed under child key {child_key!r}",
                    )
                    _require(child.lock_ref >= 0, f"{where}: negative lock_ref")
                    _require(
                        node.parent is None or node.lock_ref >= child.lock_ref,
                        f"{where}: lock_ref above its parent's {node.lock_ref}",
                    )
                    _require(
                        len(set(child.slots)) == len(child.slots) and owned.isdisjoint(child.slots),
                        f"{where}: a slot is owned twice",
                    )
                    owned.update(child.slots)
                    if child.lock_ref:
                        protected += len(child.key)
                    else:
                        evictable += len(child.key)
                        if not child.children:
                            leaves.add(child)
                    stack.append(child)
        _require(
            evictable == self._evictable,
            f"evictable counter {self._evictable} but the walk finds {evictable}",
        )
        _require(
            protected == self._protected,
            f"protected counter {self._protected} but the walk finds {protected}",
        )
        _require(
            leaves == set(self._evictable_leaves),
            "the evictable leaf set does not match the tree",
        )

    def _root(self, namespace: str | None) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode([], [], None, -1, self._clock())
        return root

    def _child_key(self, tokens: list[int], start: int) -> ChildKey:
        if self.page_size == 1:
            return tokens[start]
        return tuple(tokens[start : start + self.page_size])

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

        Node keeps its identity so references that callers hold (and locked) stay valid.
        """
        parent = node.parent
        assert parent is not None
        upper = TreeNode(
            node.key[:at], node.slots[:at], parent, node.created, node.last_access, node.priority
        )
        upper.lock_ref = node.lock_ref
        upper.hit_count = node.hit_count
        upper.children[self._child_key(node.key, at)] = node
        parent.children[self._child_key(node.key, 0)] = upper
        node.key = node.key[at:]
        node.slots = node.slots[at:]
        node.parent = upper
        return upper

    def _add_leaf(
        self,
        parent: TreeNode,
        child_key: ChildKey,
        key: list[int],
        slots: list[int],
        now: float,
        priority: int,
    ) -> None:
        leaf = TreeNode(key, slots, parent, self._next_created, now, priority)
        self._next_created += 1
        parent.children[child_key] = leaf
        self._evictable += len(key)
        self._evictable_leaves.pop(parent, None)
        self._evictable_leaves[leaf] = None

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


def _require(condition: bool, message: str) -> None:
    # Not `assert`: the checks must still run under python -O.
    if not condition:
        raise AssertionError(message)
