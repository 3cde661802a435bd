"""The engines a tokenizer replica has heard from, dropped when they fall silent."""

from __future__ import annotations

import time
from dataclasses import dataclass

from radixmesh.proto import mesh_pb2 as mpb


@dataclass
class EngineEntry:
    """An engine's last heartbeat and when it arrived (monotonic seconds)."""

    status: mpb.EngineStatus
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

    def status(self, engine_id: str) -> mpb.EngineStatus:
        """The engine's last heartbeat."""
        return self._engines[engine_id].status

    def heard(self, status: mpb.EngineStatus, now: float | None = None) -> bool:
        """Record a heartbeat; True when the engine is new."""
        new = status.engine_id not in self._engines
        self._engines[status.engine_id] = EngineEntry(status, _now(now))
        return new

    def remove(self, engine_id: str) -> None:
        """Forget one engine."""
        self._engines.pop(engine_id, None)

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


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
