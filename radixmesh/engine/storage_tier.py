"""The scheduler's side of the storage (L3) KV tier: which host pages to write to storage,
and which requests wait for their prefix to be fetched from it.

Storage pages are `page_tokens` tokens at fixed offsets of a prefix (page i holds tokens
[i*P, (i+1)*P)), named by PageKeys, so any engine that computes the same prefix names the
same pages. Nothing here does I/O: the tier queues what cachectl should do (stores,
queries, prefetches) and the host link carries it out between steps and reports back.

- Writes follow the host tier's write policy: once a prefix's host backup is done, its
  full pages not yet written go to storage. Their host slots stay allocated until cachectl
  has read them (a store's acknowledgement).
- Prefetch: a waiting request whose prompt continues past its device and host hit by at
  least `threshold` tokens asks storage how many of the following pages it holds. If
  enough, host slots are taken and cachectl fills them page by page while the request
  waits (best_effort: until it would be admitted anyway; wait_complete: until every page
  arrived; timeout: until then or its deadline). The pages arrived by then join the tree as
  host-only nodes and load to the device like any host hit. Pages that arrive later join the
  tree too when the prefetch ends; only then are the slots of missing pages freed."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from radixmesh.core.hicache import PageKeys
from radixmesh.engine.host_tier import HostTier
from radixmesh.engine.radix_cache import RadixCache
from radixmesh.engine.request import Req
from radixmesh.engine.schedule_policy import match_key
from radixmesh.engine.tree_node import TreeNode

_SENT_KEYS = 1 << 20  # keys remembered as written; beyond that the oldest are forgotten


@dataclass
class StoreOp:
    """Pages for cachectl to write to storage: (key, host slots) each."""

    op_id: int
    pages: list[tuple[str, list[int]]]


@dataclass
class QueryOp:
    """Ask storage how many of these pages (from the first on) it holds; `first` is the
    first one's index in the request's prompt."""

    rid: str
    keys: list[str]
    first: int


@dataclass
class PrefetchOp:
    """Pages for cachectl to read into host slots; tokens[start:] is what they hold."""

    op_id: int
    rid: str
    keys: list[str]
    slots: list[int]
    tokens: list[int]
    start: int
    namespace: str | None
    deadline: float
    started: float
    arrived: int = 0
    taken: int = 0  # pages handed to the tree when the request stopped waiting
    done: bool = False


class _Wait(enum.Enum):
    QUERY = "query"  # waits for storage's answer
    PREFETCH = "prefetch"  # waits for pages
    NONE = "none"  # decided: no (more) waiting


@dataclass
class PrefetchOutcome:
    """How a request's prefetch ended, for metrics and its span."""

    policy: str
    pages_asked: int
    pages_arrived: int
    tokens: int  # tokens it added to the tree for the request
    waited_s: float


@dataclass
class StorageStats:
    """Cumulative counts of the storage tier's work as the scheduler sees it."""

    pages_stored: int = 0  # pages sent to cachectl to write
    queries: int = 0
    prefetches: int = 0
    prefetch_pages: int = 0  # pages arrived


