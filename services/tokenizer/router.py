"""Which engines this replica knows and where each request goes.

The registry keeps each engine's last heartbeat and drops engines that fall silent. The
router sends a prompt where its prefix is probably cached, unless that would pile work on an
engine much busier than the others; what an engine caches it guesses with a bounded token
radix tree per engine, fed by the requests it routed and the engines' cache events."""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from radixmesh.core.model_info import MODEL_SHAPE, model_shape
from radixmesh.core.service_settings import RouterSettings

# A full tree is cut to this share of its bound, so the cost of a full scan is spread over
# many inserts.
_LOW_WATER = 0.9

# ---- the router ------------------------------------------------------------------------------


class Route(NamedTuple):
    """Where a request goes and how much of its prompt that engine probably has cached;
    with prefill/decode disaggregation, `engine_id` is the decode engine and
    `prefill_engine` the one that computes the prompt's KV."""

    engine_id: str
    matched_tokens: int
    prefill_engine: str = ""


class _Engine:
    """What the router knows of one engine."""

    __slots__ = ("tree", "reported_load", "sent_since", "role")

    def __init__(self, max_tree_tokens: int) -> None:
        self.tree = PrefixTree(max_tree_tokens)
        self.role = "null"  # its disaggregation mode
        self.reported_load = 0  # running + waiting in its last heartbeat
        self.sent_since = 0  # requests this router sent it after that heartbeat

    @property
    def load(self) -> int:
        return self.reported_load + self.sent_since


class Router:
    """Picks an engine per request from approximate per-engine prefix trees and load."""

    def __init__(self, config: RouterSettings | None = None) -> None:
        self.config = config or RouterSettings()
        self._engines: dict[str, _Engine] = {}

    @property
    def engine_ids(self) -> list[str]:
        """Known engines, in the order they appeared."""
        return list(self._engines)

    def update_engine(self, engine_id: str, load: int, role: str = "null") -> None:
        """A heartbeat: the engine exists, in a disaggregation role, and has `load`
        requests running or waiting."""
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine(self.config.max_tree_tokens)
        engine.reported_load = load
        engine.sent_since = 0
        engine.role = role or "null"

    def remove_engine(self, engine_id: str) -> None:
        """The engine went away; forget it."""
        self._engines.pop(engine_id, None)

    def load(self, engine_id: str) -> int:
        """Requests the engine has by its last heartbeat plus those sent to it since."""
        return self._engines[engine_id].load

    def tree_size(self, engine_id: str) -> int:
        """Tokens the router believes the engine has cached."""
        return self._engines[engine_id].tree.size

    def record_cached(self, engine_id: str, tokens: Sequence[int], namespace: str = "") -> None:
        """The engine reported caching `tokens`."""
        engine = self._engines.get(engine_id)
        if engine is not None:
            engine.tree.insert(tokens, namespace)

    def flush(self, engine_id: str) -> None:
        """The engine dropped its whole cache."""
        engine = self._engines.get(engine_id)
        if engine is not None:
            engine.tree.clear()

    def route(self, tokens: Sequence[int], namespace: str = "", whole: bool = False) -> Route:
        """Choose an engine for a prompt and count the request against it. While prefill and
        decode engines are both up, a prefill engine and a decode engine, each the one its
        cache and load favour (so a conversation's turns meet their history on both), but
        for a request run `whole` (an embedding: nothing to hand over) a decode engine that
        prefills it itself; otherwise any engine, which then does both."""
        if not self._engines:
            raise LookupError("no engine is known")
        prefill = {k: e for k, e in self._engines.items() if e.role == "prefill"}
        decode = {k: e for k, e in self._engines.items() if e.role == "decode"}
        if prefill and decode and whole:
            return self._pick(decode, tokens, namespace)
        if prefill and decode:
            first = self._pick(prefill, tokens, namespace)
            return self._pick(decode, tokens, namespace)._replace(prefill_engine=first.engine_id)
        return self._pick(self._engines, tokens, namespace)

    def _pick(self, engines: dict[str, _Engine], tokens: Sequence[int], namespace: str
              ) -> Route:
        loads = [e.load for e in engines.values()]
        if self._balanced(max(loads), min(loads)):
            matches = {eid: e.tree.match(tokens, namespace) for eid, e in engines.items()}
            best = max(matches.values())
            if tokens and best / len(tokens) >= self.config.cache_threshold:
                chosen = min(
                    (eid for eid, m in matches.items() if m == best),
                    key=lambda eid: engines[eid].load,
                )
            else:
                chosen = self._least_loaded(engines)
            matched = matches[chosen]
        else:
            chosen = self._least_loaded(engines)
            matched = engines[chosen].tree.match(tokens, namespace)
        engine = engines[chosen]
        engine.tree.insert(tokens, namespace)
        engine.sent_since += 1
        return Route(chosen, matched)

    def _balanced(self, highest: int, lowest: int) -> bool:
        cfg = self.config
        return (
            highest - lowest <= cfg.balance_abs_threshold
            or highest <= cfg.balance_rel_threshold * lowest
        )

    @staticmethod
    def _least_loaded(engines: dict[str, _Engine]) -> str:
        # Among equally loaded engines the emptiest tree has the most room to cache.
        return min(engines, key=lambda eid: (engines[eid].load, engines[eid].tree.size))


