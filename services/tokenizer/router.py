"""Cache-aware routing: send a prompt where its prefix is probably cached, unless that
would pile work on an engine much busier than the others."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from radixmesh.services.tokenizer.prefix_tree import PrefixTree


@dataclass(frozen=True)
class RouterConfig:
    """When a cached prefix outweighs load, and how much each engine's tree may hold."""

    cache_threshold: float = 0.5  # share of the prompt that must match to follow the cache
    balance_abs_threshold: int = 32  # loads this close (in requests) count as balanced
    balance_rel_threshold: float = 1.5  # ... or the busiest within this factor of the idlest
    max_tree_tokens: int = 1 << 20  # per engine


class Route(NamedTuple):
    """Where a request goes and how much of its prompt that engine probably has cached."""

    engine_id: str
    matched_tokens: int


class _Engine:
    """What the router knows of one engine."""

    __slots__ = ("tree", "reported_load", "sent_since")

    def __init__(self, max_tree_tokens: int) -> None:
        self.tree = PrefixTree(max_tree_tokens)
        self.reported_load = 0  # running + waiting in its last heartbeat
        self.sent_since = 0  # requests this router sent it after that heartbeat

    @property
    def load(self) -> int:
        return self.reported_load + self.sent_since


class Router:
    """Picks an engine per request from approximate per-engine prefix trees and load."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._engines: dict[str, _Engine] = {}

    @property
    def engine_ids(self) -> list[str]:
        """Known engines, in the order they appeared."""
        return list(self._engines)

    def update_engine(self, engine_id: str, load: int) -> None:
        """A heartbeat: the engine exists and has `load` requests running or waiting."""
        engine = self._engines.get(engine_id)
        if engine is None:
            engine = self._engines[engine_id] = _Engine(self.config.max_tree_tokens)
        engine.reported_load = load
        engine.sent_since = 0

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

    def route(self, tokens: Sequence[int], namespace: str = "") -> Route:
        """Choose an engine for a prompt and count the request against it."""
        if not self._engines:
            raise LookupError("no engine is known")
        engines = self._engines
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
                chosen = self._least_loaded()
            matched = matches[chosen]
        else:
            chosen = self._least_loaded()
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

    def _least_loaded(self) -> str:
        # Among equally loaded engines the emptiest tree has the most room to cache.
        return min(self._engines, key=lambda eid: (self._engines[eid].load,
                                                   self._engines[eid].tree.size))
