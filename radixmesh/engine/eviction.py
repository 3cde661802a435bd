"""Eviction policies of the radix cache: which evictable leaf goes first, and the state a
policy keeps as the cache changes (the segments of SLRU)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.engine.tree_node import TreeNode

# The leaf with the smallest key is evicted first; insertion order breaks the remaining ties.
EvictionKey = Callable[["TreeNode"], tuple[float, ...]]

# TreeNode.segment under SLRU; every other policy leaves all nodes probationary.
PROBATIONARY, PROTECTED = 0, 1
DEFAULT_PROTECTED_RATIO = 0.8


def _lru(node: TreeNode) -> tuple[float, ...]:
    return (node.last_access, node.created)


def _lfu(node: TreeNode) -> tuple[float, ...]:
    return (node.hit_count, node.last_access, node.created)


def _fifo(node: TreeNode) -> tuple[float, ...]:
    return (node.created,)


def _priority(node: TreeNode) -> tuple[float, ...]:
    return (node.priority, node.last_access, node.created)


def _slru(node: TreeNode) -> tuple[float, ...]:
    return (node.segment, node.stamp, node.created)


_KEYS: dict[str, EvictionKey] = {"lru": _lru, "lfu": _lfu, "fifo": _fifo, "priority": _priority}
POLICIES = (*_KEYS, "slru")


class EvictionPolicy:
    """Orders evictable leaves by a sort key; the cache calls the hooks below as nodes are
    cached, used, split and dropped. This one keeps no state: its key reads the node."""

    def __init__(self, key: EvictionKey) -> None:
        self.key = key

    def cached(self, node: TreeNode) -> None:
        """node's tokens just came onto the device: a new leaf, or back from the host tier."""

    def accessed(self, path: Sequence[TreeNode], hit: bool) -> None:
        """A match or insert went through path; `hit`: an admission that uses it."""

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        """upper was cut off the top of lower's edge."""

    def dropped(self, node: TreeNode) -> None:
        """node's device tokens are gone: evicted to the host tier or out of the tree."""

    def check(self, nodes: Iterable[TreeNode]) -> None:
        """Raises AssertionError where the bookkeeping disagrees with the tree's nodes."""


class SegmentedLRU(EvictionPolicy):
    """SLRU: a cached node starts probationary and is promoted to the protected segment when
    a later admission hits it. The protected segment holds at most protected_ratio of the
    pool's slots; past that, its least recently used nodes go back to the probationary
    segment's most recent end. Eviction takes probationary leaves first, so a stream of
    one-off prompts cycles through that segment without flushing prefixes used again."""

    def __init__(
        self, capacity: int, protected_ratio: float = DEFAULT_PROTECTED_RATIO
    ) -> None:
        if not 0 < protected_ratio < 1:
            raise ValueError(f"protected_ratio must be in (0, 1), got {protected_ratio!r}")
        super().__init__(_slru)
        self.protected_ratio = protected_ratio
        # Of the pool, not of the tokens cached now: those shrink whenever running requests
        # take the pool, and a cap that shrank with them would demote the hot prefixes just
        # when eviction is about to reach them.
        self.limit = int(protected_ratio * capacity)
        self.protected_tokens = 0
        self._protected: dict[TreeNode, None] = {}
        # Recency in the policy's own ticks, not the clock: a demoted node must sort after
        # every probationary node, however recently they were used.
        self._tick = 0

    def cached(self, node: TreeNode) -> None:
        node.segment = PROBATIONARY
        node.stamp = self._next_tick()

    def accessed(self, path: Sequence[TreeNode], hit: bool) -> None:
        # One tick for the whole path: among equals, demotion takes the deepest first.
        tick = self._next_tick()
        for node in path:
            node.stamp = tick
            if hit and node.segment == PROBATIONARY and node.slots is not None:
                node.segment = PROTECTED
                self._protected[node] = None
                self.protected_tokens += len(node.key)
        while self.protected_tokens > self.limit:
            demoted = min(self._protected, key=lambda n: (n.stamp, -n.depth))
            self._unprotect(demoted)
            demoted.stamp = self._next_tick()

    def split(self, upper: TreeNode, lower: TreeNode) -> None:
        # Both parts keep the segment; the protected token count does not change.
        upper.segment, upper.stamp = lower.segment, lower.stamp
        if upper.segment == PROTECTED:
            self._protected[upper] = None

    def dropped(self, node: TreeNode) -> None:
        if node.segment == PROTECTED:
            self._unprotect(node)

    def check(self, nodes: Iterable[TreeNode]) -> None:
        protected = {n for n in nodes if n.segment == PROTECTED}
        if protected != set(self._protected):
            raise AssertionError("SLRU's protected set does not match the protected nodes")
        if any(n.slots is None for n in protected):
            raise AssertionError("SLRU protects a node that is not on the device")
        walked = sum(len(n.key) for n in protected)
        if walked != self.protected_tokens:
            raise AssertionError(
                f"SLRU's protected counter {self.protected_tokens} but the walk finds {walked}"
            )
        if self.protected_tokens > self.limit:
            raise AssertionError(
                f"SLRU protects {self.protected_tokens} tokens, over its limit {self.limit}"
            )

    def _unprotect(self, node: TreeNode) -> None:
        node.segment = PROBATIONARY
        del self._protected[node]
        self.protected_tokens -= len(node.key)

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick


def eviction_policy(
    name: str, capacity: int, protected_ratio: float = DEFAULT_PROTECTED_RATIO
) -> EvictionPolicy:
    """A fresh policy by name for a pool of `capacity` slots (SLRU keeps state: one per
    cache); unknown names raise ValueError. protected_ratio: SLRU's protected share."""
    if name == "slru":
        return SegmentedLRU(capacity, protected_ratio)
    try:
        return EvictionPolicy(_KEYS[name])
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}"
        ) from None