# ---- the router's guess at one engine's prefix cache -----------------------------------------


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
    """Token sequences an engine probably holds, at most `max_tokens` of them in all: a token
    radix tree per cache-salt namespace, least recently used leaves dropped first."""

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


# ---- the engines heard from ------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStatus:
    """An engine's heartbeat (mesh.proto's EngineStatus, twice a second): discovery and load
    for routing."""

    engine_id: str
    running: int = 0
    waiting: int = 0
    num_slots: int = 0
    free_slots: int = 0
    cached_tokens: int = 0
    context_length: int = 0
    vocab_size: int = 0
    model_path: str = ""
    uptime_s: float = 0.0
    down: bool = False  # lost its workers: takes no requests until they are back
    instance: str = ""  # random per scheduler process: a new one is a restart
    role: str = ""  # its disaggregation mode: "null", "prefill" or "decode"
    architecture: str = ""  # the model family ("llama", "qwen3_moe", ...)
    num_experts: int = 0  # experts per sparse layer (0: a dense model)
    num_experts_per_tok: int = 0
    lora_names: tuple[str, ...] = ()  # the LoRA adapters it serves
    hidden_size: int = 0  # the width of the model's final hidden states


@dataclass
class EngineEntry:
    """An engine's last heartbeat and when it arrived (monotonic seconds)."""

    status: EngineStatus
    last_seen: float


class EngineRegistry:
    """Engine id -> last heartbeat; an engine silent for `timeout_s` is gone."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._engines: dict[str, EngineEntry] = {}

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._engines

    def __len__(self) -> int:
        return len(self._engines)

    @property
    def ids(self) -> list[str]:
        """Known engines, in the order they appeared."""
        return list(self._engines)

    def status(self, engine_id: str) -> EngineStatus:
        """The engine's last heartbeat."""
        return self._engines[engine_id].status

    def heard(self, status: EngineStatus, now: float | None = None) -> str:
        """Record a heartbeat: "new" (an engine not known), "restarted" (another scheduler
        process under a known id) or "" (known)."""
        known = self._engines.get(status.engine_id)
        self._engines[status.engine_id] = EngineEntry(status, _now(now))
        if known is None:
            return "new"
        return "restarted" if known.status.instance != status.instance else ""

    def forget(self, engine_id: str) -> bool:
        """Drop an engine now (it said it is down); whether it was known."""
        return self._engines.pop(engine_id, None) is not None

    def expire(self, now: float | None = None) -> list[str]:
        """Forget and return the engines silent for longer than the timeout."""
        cutoff = _now(now) - self.timeout_s
        gone = [eid for eid, e in self._engines.items() if e.last_seen < cutoff]
        for eid in gone:
            del self._engines[eid]
        return gone

    @property
    def context_length(self) -> int:
        """The smallest context length any engine reports, so a request fits anywhere."""
        lengths = [e.status.context_length for e in self._engines.values()]
        return min((n for n in lengths if n > 0), default=0)

    @property
    def vocab_size(self) -> int:
        """The vocabulary size engines report (0 when none does)."""
        return next((e.status.vocab_size for e in self._engines.values() if e.status.vocab_size), 0)

    @property
    def hidden_size(self) -> int:
        """The model's hidden size engines report (0 when none does)."""
        return next((e.status.hidden_size for e in self._engines.values()
                     if e.status.hidden_size), 0)

    def served(self, engine_id: str, lora_names: Sequence[str]) -> None:
        """The LoRA adapters an engine serves now (it said so before its next heartbeat)."""
        entry = self._engines.get(engine_id)
        if entry is not None:
            entry.status = replace(entry.status, lora_names=tuple(lora_names))

    @property
    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters the engines serve."""
        return frozenset(name for e in self._engines.values() for name in e.status.lora_names)

    @property
    def model_shape(self) -> dict[str, Any]:
        """The served model's architecture and experts as engines report them (None each
        until one does)."""
        status = next((e.status for e in self._engines.values() if e.status.architecture), None)
        return dict.fromkeys(MODEL_SHAPE) if status is None else model_shape(status)


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
