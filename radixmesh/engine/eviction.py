"""Eviction policies of the radix cache: which evictable leaf goes first."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.engine.tree_node import TreeNode

# The leaf with the smallest key is evicted first; insertion order breaks the remaining ties.
EvictionKey = Callable[["TreeNode"], tuple[float, ...]]


def _lru(node: TreeNode) -> tuple[float, ...]:
    return (node.last_access, node.created)


def _lfu(node: TreeNode) -> tuple[float, ...]:
    return (node.hit_count, node.last_access, node.created)


def _fifo(node: TreeNode) -> tuple[float, ...]:
    return (node.created,)


def _priority(node: TreeNode) -> tuple[float, ...]:
    return (node.priority, node.last_access, node.created)


POLICIES: dict[str, EvictionKey] = {"lru": _lru, "lfu": _lfu, "fifo": _fifo, "priority": _priority}


def eviction_key(policy: str) -> EvictionKey:
    """Sort key of a policy by name; unknown names raise ValueError."""
    try:
        return POLICIES[policy]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {policy!r}; expected one of {sorted(POLICIES)}"
        ) from None
