"""The engines this tokenizer replica knows, as they announce themselves on NATS: their
heartbeats keep the registry and the router current (load, disaggregation role), their
cache events the router's view of what each caches. An engine that says it is down, comes
back as another process or falls silent is routed around at once; the requests sent to one
that restarted or fell silent end (their readers retry those that had no output yet), while
one that is down ends its requests itself."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from nats.aio.msg import Msg

from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.tokenizer import metrics
from radixmesh.services.tokenizer.flights import Flights
from radixmesh.services.tokenizer.router import EngineRegistry, EngineStatus, Router

log = logging.getLogger("radixmesh.tokenizer.mesh")


class Membership:
    """Keeps `engines` and `router` in step with the engines' announcements; `flights`
    hears of the engines lost."""

    def __init__(self, engines: EngineRegistry, router: Router, flights: Flights) -> None:
        self.engines = engines
        self.router = router
        self._flights = flights
        self._changed = asyncio.Condition()

    async def wait_for(self, count: int, timeout_s: float) -> None:
        """Block until at least `count` engines are known."""
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(self.engines) >= count), timeout_s
            )

    async def on_status(self, msg: Msg) -> None:
        """An engine's heartbeat."""
        status = _status_from_proto(mpb.EngineStatus.FromString(msg.data))
        if not status.engine_id:
            return
        if status.down:  # lost its workers: it ends its requests itself, route around it
            if self.engines.forget(status.engine_id):
                log.warning("engine %s is down; routing around it", status.engine_id)
                self.router.remove_engine(status.engine_id)
                await self._members_changed()
            return
        heard = self.engines.heard(status)
        if heard == "restarted":  # the requests sent to the one before are lost
            log.warning("engine %s restarted", status.engine_id)
            self.router.remove_engine(status.engine_id)
            self._flights.engine_lost(status.engine_id, f"engine {status.engine_id} restarted")
        self.router.update_engine(status.engine_id, status.running + status.waiting,
                                  status.role)
        if heard:
            log.info("engine %s joined (context %d)", status.engine_id, status.context_length)
            await self._members_changed()

    async def on_cache_event(self, msg: Msg) -> None:
        """What an engine cached or flushed, for the router's view of it."""
        event = mpb.CacheEvent.FromString(msg.data)
        if event.flushed:
            self.router.flush(event.engine_id)
        for seq in event.inserted:
            self.router.record_cached(event.engine_id, seq.token_ids, seq.cache_salt)

    async def expire(self) -> None:
        """Drop the engines silent for longer than the registry's timeout."""
        gone = self.engines.expire()
        for engine_id in gone:
            log.warning("engine %s fell silent; dropping it", engine_id)
            self.router.remove_engine(engine_id)
            self._flights.engine_lost(engine_id, f"engine {engine_id} went away")
        if gone:
            await self._members_changed()

    async def _members_changed(self) -> None:
        metrics.ENGINES.set(len(self.engines))
        async with self._changed:
            self._changed.notify_all()


def _status_from_proto(msg: mpb.EngineStatus) -> EngineStatus:
    """An engine's heartbeat as the registry keeps it."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(EngineStatus)}
    # Repeated fields (the adapters' names) as tuples, not protobuf containers.
    return EngineStatus(**{name: value if isinstance(value, str | int | float) else tuple(value)
                           for name, value in values.items()})
