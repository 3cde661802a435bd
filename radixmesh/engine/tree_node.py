"""A node of the radix cache (one edge: its tokens, their KV slots in each tier, its lock
count and eviction bookkeeping), and what a match returns."""

from __future__ import annotations

from typing import NamedTuple

# First token of an edge when page_size == 1, else its first page of tokens.
ChildKey = int | tuple[int, ...]


def child_key(tokens: list[int], start: int, page_size: int) -> ChildKey:
    """The key a parent files the edge starting at tokens[start] under."""
    if page_size == 1:
        return tokens[start]
    return tuple(tokens[start : start + page_size])


class TreeNode:
    """One edge of the tree: its tokens, their KV slots, and eviction bookkeeping."""

    __slots__ = (
        "children",
        "parent",
        "key",
        "slots",
        "host_slots",
        "backup",
        "lock_ref",
        "last_access",
        "hit_count",
        "priority",
        "created",
        "depth",
        "segment",
        "stamp",
    )

    def __init__(
        self,
        key: list[int],
        slots: list[int] | None,
        parent: TreeNode | None,
        created: int,
        last_access: float,
        priority: int = 0,
    ) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        # None for a namespace root and for a node no longer in the tree (its key is non-empty).
        self.parent = parent
        self.key = key
        self.slots = slots  # device slots; None once evicted to the host tier only
        self.host_slots: list[int] | None = None
        self.backup = 0  # id of the device-to-host copy still writing host_slots; 0: none
        self.lock_ref = 0
        self.last_access = last_access
        self.hit_count = 0
        self.priority = priority
        self.created = created
        # Tokens from the root to this edge's first token.
        self.depth = 0 if parent is None else parent.depth + len(parent.key)
        # SLRU's bookkeeping (eviction.SegmentedLRU): the node's segment (0: probationary,
        # 1: protected) and its last use in the policy's ticks.
        self.segment = 0
        self.stamp = 0

    @property
    def evictable_leaf(self) -> bool:
        """Whether device eviction may take it: in the tree, on the device, unlocked, no
        backup running and no child on the device."""
        return (
            self.parent is not None
            and self.slots is not None
            and self.lock_ref == 0
            and self.backup == 0
            and all(c.slots is None for c in self.children.values())
        )

    def __repr__(self) -> str:
        shown = f"{self.key[:8]}..." if len(self.key) > 8 else f"{self.key}"
        return f"TreeNode(key={shown}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """The longest cached prefix of a key: its device part, then its host-only part."""

    slots: list[int]  # device KV slots of the matched prefix, one per matched token
    node: TreeNode  # deepest device node matched (a root when none); what the caller locks
    host_nodes: list[TreeNode] = []  # host-only nodes continuing the match, in order

    @property
    def host_len(self) -> int:
        """Tokens past the device part that the host tier holds."""
        return sum(len(n.key) for n in self.host_nodes)
