"""What the radix tree's nodes may hold beside their KV slots: the one place a kind of
payload plugs into the tree (RadixCache's `payload`).

A payload sits at the end of a node's edge (a split keeps it with the lower node, which
keeps its identity and its end). The tree lets it cut a match back to where the payload
lets one end, and tells it when a node's device KV is gone (its payload goes with it); its
holder makes room by evicting leaves through the tree, KV and payload together, in the
eviction policy's order. A hybrid linear-attention model's snapshots of its linear layers'
state are one such payload (state_snapshots.StateSnapshots)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixmesh.engine.tree_node import MatchResult, TreeNode


class NodePayload:
    """Nodes hold nothing beside their KV: a match may end at any node."""

    def cut(self, match: MatchResult) -> MatchResult:
        """The match cut back to the deepest node of it that the payload lets a match end
        at (the KV of a prefix alone may not be enough to go on from its end)."""
        return match

    def dropped(self, node: TreeNode) -> None:
        """node's device KV is gone (evicted, or out of the tree): what it holds goes too."""

    def check(self, nodes: Collection[TreeNode]) -> None:
        """Raises AssertionError where the payload's books disagree with the tree's nodes
        (every node the tree walked, roots excluded)."""
