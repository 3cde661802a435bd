"""Speculative decoding's drafts: an n-gram store over the tokens the engine has seen, the
draft trees grown from it, and how much each request drafts.

The scheduler asks `draft(req)` for a tree of guesses at a decoding request's next tokens;
the model runner verifies the tree in one forward and reports the accepted path. Every token
a request has (prompt and output) goes into one trie of bounded depth shared by the engine's
requests, so a request drafts from its own text and from what the others wrote. A request
whose drafts keep failing drafts less, then pauses, so text with nothing to copy runs as
plain decode steps. `NoSpeculation` is the scheduler's collaborator when speculation is off.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import NamedTuple

from radixmesh.core.settings import SpeculativeSettings
from radixmesh.engine.request import Req

# A request whose drafts failed this many times in a row at one token pauses drafting for
# _PAUSE_FIRST plain steps, doubling up to _PAUSE_MOST while the failures go on.
_FAILS_BEFORE_PAUSE = 2
_PAUSE_FIRST = 4
_PAUSE_MOST = 64


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
    budget: int  # draft tokens it may propose next
    fails: int = 0  # verifies in a row that accepted nothing at a budget of one
    pause: int = 0  # plain steps to take before drafting again
    next_pause: int = _PAUSE_FIRST


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

    def __init__(self) -> None:
        self.stats = SpeculationStats()

    def drafts(self, req: Req) -> bool:
        """Whether to draft for the request at this step (asked once a step it decodes in):
        it then waits out a step in flight, whose token its draft starts from."""
        return False

    def draft(self, req: Req, limit: int) -> Draft | None:
        """A draft tree of at most `limit` tokens after the request's last token, or None."""
        return None

    def verified(self, req: Req, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens accepted `accepted` of them."""

    def forget(self, req: Req) -> None:
        """The request is done."""

    def reset(self) -> None:
        """The engine starts over (its requests are gone)."""


class NgramSpeculation(NoSpeculation):
    """Drafts from an NgramStore, adapting each request's draft size to how its drafts fare."""

    def __init__(self, settings: SpeculativeSettings) -> None:
        super().__init__()
        self.settings = settings
        self.store = NgramStore(
            settings.speculative_ngram_max_trie_depth, settings.speculative_ngram_capacity
        )
        self._writers: dict[str, _Writer] = {}

    def drafts(self, req: Req) -> bool:
        w = self._writers.get(req.rid)
        if w is not None and w.pause:
            w.pause -= 1
            return False
        return True

    def draft(self, req: Req, limit: int) -> Draft | None:
        if limit < 1:
            return None
        w = self._writer(req)
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
            min(limit, w.budget),
            _root_breadth(s, window),
            s.speculative_ngram_min_bfs_breadth,
            s.speculative_ngram_branch_length,
            s.speculative_ngram_match_type == "PROB",
        )
        return draft if draft.tokens else None

    def verified(self, req: Req, drafted: int, accepted: int) -> None:
        self.stats.verify_steps += 1
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        w = self._writers.get(req.rid)
        if w is None:
            return
        if accepted:
            w.fails, w.next_pause = 0, _PAUSE_FIRST
            w.budget = min(self.settings.speculative_num_draft_tokens, max(w.budget, 2 * accepted))
            return
        if w.budget > 1:
            w.budget //= 2
            return
        w.fails += 1
        if w.fails >= _FAILS_BEFORE_PAUSE:
            w.pause, w.fails = w.next_pause, 0
            w.next_pause = min(2 * w.next_pause, _PAUSE_MOST)

    def forget(self, req: Req) -> None:
        self._writers.pop(req.rid, None)

    def reset(self) -> None:
        self._writers.clear()

    def _writer(self, req: Req) -> _Writer:
        """The request's writer, with every token it has written to the store."""
        tokens = req.tokens
        store = self.store
        w = self._writers.get(req.rid)
        if w is None:
            w = _Writer([], store.generation, 0, self.settings.speculative_num_draft_tokens)
            self._writers[req.rid] = w
        if w.generation != store.generation:  # the store pruned since: find its place again
            w.cursor, w.generation = store.cursor(tokens[: w.written]), store.generation
        for token in tokens[w.written :]:
            w.cursor = store.extend(w.cursor, token)
        w.written = len(tokens)
        if w.generation != store.generation:  # pruned while writing
            w.cursor, w.generation = store.cursor(tokens), store.generation
        return w


def make_speculation(settings: SpeculativeSettings) -> NoSpeculation:
    """The scheduler's speculation collaborator for these settings."""
    if settings.speculative_algorithm == "NGRAM":
        return NgramSpeculation(settings)
    return NoSpeculation()
