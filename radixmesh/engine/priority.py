"""Priority scheduling (SGLang's --enable-priority-scheduling): the waiting queue by priority
class, the schedule policy ordering each class, and the running requests a more important
arrival preempts when the running batch is full or the KV pool has no room.

Off, it is `NoPriority`: the schedule policy alone orders the queue and nothing is preempted.
A preempted request goes back to the queue the way memory pressure retracts one (the
scheduler's `_retract`): its progress stays a cached prefix, so it resumes without
recomputing it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import groupby
from typing import Protocol

from radixmesh.engine.kv_allocator import KVAllocator
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.schedule_policy import match_key
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.engine.tree_node import TreeNode

# A schedule policy's order of (part of) the waiting queue.
Order = Callable[[list[Req]], list[Req]]


@dataclass
class Capacity:
    """What the running batch can still take in a step, before its decodes are scheduled."""

    seats: int  # admissions max_running_requests still allows
    budget: int  # prompt tokens of the step's prefill budget


class Room(Protocol):
    """The KV room that admission checks will see in a step (an estimate made before it)."""

    def left(self, running: list[Req]) -> float:
        """Room once every running request has grown by a token and kept its reserve."""
        ...

    def admission(self, req: Req, budget: int) -> tuple[int, float]:
        """A waiting request's prompt tokens still to compute, and the room its admission
        takes when `budget` of them may be computed this step."""
        ...

    def retraction(self, req: Req) -> float:
        """The room retracting a running request gives back."""
        ...


class NoPriority:
    """Priority scheduling off: the schedule policy alone, no preemption."""

    def __init__(self) -> None:
        # Running requests preempted so far, by their priority value.
        self.preemptions: Counter[int] = Counter()

    def order(self, waiting: list[Req], policy: Order) -> list[Req]:
        """The waiting requests in admission order."""
        return policy(waiting)

    def victims(
        self,
        waiting: list[Req],
        running: list[Req],
        ready: Callable[[Req], bool],
        capacity: Capacity,
        room: Room,
    ) -> list[Req]:
        """The running requests to retract so that more important waiting ones (those
        `ready` to be admitted) get their seats and KV room this step; counted as
        preemptions, as the scheduler retracts every one it gets."""
        return []

    def stats(self) -> dict[str, int]:
        """Preemptions so far, as /server_info reports them."""
        return {"num_preemptions": sum(self.preemptions.values())}


class PriorityScheduling(NoPriority):
    """Requests ordered by importance first; an arrival at least `threshold` more important
    than a running request may preempt it."""

    def __init__(self, low_values_first: bool, threshold: int) -> None:
        super().__init__()
        self.sign = -1 if low_values_first else 1
        # Equal importance never preempts: two requests would take turns forever.
        self.margin = max(threshold, 1)

    def importance(self, req: Req) -> int:
        """Larger is admitted first and preempted last."""
        return self.sign * req.priority

    def order(self, waiting: list[Req], policy: Order) -> list[Req]:
        # The policy orders each class on its own, so a cache-aware policy still groups
        # shared prefixes, only never across a class boundary.
        ranked = sorted(waiting, key=lambda r: -self.importance(r))
        return [
            req
            for _, members in groupby(ranked, key=self.importance)
            for req in policy(list(members))
        ]

    def victims(
        self,
        waiting: list[Req],
        running: list[Req],
        ready: Callable[[Req], bool],
        capacity: Capacity,
        room: Room,
    ) -> list[Req]:
        if not running or not waiting:
            return []
        # Least important first and, among equals, the newest (running is oldest first),
        # whose retraction throws away the least progress.
        candidates = sorted(reversed(running), key=self.importance)
        if self.importance(max(waiting, key=self.importance)) - self.importance(
            candidates[0]
        ) < self.margin:
            return []
        seats, budget, left = capacity.seats, capacity.budget, room.left(running)
        chosen: list[Req] = []
        floor: int | None = None  # importance of the most important request chosen
        for arrival in sorted(waiting, key=lambda r: (-self.importance(r), r.arrival)):
            rank = self.importance(arrival)
            if budget <= 0 or (floor is not None and rank <= floor):
                # Past the step's prefill budget, or queued behind a request preempted
                # above: a seat or room left for it would readmit that one instead.
                break
            if not ready(arrival):
                continue
            tokens, need = room.admission(arrival, budget)
            taken: list[Req] = []
            freed = 0.0
            rest = (c for c in candidates if c not in chosen)
            while seats + len(taken) < 1 or left + freed < need:
                victim = next(rest, None)
                if victim is None or rank - self.importance(victim) < self.margin:
                    return self._count(chosen)  # it cannot be placed; nor can those after it
                taken.append(victim)
                freed += room.retraction(victim)
            chosen += taken
            seats += len(taken) - 1
            left += freed - need
            budget -= tokens
            if taken:
                floor = max(self.importance(v) for v in chosen)
        return self._count(chosen)

    def _count(self, chosen: list[Req]) -> list[Req]:
        self.preemptions.update(v.priority for v in chosen)
        return chosen


def make_priority(config: SchedulerConfig) -> NoPriority:
    """Priority scheduling as configured; off, an object that changes nothing."""
    if not config.enable_priority_scheduling:
        return NoPriority()
    return PriorityScheduling(config.low_priority_values_first, config.preemption_threshold)


class KVRoom:
    """The scheduler's KV room as its admission check counts it: free slots plus evictable
    cached ones, less a reserve for the running requests' remaining output."""

    def __init__(
        self,
        cache: RadixCache,
        allocator: KVAllocator,
        page_size: int,
        reserve_ratio: float,
        locked: Mapping[str, TreeNode],
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.page = page_size
        self.ratio = reserve_ratio
        self.locked = locked

    def left(self, running: list[Req]) -> float:
        free = self.allocator.available() + self.cache.evictable_size()
        return free - sum(1 + self.ratio * r.remaining_new_tokens() for r in running)

    def admission(self, req: Req, budget: int) -> tuple[int, float]:
        match = self.cache.match_prefix(match_key(req), req.namespace, count_hit=False)
        tokens = req.num_tokens - len(match.slots)
        # Locking its prefix takes the unlocked part of it out of the evictable room.
        held = _tail(match.node, refs=0)
        return tokens, min(tokens, budget) + self.page + held + self.ratio * (
            req.remaining_new_tokens()
        )

    def retraction(self, req: Req) -> float:
        own = len(req.slots) - req.cached_len + len(req.orphans)
        node = self.locked.get(req.rid)
        # Its cached prefix becomes evictable where no other request holds it too.
        shared = 0 if node is None else _tail(node, refs=1)
        return own + shared + 1 + self.ratio * req.remaining_new_tokens()


def _tail(node: TreeNode, refs: int) -> int:
    """Tokens of the nodes from `node` up whose lock count is `refs` (lock counts never
    shrink going up, so these are the deepest part of the path)."""
    tokens = 0
    walk: TreeNode | None = node
    while walk is not None and walk.parent is not None and walk.lock_ref == refs:
        tokens += len(walk.key)
        walk = walk.parent
    return tokens