class StorageTier:
    """One engine's storage tier behind its host tier."""

    def __init__(
        self,
        cache: RadixCache,
        host: HostTier,
        keys: PageKeys,
        policy: str,
        timeout: float,
        threshold: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.host = host
        self.keys = keys
        self.page = keys.page_tokens
        self.policy = policy
        self.timeout = timeout
        self.threshold = threshold
        self.clock = clock
        self.stats = StorageStats()
        self.stores: list[StoreOp] = []
        self.queries: list[QueryOp] = []
        self.prefetches: list[PrefetchOp] = []
        self._sent: dict[str, None] = {}  # keys written (or read) already, oldest first
        self._storing: dict[int, list[int]] = {}  # store op -> host slots it reads
        self._waits: dict[str, _Wait] = {}
        self._asked: dict[str, float] = {}  # rid -> when its query went out
        self._ops: dict[int, PrefetchOp] = {}
        self._by_rid: dict[str, PrefetchOp] = {}
        self._ids = itertools.count(1)

    # ---- writes ------------------------------------------------------------------------

    def backed_up(self, nodes: Iterable[TreeNode]) -> None:
        """These nodes' host backups are done: write the full pages they complete."""
        for node in nodes:
            if node.parent is None:
                continue  # left the tree since
            for tip in self._host_tips(node):
                if (tip.depth + len(tip.key)) // self.page > node.depth // self.page:
                    self._store_path(tip)

    def stored(self, op_id: int) -> None:
        """cachectl has read the store's slots (it writes on its own from here)."""
        self.host.allocator.release(self._storing.pop(op_id, ()))

    def _host_tips(self, node: TreeNode) -> list[TreeNode]:
        """The deepest nodes below node (itself included) whose whole path down from node
        is backed up on the host."""
        tips, stack = [], [node]
        while stack:
            n = stack.pop()
            below = [c for c in n.children.values() if c.host_slots is not None and not c.backup]
            if below:
                stack.extend(below)
            else:
                tips.append(n)
        return tips

    def _store_path(self, tip: TreeNode) -> None:
        path = []
        n: TreeNode | None = tip
        while n is not None and n.parent is not None:
            path.append(n)
            n = n.parent
        path.reverse()
        tokens: list[int] = []
        host: list[int] = []
        for n in path:
            if n.host_slots is None or n.backup:
                break
            tokens += n.key
            host += n.host_slots
        pages = len(tokens) // self.page
        if not pages:
            return
        keys = self.keys.keys(tokens, self.cache.namespace_of(tip), pages)
        out = []
        for i, key in enumerate(keys):
            if key not in self._sent:
                out.append((key, host[i * self.page : (i + 1) * self.page]))
                self._remember(key)
        if out:
            op = StoreOp(next(self._ids), out)
            slots = [s for _, page in out for s in page]
            self.host.allocator.hold(slots)
            self._storing[op.op_id] = slots
            self.stores.append(op)
            self.stats.pages_stored += len(out)

    def _remember(self, key: str) -> None:
        self._sent[key] = None
        if len(self._sent) > _SENT_KEYS:
            del self._sent[next(iter(self._sent))]

    # ---- prefetch ------------------------------------------------------------------------

    def ask(self, req: Req) -> None:
        """A request arrived: ask storage for its uncached prompt now, so the pages can
        arrive while it queues."""
        if req.rid not in self._waits:
            self._waits[req.rid] = self._query(req)

    def waits(self, req: Req) -> bool:
        """Whether a waiting request must keep waiting for storage; the first call may ask
        storage what it holds. Once it stops waiting, the pages that arrived are in the tree.
        A slow answer to the query counts against the policy like slow pages do."""
        wait = self._waits.get(req.rid)
        if wait is None:
            wait = self._waits[req.rid] = self._query(req)
        if wait is _Wait.QUERY and (
            self.policy == "best_effort"
            or (self.policy == "timeout" and self.clock() >= self._asked[req.rid] + self.timeout)
        ):
            wait = self._waits[req.rid] = _Wait.NONE
        if wait is _Wait.PREFETCH:
            op = self._by_rid[req.rid]
            if not op.done and (
                self.policy == "wait_complete"
                or (self.policy == "timeout" and self.clock() < op.deadline)
            ):
                return True
            self._take(op, req)
            self._waits[req.rid] = _Wait.NONE
        return wait is _Wait.QUERY

    def _query(self, req: Req) -> _Wait:
        key = match_key(req)
        match = self.cache.match_prefix(key, req.namespace, count_hit=False)
        have = len(match.slots) + match.host_len
        first, last = have // self.page, len(key) // self.page
        if last * self.page - have < self.threshold:
            return _Wait.NONE
        keys = self.keys.keys(key, req.namespace, last)[first:]
        self.queries.append(QueryOp(req.rid, keys, first))
        self._asked[req.rid] = self.clock()
        self.stats.queries += 1
        return _Wait.QUERY

    def query_done(self, req: Req | None, query: QueryOp, hits: int) -> None:
        """Storage holds `hits` of the query's pages: fetch them when worth it."""
        asked = self._asked.pop(query.rid, None)
        if req is None or self._waits.get(req.rid) is not _Wait.QUERY or asked is None:
            return  # finished or stopped waiting meanwhile
        self._waits[req.rid] = _Wait.NONE
        key = match_key(req)
        match = self.cache.match_prefix(key, req.namespace, count_hit=False)
        have = len(match.slots) + match.host_len
        start, end = query.first * self.page, (query.first + hits) * self.page
        if end - have < self.threshold:
            return
        slots = self._alloc_host(end - start)
        if slots is None:
            return
        op = PrefetchOp(next(self._ids), req.rid, query.keys[:hits], slots, key[:end], start,
                        req.namespace, asked + self.timeout, asked)
        self._ops[op.op_id] = op
        self._by_rid[req.rid] = op
        self._waits[req.rid] = _Wait.PREFETCH
        self.prefetches.append(op)
        self.stats.prefetches += 1

    def progress(self, op_id: int, arrived: int) -> None:
        if (op := self._ops.get(op_id)) is not None:
            op.arrived = max(op.arrived, arrived)

    def prefetch_done(self, op_id: int, arrived: int) -> None:
        """cachectl writes no more of the prefetch's slots."""
        op = self._ops.get(op_id)
        if op is None:
            return
        op.arrived = max(op.arrived, arrived)
        op.done = True
        self.stats.prefetch_pages += op.arrived
        for key in op.keys[: op.arrived]:  # stored already; a page that failed is rewritten
            self._remember(key)
        if self._by_rid.get(op.rid) is not op:  # the request stopped waiting, or left
            self._settle(op)

    def forget(self, rid: str) -> None:
        """The request finished (or was aborted): nothing waits for its prefetch."""
        self._waits.pop(rid, None)
        self._asked.pop(rid, None)
        op = self._by_rid.pop(rid, None)
        if op is not None and op.done:
            self._settle(op)

    def _take(self, op: PrefetchOp, req: Req) -> None:
        """The request stops waiting: the pages arrived so far join the tree."""
        del self._by_rid[op.rid]
        req.storage_tokens = self._insert(op, 0, op.arrived)
        op.taken = op.arrived
        req.prefetch = PrefetchOutcome(
            self.policy, len(op.keys), op.taken, req.storage_tokens, self.clock() - op.started
        )
        if op.done:
            self._settle(op)

    def _settle(self, op: PrefetchOp) -> None:
        """The prefetch is over and nobody waits for it: pages that arrived after the
        request stopped waiting join the tree too; the slots of missing pages are freed."""
        del self._ops[op.op_id]
        self._insert(op, op.taken, op.arrived)
        self.host.allocator.free(op.slots[op.arrived * self.page :])

    def _insert(self, op: PrefetchOp, first: int, last: int) -> int:
        """Hand pages [first, last) of the prefetch to the tree as host-only nodes; free the
        slots it declines. Returns the tokens it took."""
        if last <= first:
            return 0
        p = self.page
        slots = op.slots[first * p : last * p]
        unused = self.cache.insert_host(
            op.tokens[: op.start + last * p], op.start + first * p, slots, op.namespace
        )
        self.host.allocator.free(unused)
        return len(slots) - len(unused)

    def _alloc_host(self, n: int) -> list[int] | None:
        allocator = self.host.allocator
        slots = allocator.alloc(n)
        if slots is None:
            self.cache.evict_host(n - allocator.available())
            slots = allocator.alloc(n)
        return slots

    def held_slots(self) -> int:
        """Host slots prefetches hold (not yet the tree's, not free)."""
        return sum(len(op.slots) - op.taken * self.page for op in self._ops.values())
