"""Orders the waiting queue: longest prefix match, DFS by subtree weight, or arrival order."""

from __future__ import annotations

from collections import defaultdict

from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.tree_node import TreeNode

POLICIES = ("lpm", "dfs-weight", "fcfs")

# Matching every waiting request against the tree each step costs O(queue); past this
# length the cache-aware policies give way to arrival order.
CACHE_AWARE_QUEUE_LIMIT = 128


def match_key(req: Req) -> list[int]:
    """The tokens a request may take from the cache: all but the last (whose logits it needs),
    and, when it still wants prompt logprobs, none from the first wanted position on; none
    for an embedding pooled over its first or every token (their hidden states are not
    cached)."""
    if req.pooling in ("mean", "cls"):
        return []
    limit = req.num_tokens - 1
    if req.logprobs.return_logprob and req.logprobs.logprob_start_len >= 0 and not req.admitted:
        limit = min(limit, max(req.logprobs.logprob_start_len - 1, 0))
    return req.tokens[:limit]


class SchedulePolicy:
    """Decides which waiting requests are admitted first."""

    def __init__(self, policy: str, cache: RadixCache) -> None:
        if policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.cache = cache

    def order(self, waiting: list[Req]) -> list[Req]:
        """The waiting requests in admission order."""
        fcfs = sorted(waiting, key=lambda r: r.arrival)
        if self.policy == "fcfs" or len(waiting) > CACHE_AWARE_QUEUE_LIMIT:
            return fcfs
        matches = {
            r: self.cache.match_prefix(match_key(r), r.namespace, count_hit=False) for r in fcfs
        }
        if self.policy == "lpm":
            return sorted(fcfs, key=lambda r: -len(matches[r].slots))
        return _dfs_weight(fcfs, {r: m.node for r, m in matches.items()})


def _dfs_weight(reqs: list[Req], nodes: dict[Req, TreeNode]) -> list[Req]:
    """Walk the tree heaviest subtree first, so requests under one prefix run together."""
    at_node: dict[TreeNode, list[Req]] = defaultdict(list)
    for r in reqs:
        at_node[nodes[r]].append(r)
    weight: dict[TreeNode, int] = defaultdict(int)
    roots: list[TreeNode] = []
    for node, here in at_node.items():
        walk: TreeNode | None = node
        while walk is not None:
            weight[walk] += len(here)
            if walk.parent is None and walk not in roots:
                roots.append(walk)
            walk = walk.parent
    out: list[Req] = []
    stack = sorted(roots, key=lambda n: weight[n])
    while stack:
        node = stack.pop()
        out.extend(at_node.get(node, ()))
        children = [c for c in node.children.values() if c in weight]
        stack.extend(sorted(children, key=lambda n: weight[n]))
    return out
