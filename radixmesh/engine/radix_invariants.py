"""The radix cache's invariants: a walk of every tree, checked against what the cache keeps
count of (its Books). Tests and the scheduler's check_invariants run it; it raises
AssertionError, even under python -O, on the first thing that does not hold."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from radixmesh.engine.tree_node import ChildKey, TreeNode, child_key
from radixmesh.engine.tree_payload import NodePayload


@dataclass(frozen=True)
class Books:
    """What a RadixCache keeps count of, for a walk of its trees to check."""

    roots: Mapping[str | None, TreeNode]  # a root per namespace
    page_size: int
    evictable: int  # device tokens no lock protects
    protected: int  # device tokens under a lock
    host_size: int  # tokens the host tier holds
    evictable_leaves: Collection[TreeNode]
    host_nodes: Collection[TreeNode]  # nodes with host slots
    backups: Collection[TreeNode]  # nodes a running device-to-host copy writes
    payload: NodePayload  # what nodes hold beside their KV, which checks its own books


def check_tree(books: Books) -> list[TreeNode]:
    """Walk every tree, checking each node and the books' counts; the nodes walked."""
    evictable = protected = host = 0
    owned: set[int] = set()
    host_owned: set[int] = set()
    leaves: set[TreeNode] = set()
    host_nodes: set[TreeNode] = set()
    nodes: list[TreeNode] = []
    for namespace, root in books.roots.items():
        _require(
            root.parent is None and not root.key and not root.slots and root.lock_ref == 0,
            f"root of namespace {namespace!r} is not an empty unlocked root",
        )
        stack = [root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                where = f"{child} in namespace {namespace!r}"
                _check_node(node, key, child, where, books.page_size)
                nodes.append(child)
                if child.slots is not None:
                    _require(owned.isdisjoint(child.slots), f"{where}: a slot is owned twice")
                    owned.update(child.slots)
                    if child.lock_ref:
                        protected += len(child.key)
                    else:
                        evictable += len(child.key)
                    if child.evictable_leaf:
                        leaves.add(child)
                if child.host_slots is not None:
                    _require(
                        host_owned.isdisjoint(child.host_slots),
                        f"{where}: a host slot is owned twice",
                    )
                    host_owned.update(child.host_slots)
                    host += len(child.host_slots)
                    host_nodes.add(child)
                stack.append(child)
    _require(
        evictable == books.evictable,
        f"evictable counter {books.evictable} but the walk finds {evictable}",
    )
    _require(
        protected == books.protected,
        f"protected counter {books.protected} but the walk finds {protected}",
    )
    _require(host == books.host_size, f"host counter {books.host_size} but walk {host}")
    _require(leaves == set(books.evictable_leaves),
             "the evictable leaf set does not match the tree")
    _require(host_nodes == set(books.host_nodes), "the host node set does not match")
    _require(
        set(books.backups) == {n for n in host_nodes if n.backup},
        "the running backups do not match the nodes that wait for one",
    )
    books.payload.check(nodes)
    return nodes


def _check_node(parent: TreeNode, key: ChildKey, child: TreeNode, where: str,
                page_size: int) -> None:
    _require(child.parent is parent, f"{where}: parent link is broken")
    _require(child.depth == parent.depth + len(parent.key), f"{where}: wrong depth")
    _require(bool(child.key), f"{where}: empty non-root node")
    _require(child.slots is not None or child.host_slots is not None, f"{where}: in no tier")
    for tier in (child.slots, child.host_slots):
        _require(
            tier is None or len(tier) == len(child.key),
            f"{where}: {len(child.key)} tokens but {tier and len(tier)} slots",
        )
        _require(tier is None or len(set(tier)) == len(tier), f"{where}: a slot twice")
    _require(
        child.slots is None or parent.parent is None or parent.slots is not None,
        f"{where}: on the device under a parent that is not",
    )
    _require(child.backup == 0 or child.host_slots is not None, f"{where}: backup to nowhere")
    _require(len(child.key) % page_size == 0,
             f"{where}: edge is not whole pages of {page_size}")
    _require(key == child_key(child.key, 0, page_size), f"{where}: filed under child key {key!r}")
    _require(child.lock_ref >= 0, f"{where}: negative lock_ref")
    _require(child.lock_ref == 0 or child.slots is not None, f"{where}: locked off-device")
    _require(
        parent.parent is None or parent.lock_ref >= child.lock_ref,
        f"{where}: lock_ref above its parent's {parent.lock_ref}",
    )


def _require(condition: bool, message: str) -> None:
    # Not `assert`: the checks must still run under python -O.
    if not condition:
        raise AssertionError(message)
