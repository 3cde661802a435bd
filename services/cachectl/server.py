"""The cachectl service: gRPC Open / Record / Forget / GetStats over the engines' host
segments, Store / Query / Prefetch between them and the storage tier, gRPC health, and
/health + /metrics over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from radixmesh.core.service_settings import CachectlConfig
from radixmesh.engine.stores.host_pool import CLOSE_FLUSH_S, HostSegments, NoSegment
from radixmesh.engine.stores.storage import StorageBackend, open_backend
from radixmesh.mesh.service import StatusServer
from radixmesh.proto import cache_pb2 as cpb
from radixmesh.proto import cache_pb2_grpc as cgrpc
from radixmesh.proto.convert import (
    geometry_from_proto,
    segment_to_proto,
)
from radixmesh.services.cachectl import metrics

log = logging.getLogger("radixmesh.cachectl")

SERVICE_NAME = cpb.DESCRIPTOR.services_by_name["Cachectl"].full_name
STOP_GRACE_S = 2.0


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End an RPC with the status that says whose the fault is."""
    if isinstance(exc, ValueError):
        code = grpc.StatusCode.INVALID_ARGUMENT
    elif isinstance(exc, NoSegment):
        code = grpc.StatusCode.FAILED_PRECONDITION
    elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        code = grpc.StatusCode.INTERNAL
    await context.abort(code, str(exc))


class CachectlService(cgrpc.CachectlServicer):
    """One cachectl: the segments of the engines it serves (in practice one), over gRPC."""

    def __init__(self, config: CachectlConfig) -> None:
        self.config = config
        self.segments = HostSegments(config.shm_dir, stats=metrics.StorageMetrics())
        self.port = 0
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server()
        cgrpc.add_CachectlServicer_to_server(self, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._status = StatusServer(config.host, config.metrics_port, self._check)
        self._serving = False

    async def start(self) -> None:
        """Connect to the storage tier, if any, then serve (SERVING at once). A storage tier
        that cannot be reached at start is logged and left out: the host tier still serves."""
        c = self.config
        if c.hicache_storage_backend:
            self.segments.storage = await self._open_storage()
        self.port = self._server.add_insecure_port(f"{c.host}:{c.port}")
        await self._server.start()
        await self._status.start()
        self._serving = True
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("cachectl: gRPC on %s:%d, /metrics on %s:%d, segments in %s, storage %s",
                 c.host, self.port, c.host, self._status.port, c.shm_dir,
                 f"{c.hicache_storage_backend} {c.storage_config}"
                 if self.segments.storage else "none")

    async def _open_storage(self) -> StorageBackend | None:
        c = self.config
        assert c.hicache_storage_backend is not None
        try:
            return await open_backend(c.hicache_storage_backend, c.storage_config, c.nats_url)
        except OSError as exc:
            log.warning("storage tier %s unreachable (%s): serving the host tier alone",
                        c.hicache_storage_backend, exc)
            return None

    async def stop(self) -> None:
        """Stop serving, then unlink every segment (a worker's mapping outlives the file)."""
        if self._serving:
            self._serving = False
            await self._health.enter_graceful_shutdown()
            await self._server.stop(STOP_GRACE_S)
            await self._status.stop()
        engines = self.segments.engines()
        if self.segments.storage is not None:
            await asyncio.gather(*(
                self.segments.mover(e).flush(CLOSE_FLUSH_S) for e in engines
                if self.segments.spec(e).storage
            ))
        self.segments.close()
        for engine_id in engines:
            metrics.show(self.segments, engine_id)
        if self.segments.storage is not None:
            with contextlib.suppress(OSError):
                await self.segments.storage.close()

    def _check(self) -> tuple[bool, dict[str, Any]]:
        return self._serving, {"engines": self.segments.engines()}

    # ---- RPCs -----------------------------------------------------------------------------

    async def Open(
        self, request: cpb.OpenRequest, context: grpc.aio.ServicerContext
    ) -> cpb.HostPool:
        """A fresh segment for the engine."""
        try:
            spec = self.segments.open(
                request.engine_id,
                geometry_from_proto(request.geometry),
                request.num_slots,
                request.layout,
                request.storage_page_tokens,
            )
        except (ValueError, OSError) as exc:
            log.warning("engine %s: cannot open a host segment: %s", request.engine_id, exc)
            # A failed open may have unlinked the engine's previous segment already.
            metrics.show(self.segments, request.engine_id)
            await _abort(context, exc)
        metrics.show(self.segments, request.engine_id)
        return segment_to_proto(spec)

    async def Record(
        self, request: cpb.PagesRequest, context: grpc.aio.ServicerContext
    ) -> cpb.PagesReply:
        """Host slots the engine's scheduler now holds."""
        return await self._pages(request, context, "record")

    async def Forget(
        self, request: cpb.PagesRequest, context: grpc.aio.ServicerContext
    ) -> cpb.PagesReply:
        """Host slots the engine's scheduler no longer holds."""
        return await self._pages(request, context, "forget")

    async def _pages(
        self, request: cpb.PagesRequest, context: grpc.aio.ServicerContext, op: str
    ) -> cpb.PagesReply:
        """Record ("record") or forget ("forget") host slots, and the segment's use after."""
        mark = self.segments.record if op == "record" else self.segments.forget
        engine_id = request.engine_id
        try:
            repeated = mark(engine_id, request.slots)
        except (ValueError, NoSegment) as exc:
            await _abort(context, exc)
        metrics.repeated(engine_id, op, repeated)
        metrics.show(self.segments, engine_id)
        used = self.segments.stats(engine_id).used_slots
        return cpb.PagesReply(used_slots=used, repeated=repeated)

    async def GetStats(
        self, request: cpb.StatsRequest, context: grpc.aio.ServicerContext
    ) -> cpb.Stats:
        """The engine's segment: its size and use."""
        try:
            stats = self.segments.stats(request.engine_id)
        except NoSegment as exc:
            await _abort(context, exc)
        return cpb.Stats(
            num_slots=stats.num_slots,
            used_slots=stats.used_slots,
            segment_bytes=stats.nbytes,
            repeated=stats.repeated,
        )

    async def Store(
        self, request: cpb.StoreRequest, context: grpc.aio.ServicerContext
    ) -> cpb.StoreReply:
        """Copy host pages out and queue them for storage."""
        pages = [(page.key, list(page.slots)) for page in request.pages]
        try:
            accepted = self.segments.store(request.engine_id, pages)
        except (ValueError, NoSegment) as exc:
            await _abort(context, exc)
        return cpb.StoreReply(accepted=accepted)

    async def Query(
        self, request: cpb.QueryRequest, context: grpc.aio.ServicerContext
    ) -> cpb.QueryReply:
        """How many leading keys storage holds."""
        try:
            hits = await self.segments.query(request.engine_id, list(request.keys))
        except NoSegment as exc:
            await _abort(context, exc)
        return cpb.QueryReply(hits=hits)

    async def Prefetch(
        self, request: cpb.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[cpb.PrefetchProgress]:
        """Pages from storage into host slots, with the count arrived after each."""
        try:
            pages = self.segments.prefetch(request.engine_id, list(request.keys),
                                           list(request.slots))
        except NoSegment as exc:
            await _abort(context, exc)
        try:
            async for arrived in pages:
                yield cpb.PrefetchProgress(arrived=arrived)
        except ValueError as exc:
            await _abort(context, exc)
