"""Speculative decoding's drafts: an n-gram store over the tokens the engine has seen, the
draft trees grown from it, and how much each request drafts.

The scheduler asks `draft(req)` for a tree of guesses at a decoding request's next tokens;
the model runner verifies the tree in one forward and reports the accepted path. Every token
a request has (prompt and output) goes into one trie of bounded depth shared by the engine's
requests, so a request drafts from its own text and from what the others wrote.

How much to draft weighs what a draft token is likely to give against what it costs: each
request keeps an estimate p of how often its next draft token is accepted, and `StepCost`
learns from the steps' forward times what one more row costs against the step (on a small
CPU a row is far from free; on a GPU it nearly is). A request drafts k tokens while p**k
stays above that share, so text with nothing to copy, or a batch already bound by compute,
runs as plain decode steps, and a failing request pauses before it tries again.
`NoSpeculation` is the scheduler's collaborator when speculation is off.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from radixmesh.core.settings import SpeculativeSettings
from radixmesh.core.step import StepBatch
from radixmesh.engine.request import Req

# A request whose drafts are not worth a row pauses drafting for _PAUSE_FIRST plain steps,
# doubling up to _PAUSE_MOST while that goes on; then it tries again.
_PAUSE_FIRST = 4
_PAUSE_MOST = 64
# Each new verify (timed step) weighs the earlier ones down by this factor.
_DECAY = 0.9
_COST_DECAY = 0.97
# A new request writes at most its last this many tokens to the store (each costs a node
# per trie level, on the scheduler's thread).
_WRITE_FIRST = 4096
# Before any step is timed: a row costs this share of a one-row step (an optimistic guess
# that the first measured verifies correct).
_PRIOR_ROW_SHARE = 0.1


class Draft(NamedTuple):
    """A draft tree: tokens[i] follows tokens[parents[i]], or the request's last token
    where parents[i] is -1; parents come before their children."""

    tokens: list[int]
    parents: list[int]


class _Node:
    __slots__ = ("children", "count", "tick")

    def __init__(self, tick: int) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # sequences that went through it
        self.tick = tick  # when a sequence last ended here


class NgramStore:
    """Token sequences of up to `max_depth` tokens, as a trie with counts.

    A writer keeps a cursor (the nodes of its last max_depth - 1 tokens' suffixes) and
    `extend`s it token by token, so each token costs O(max_depth). Past `capacity` nodes,
    the half least recently written is dropped and the generation moves on: cursors of an
    older generation are rebuilt from their writer's tokens."""

    def __init__(self, max_depth: int, capacity: int) -> None:
        self.max_depth = max_depth
        self.capacity = capacity
        self.generation = 0
        self._ticks = itertools.count(1)
        self.root = _Node(0)
        self.size = 0

    def cursor(self, tokens: list[int]) -> list[_Node]:
        """The cursor after writing `tokens` (only the last max_depth - 1 count)."""
        cursor: list[_Node] = []
        for token in tokens[-(self.max_depth - 1) :]:
            cursor = self._step(cursor, token)
        return cursor

    def extend(self, cursor: list[_Node], token: int) -> list[_Node]:
        """Write `token` after the sequences `cursor` ends; returns the new cursor."""
        cursor = self._step(cursor, token)
        if self.size > self.capacity:
            self._prune()
        return cursor

    def _step(self, cursor: list[_Node], token: int) -> list[_Node]:
        tick = next(self._ticks)
        out = []
        for parent in [self.root, *cursor[: self.max_depth - 1]]:
            child = parent.children.get(token)
            if child is None:
                child = parent.children[token] = _Node(tick)
                self.size += 1
            child.count += 1
            child.tick = tick
            out.append(child)
        return out

    def _prune(self) -> None:
        """Drop the half of the nodes written least recently (and what hangs below them
        only), keeping every kept node's parent."""
        ticks: list[int] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                ticks.append(child.tick)
                stack.append(child)
        threshold = sorted(ticks)[len(ticks) // 2]
        self.size = self._keep(self.root, threshold)
        self.generation += 1

    def _keep(self, node: _Node, threshold: int) -> int:
        """Prune below `node`; returns how many nodes stay below it."""
        kept = 0
        for token, child in list(node.children.items()):
            below = self._keep(child, threshold)
            if below == 0 and child.tick < threshold:
                del node.children[token]
            else:
                kept += below + 1
        return kept


def _root_breadth(settings: SpeculativeSettings, window: int) -> int:
    """Branches at the root of a tree grown after a match of `window` tokens: the longer
    the match, the surer its continuation, the fewer the branches."""
    lo_w = settings.speculative_ngram_min_match_window_size
    hi_w = settings.speculative_ngram_max_match_window_size
    lo_b = settings.speculative_ngram_min_bfs_breadth
    hi_b = settings.speculative_ngram_max_bfs_breadth
    if hi_w == lo_w:
        return lo_b
    return round(hi_b - (hi_b - lo_b) * (window - lo_w) / (hi_w - lo_w))


def grow_tree(
    match: _Node, budget: int, root_breadth: int, breadth: int, branch_length: int, by_count: bool
) -> Draft:
    """Up to `budget` tokens below `match`, at most branch_length deep. by_count False takes
    level after level, each node's most recently written children first (root_breadth of
    them at the first level, `breadth` below); True takes the most probable paths first
    (a child's probability is its share of its parent's count)."""
    draft = Draft([], [])
    # (-probability, order, node, token, parent index, depth); the order breaks ties
    order = itertools.count()
    heap: list[tuple[float, int, _Node, int, int, int]] = []

    def children(node: _Node, parent: int, depth: int, prob: float) -> None:
        width = root_breadth if depth == 1 else breadth
        if depth > branch_length:
            return
        if by_count:
            total = sum(c.count for c in node.children.values())
            for token, child in node.children.items():
                heapq.heappush(
                    heap, (-prob * child.count / total, next(order), child, token, parent, depth)
                )
            return
        kids = heapq.nlargest(width, node.children.items(), key=lambda kv: kv[1].tick)
        for token, child in kids:  # level by level: the order alone decides
            heapq.heappush(heap, (0.0, next(order), child, token, parent, depth))

    children(match, -1, 1, 1.0)
    while heap and len(draft.tokens) < budget:
        neg, _, node, token, parent, depth = heapq.heappop(heap)
        draft.tokens.append(token)
        draft.parents.append(parent)
        children(node, len(draft.tokens) - 1, depth + 1, -neg)
    return draft


@dataclass
class _Writer:
    """One request's place in the store and its drafting record."""

    cursor: list[_Node]
    generation: int
    written: int  # tokens of the request written so far
    accepted: float = 0.0  # draft tokens accepted, decayed
    rejected: float = 0.0  # draft tokens rejected first on their path, decayed
    pause: int = 0  # plain steps to take before drafting again
    next_pause: int = _PAUSE_FIRST
    probe: bool = False  # its next draft is one token whatever it seems worth

    @property
    def p(self) -> float:
        """How likely its next draft token is accepted (1/2 before any verify)."""
        return (self.accepted + 1) / (self.accepted + self.rejected + 2)


class StepCost:
    """A decode step's forward time as a + b * rows, fitted to recent decode steps (least
    squares, older steps weighing less), starting from a prior of a row costing
    _PRIOR_ROW_SHARE of a one-row step."""

    def __init__(self) -> None:
        # Weighted sums of 1, rows, ms, rows^2, rows*ms.
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.fitted = False

    def add(self, rows: int, ms: float) -> None:
        """A decode step of `rows` rows took `ms`."""
        if not self.fitted:  # the prior: two pseudo-steps scaled to the first real one
            per_row = ms / (1 + _PRIOR_ROW_SHARE * (rows - 1))
            for r in (1, 9):
                self._add(r, per_row * (1 + _PRIOR_ROW_SHARE * (r - 1)), 2.0)
            self.fitted = True
        self._add(rows, ms, 1.0)

    def _add(self, x: float, y: float, weight: float) -> None:
        d = _COST_DECAY
        self._w = d * self._w + weight
        self._x = d * self._x + weight * x
        self._y = d * self._y + weight * y
        self._xx = d * self._xx + weight * x * x
        self._xy = d * self._xy + weight * x * y

    def row_share(self, rows: int) -> float:
        """What one more row costs a step of `rows` rows that each give a token, counted in
        those tokens: b * rows / (a + b * rows). A draft token is worth its row when it is
        accepted more often than that."""
        if not self.fitted:
            return _PRIOR_ROW_SHARE * rows / (1 + _PRIOR_ROW_SHARE * (rows - 1))
        var = self._w * self._xx - self._x**2
        b = (self._w * self._xy - self._x * self._y) / var if var > 1e-9 else 0.0
        a = (self._y - b * self._x) / self._w
        b = max(b, 0.0)
        step = a + b * rows
        return min(b * rows / step, 1.0) if step > 0 else 0.0


@dataclass
class SpeculationStats:
    """Verify steps and what they gave, over the engine's life."""

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    def report(self) -> dict[str, float]:
        """The figures as /server_info reports them."""
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_drafted_tokens": self.drafted_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "avg_spec_accept_length": round(self.mean_accept_length, 4),
        }

    @property
    def mean_accept_length(self) -> float:
        """Tokens a verify step produced on average: accepted drafts plus its own token."""
        if not self.verify_steps:
            return 0.0
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps


class NoSpeculation:
    """Speculation off: no request ever drafts."""

    drafting = False  # whether any request may draft

    def __init__(self) -> None:
        self.stats = SpeculationStats()

    def drafts(self, req: Req) -> bool:
        """Whether to draft for the request at this step (asked once a step it decodes in):
        it then waits out a step in flight, whose token its draft starts from."""
        return False

    def draft(self, req: Req, limit: int, batch: int = 1) -> Draft | None:
        """A draft tree of at most `limit` tokens after the request's last token, worth its
        rows in a step of about `batch` rows, or None."""
        return None

    def verified(self, req: Req, drafted: int, deepest: int, accepted: int) -> None:
        """A verify of `drafted` tokens, `deepest` of them on its longest path, accepted
        `accepted` of them."""

    def stepped(self, batch: StepBatch, forward_ms: float) -> None:
        """A step took `forward_ms` in the model runner."""

    def forget(self, req: Req) -> None:
        """The request is done."""

    def reset(self) -> None:
        """The engine starts over (its requests are gone)."""


class NgramSpeculation(NoSpeculation):
    """Drafts from an NgramStore, adapting each request's draft size to how its drafts fare."""

    drafting = True

    def __init__(self, settings: SpeculativeSettings) -> None:
        super().__init__()
        self.settings = settings
        self.store = NgramStore(
            settings.speculative_ngram_max_trie_depth, settings.speculative_ngram_capacity
        )
        self._writers: dict[str, _Writer] = {}
        self.cost = StepCost()

    def drafts(self, req: Req) -> bool:
        w = self._writers.get(req.rid)
        if w is not None and w.pause:
            w.pause -= 1
            return False
        return True

    def draft(self, req: Req, limit: int, batch: int = 1) -> Draft | None:
        w = self._writer(req)
        # Tokens worth a row each: p**k above what a row costs a step of `batch` rows. A
        # paused request's first try after the pause is one token, whatever p says: else a
        # request whose first draft failed where rows are dear would never learn better.
        share, k, chance = self.cost.row_share(batch), 0, 1.0
        while k < min(limit, self.settings.speculative_num_draft_tokens):
            chance *= w.p
            if chance <= share:
                break
            k += 1
        if k == 0 and w.probe and limit >= 1:
            k = 1
        w.probe = False
        if k == 0:
            if limit >= 1:
                self._pause(w)
            return None
        s = self.settings
        lo = s.speculative_ngram_min_match_window_size
        hi = s.speculative_ngram_max_match_window_size
        for window in range(min(hi, len(w.cursor)), lo - 1, -1):
            match = w.cursor[window - 1]
            if match.children:
                break
        else:
            w.pause = _PAUSE_FIRST  # nothing to go on: look again a few tokens later
            return None
        draft = grow_tree(
            match,
            k,
            _root_breadth(s, window),
            s.speculative_ngram_min_bfs_breadth,
            s.speculative_ngram_branch_length,
            s.speculative_ngram_match_type == "PROB",
        )
        return draft if draft.tokens else None

    def verified(self, req: Req, drafted: int, deepest: int, accepted: int) -> None:
        self.stats.verify_steps += 1
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        w = self._writers.get(req.rid)
        if w is None:
            return
        w.accepted = _DECAY * w.accepted + accepted
        w.rejected = _DECAY * w.rejected + (accepted < deepest)
        if accepted:
            w.next_pause = _PAUSE_FIRST

    def stepped(self, batch: StepBatch, forward_ms: float) -> None:
        if batch.num_requests and not any(e.input_ids for e in batch.entries):  # decodes only
            self.cost.add(batch.num_tokens, forward_ms)

    def _pause(self, w: _Writer) -> None:
        w.pause = w.next_pause
        w.probe = True
        w.next_pause = min(2 * w.next_pause, _PAUSE_MOST)
        # After the pause it tries again: forget part of what failed.
        w.rejected = min(w.rejected, w.accepted + 1)

    def forget(self, req: Req) -> None:
        self._writers.pop(req.rid, None)

    def reset(self) -> None:
        self._writers.clear()

    def _writer(self, req: Req) -> _Writer:
        """The request's writer, with every token it has written to the store."""
        tokens = req.tokens
        store = self.store
        w = self._writers.get(req.rid)
        if w is None or w.generation != store.generation:  # new, or the store pruned since
            written = max(len(tokens) - _WRITE_FIRST, 0) if w is None else w.written
            w = self._writers[req.rid] = w or _Writer([], store.generation, written)
            w.cursor, w.generation = store.cursor(tokens[:written]), store.generation
        for token in tokens[w.written :]:
            w.cursor = store.extend(w.cursor, token)
        w.written = len(tokens)
        if w.generation != store.generation:  # pruned while writing
            w.cursor, w.generation = store.cursor(tokens), store.generation
        return w


def tree_depth(parents: list[int]) -> int:
    """The depth of a draft tree given by its nodes' parents (-1: the fed token)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return max(depth, default=0)


def make_speculation(settings: SpeculativeSettings) -> NoSpeculation:
    """The scheduler's speculation collaborator for these settings."""
    if settings.speculative_algorithm == "NGRAM":
        return NgramSpeculation(settings)
    return NoSpeculation()
