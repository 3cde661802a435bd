"""A step entry's draft tree as the model runner computes and keeps it (speculative
decoding): which nodes are worth computing, a row per node over its own path (the tree
mask), and the accepted path's K/V moved to the positions it was accepted at."""

from __future__ import annotations

import torch

from radixmesh.core.step import StepEntry
from radixmesh.engine.model.attention import SeqSpan
from radixmesh.engine.model.grammar_mask import Matcher
from radixmesh.engine.model.kv_pool import KVPool


def _path(entry: StepEntry, node: int) -> list[int]:
    """The node and its ancestors, from the fed token's child down to it."""
    path = [node]
    while entry.draft_parents[path[-1]] >= 0:
        path.append(entry.draft_parents[path[-1]])
    return path[::-1]


def grammar_allows(entry: StepEntry, matcher: Matcher | None) -> list[int]:
    """The draft nodes worth computing: all of them, or under a grammar (`matcher`, standing
    after the fed token) those whose path it accepts. A drafted stop token is pruned: the
    model's own sample there ends the request just as well."""
    if matcher is None:
        return list(range(len(entry.draft)))
    keep: set[int] = set()
    for k, parent in enumerate(entry.draft_parents):
        if parent >= 0 and parent not in keep:
            continue
        path = _path(entry, k)
        accepted = 0
        for node in path:
            token = entry.draft[node]
            if token in matcher.stop_token_ids or not matcher.accept(token):
                break
            accepted += 1
        matcher.rollback(accepted)
        if accepted == len(path):
            keep.add(k)
    return sorted(keep)


def draft_rows(
    entry: StepEntry,
    keep: list[int],
    prefix: torch.Tensor,
    ids: list[int],
    positions: list[int],
    slots: list[int],
    attend: list[SeqSpan],
    first_row: int = 0,
) -> dict[int, int]:
    """Append a row for each draft node of `keep`: its token at the position its depth gives
    after `prefix` (the slots of the request's tokens, the fed ones included), in its draft
    slot, attending to the prefix and its own path up the tree. Returns each node's row of
    the step (`first_row` that of ids[0])."""
    node_slots = entry.slots[len(entry.slots) - len(entry.draft) :]
    rows: dict[int, int] = {}
    for k in keep:
        path = _path(entry, k)
        own = torch.tensor([node_slots[j] for j in path], dtype=torch.long)
        rows[k] = first_row + len(ids)
        attend.append(SeqSpan(rows[k], 1, torch.cat([prefix, own])))
        ids.append(entry.draft[k])
        positions.append(prefix.numel() + len(path) - 1)
        slots.append(node_slots[k])
    return rows


def children(entry: StepEntry, nodes: dict[int, int]) -> dict[tuple[int, int], int]:
    """(parent node, token) -> child node over the computed draft nodes; -1 is the fed token."""
    return {(entry.draft_parents[k], entry.draft[k]): k for k in nodes}


def forced_path(
    kids: dict[tuple[int, int], int], at: int, tokens: list[int]
) -> list[int] | None:
    """The nodes that carry `tokens` one below the other from node `at` (-1: the fed
    token), or None where the tree does not carry them all."""
    nodes = []
    for token in tokens:
        node = kids.get((at, token))
        if node is None:
            return None
        nodes.append(node)
        at = node
    return nodes


def keep_path(pool: KVPool, entry: StepEntry, path: list[int]) -> tuple[list[int], list[int]]:
    """Keep an accepted path: its nodes' K/V move to the first draft slots, those of the
    positions they were accepted at (the rest are the scheduler's to reuse). Returns the
    path's tokens and their slots now."""
    node_slots = entry.slots[len(entry.slots) - len(entry.draft) :]
    src = [node_slots[k] for k in path]
    dst = node_slots[: len(path)]
    if src != dst:
        device = pool.k[0].device
        pool.move(torch.tensor(src, device=device), torch.tensor(dst, device=device))
    return [entry.draft[k] for k in path], dst
