"""Keeps an engine's host KV tier attached to its owner (cachectl, over gRPC or in process).

It opens the host pool when the engine starts, tells the owner which host slots the
scheduler holds, carries out the storage tier's stores, queries and prefetches, and when
the owner fails (down, restarted, unreachable) the engine carries on from the device tier
alone: the scheduler forgets the host tier, a warning is logged, and the pool is opened
again, fresh, once the owner answers. No request fails because of the host or storage
tier: a storage query that fails finds nothing, and the request computes its prompt."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from radixmesh.core.hicache import HiCacheSettings, HostTierClient, KVGeometry, host_pool_slots
from radixmesh.engine.loop import EngineLoop
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.storage_tier import PrefetchOp, QueryOp, StorageTier, StoreOp

log = logging.getLogger("radixmesh.hicache")

# Between checks of the owner: a ping while attached (so an idle engine notices a lost
# owner too), an attempt to open the pool again while it is away.
WATCH_S = 1.0


class HostLink:
    """The host tier's lifecycle for one engine. Runs on the engine loop's event loop."""

    def __init__(
        self,
        client: HostTierClient,
        loop: EngineLoop,
        engine_id: str,
        geometry: KVGeometry,
        device_slots: int,
        settings: HiCacheSettings,
    ) -> None:
        self.client = client
        self.loop = loop
        self.engine_id = engine_id
        self.geometry = geometry
        self.num_slots = host_pool_slots(
            device_slots, geometry, settings.hicache_ratio, settings.hicache_size
        )
        self.layout = settings.hicache_mem_layout
        self.storage_page_tokens = settings.hicache_storage_page_size
        self.attached = False
        self.failures = 0  # times the owner was lost
        self._changes: asyncio.Queue[tuple[bool, list[int]] | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._storage_calls: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Open the pool (or keep trying in the background) and report slot changes."""
        await self._open()
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._report())]

    def report(self, scheduler: Scheduler) -> None:
        """Queue the host slots the scheduler took and freed since the last call, for the
        owner, and start the storage tier's calls (call between steps)."""
        if scheduler.tiers.host is not None:
            for change in scheduler.tiers.host.take_changes():
                self._changes.put_nowait(change)
        tier = scheduler.tiers.storage
        if tier is None or not self.attached:
            return
        calls = [self._store(tier, op) for op in tier.stores]
        calls += [self._query(tier, op) for op in tier.queries]
        calls += [self._prefetch(tier, op) for op in tier.prefetches]
        tier.stores, tier.queries, tier.prefetches = [], [], []
        for call in calls:
            task = asyncio.create_task(call)
            self._storage_calls.add(task)
            task.add_done_callback(self._storage_calls.discard)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._storage_calls]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(OSError):
            await self.client.close()

    async def _open(self) -> None:
        try:
            spec = await self.client.open(self.engine_id, self.geometry, self.num_slots,
                                          self.layout, self.storage_page_tokens)
        except OSError as exc:
            log.warning("host tier unavailable (%s); serving from the device tier", exc)
            return
        self._drain()
        self.attached = True
        self.loop.apply(lambda sched: sched.attach_host(spec))
        log.info(
            "host tier of %d slots (%.2f GB, %s) at %s, storage tier %s", spec.num_slots,
            spec.nbytes / 1e9, spec.layout, spec.path, spec.storage or "none",
        )

    def reopen(self) -> None:
        """Open a fresh pool soon (the workers that mapped the old one are gone)."""
        self.attached = False
        self._drain()

    def _lost(self, exc: Exception) -> None:
        if not self.attached:
            return
        self.attached = False
        self.failures += 1
        log.warning("host tier lost (%s); serving from the device tier until it is back", exc)
        self.loop.apply(lambda sched: sched.detach_host())
        self._drain()

    def _drain(self) -> None:
        while not self._changes.empty():
            self._changes.get_nowait()

    async def _report(self) -> None:
        while True:
            change = await self._changes.get()
            if not self.attached:
                continue
            try:
                if change is None:
                    await self.client.record([])  # a ping: is the owner still there?
                elif change[0]:
                    await self.client.record(change[1])
                else:
                    await self.client.forget(change[1])
            except (OSError, LookupError) as exc:
                self._lost(exc)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            if self.attached:
                self._changes.put_nowait(None)
            else:
                await self._open()

    # ---- the storage tier's calls (each reports back through the engine loop's inbox) ----

    def _wake_at_deadline(self, tier: StorageTier) -> None:
        """Under the timeout policy a request stops waiting at its deadline, news or not
        (set when its query goes out: a prefetch that follows keeps that deadline)."""
        if tier.policy == "timeout":
            asyncio.get_running_loop().call_later(tier.timeout, self.loop.wake)

    def _back(self, tier: StorageTier, change: Callable[[Scheduler], None]) -> None:
        """Apply a storage reply to the scheduler, unless the tier was replaced since."""
        self.loop.apply(lambda sched: change(sched) if sched.tiers.storage is tier else None)

    async def _store(self, tier: StorageTier, op: StoreOp) -> None:
        try:
            accepted = await self.client.store(op.pages)
        except (OSError, LookupError) as exc:
            self._lost(exc)
            return
        if accepted < len(op.pages):
            log.warning("storage write queue full: %d of %d pages dropped",
                        len(op.pages) - accepted, len(op.pages))
        self._back(tier, lambda sched: tier.stored(op.op_id))

    async def _query(self, tier: StorageTier, op: QueryOp) -> None:
        self._wake_at_deadline(tier)
        try:
            hits = await self.client.query(op.keys)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, the request must go on
            log.warning("storage query failed (%s): computing the prompt", exc)
            hits = 0
        self._back(tier, lambda sched: tier.query_done(sched.requests.get(op.rid), op, hits))

    async def _prefetch(self, tier: StorageTier, op: PrefetchOp) -> None:
        arrived = 0
        try:
            async for arrived in self.client.prefetch(op.keys, op.slots):
                self._back(tier, lambda sched, n=arrived: tier.progress(op.op_id, n))
        except (OSError, LookupError) as exc:
            # Whether cachectl still writes those slots is unknown: drop the host tier.
            self._lost(exc)
            return
        self._back(tier, lambda sched: tier.prefetch_done(op.op_id, arrived))
