"""Keeps an engine's host KV tier attached to its owner (cachectl, over gRPC or in process).

It opens the host pool when the engine starts, tells the owner which host slots the
scheduler holds, and when the owner fails (down, restarted, unreachable) the engine carries
on from the device tier alone: the scheduler forgets the host tier, a warning is logged,
and the pool is opened again, fresh, once the owner answers. No request fails because of
the host tier."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from radixmesh.core.hicache import HostTierClient, KVGeometry, host_pool_slots
from radixmesh.core.settings import HiCacheSettings
from radixmesh.services.scheduler.engine_loop import EngineLoop
from radixmesh.services.scheduler.scheduler import Scheduler

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
        self.attached = False
        self.failures = 0  # times the owner was lost
        self._changes: asyncio.Queue[tuple[bool, list[int]] | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the pool (or keep trying in the background) and report slot changes."""
        await self._open()
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._report())]

    def report(self, scheduler: Scheduler) -> None:
        """Queue the host slots the scheduler took and freed since the last call, for the
        owner (call between steps)."""
        if scheduler.host is not None:
            for change in scheduler.host.take_changes():
                self._changes.put_nowait(change)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(OSError):
            await self.client.close()

    async def _open(self) -> None:
        try:
            spec = await self.client.open(self.engine_id, self.geometry, self.num_slots,
                                          self.layout)
        except OSError as exc:
            log.warning("host tier unavailable (%s); serving from the device tier", exc)
            return
        self._drain()
        self.attached = True
        self.loop.apply(lambda sched: sched.attach_host(spec))
        log.info(
            "host tier of %d slots (%.2f GB, %s) at %s", spec.num_slots, spec.nbytes / 1e9,
            spec.layout, spec.path,
        )

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
