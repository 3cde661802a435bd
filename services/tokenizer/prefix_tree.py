"""A router's guess at one engine's prefix cache: a token radix tree per cache-salt namespace,
bounded in size, least recently used leaves dropped first."""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Sequence

_LOW_WATER = 0.9


class _Node:
    """An edge of token ids leading to children keyed by their first token."""

    __slots__ = ("edge", "children", "parent", "last_used")

    def __init__(self, edge: array, parent: _Node | None, last_used: int) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = last_used


def _common_length(edge: array, tokens: Sequence[int], start: int) -> int:
    """How many leading tokens of `edge` equal tokens[start:]."""
    end = min(len(edge), len(tokens) - start)
    if edge[:end] == array("i", tokens[start : start + end]):
        return end
    n = 0
    while n < end and edge[n] == tokens[start + n]:
        n += 1
    return n


class PrefixTree:
    """Token sequences an engine probably holds, at most `max_tokens` of them in all."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self._roots: dict[str, _Node] = {}
        self.size = 0  # tokens stored, over all namespaces

    def match(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Length of the longest stored prefix of `tokens`; marks it recently used."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        now = next(self._clock)
        node, pos = root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_length(child.edge, tokens, pos)
            child.last_used = now
            pos += n
            if n < len(child.edge):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int], namespace: str = "") -> None:
        """Store `tokens` (and so every prefix of it), then shrink back under the bound."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node(array("i"), None, 0)
        now = next(self._clock)
        node, pos = root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = _Node(array("i", tokens[pos:]), node, now)
                node.children[tokens[pos]] = leaf
                self.size += len(leaf.edge)
                break
            n = _common_length(child.edge, tokens, pos)
            if n < len(child.edge):
                child = self._split(child, n)
            child.last_used = now
            node, pos = child, pos + n
        self._evict()

    def clear(self) -> None:
        """Forget everything (the engine flushed its cache)."""
        self._roots.clear()
        self.size = 0

    def _split(self, child: _Node, n: int) -> _Node:
        """Cut child's edge after n tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.edge[:n], parent, child.last_used)
        parent.children[child.edge[0]] = upper
        child.edge = child.edge[n:]
        child.parent = upper
        upper.children[child.edge[0]] = child
        return upper

    def _evict(self) -> None:
        if self.size <= self.max_tokens:
            return
        # Shrinking below the bound spreads the cost of a full scan over many inserts.
        target = int(self.max_tokens * _LOW_WATER)
        leaves = [
            (leaf.last_used, id(leaf), leaf)
            for root in self._roots.values()
            for leaf in _leaves(root)
        ]
        heapq.heapify(leaves)
        while self.size > target and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.size -= len(leaf.edge)
            if not parent.children and parent.parent is not None:
                heapq.heappush(leaves, (parent.last_used, id(parent), parent))
        for namespace in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[namespace]


def _leaves(root: _Node) -> list[_Node]:
    """Every node without children below `root` (the root itself excluded)."""
    out, stack = [], list(root.children.values())
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(node.children.values())
        else:
            out.append(node)
    return out
