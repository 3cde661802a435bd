"""What one engine replica says on NATS: each step's news as the engine loop's sink (token
ids to the detokenizers, finished sequences to the routers' cache view, prompts handed back
to decode engines, the metrics and traces of each), and its status to the routers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import nats
from nats.errors import Error as NatsError

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.model_info import model_shape
from radixmesh.engine.host_link import HostLink
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.scheduler.handoffs import Handoffs
from radixmesh.services.scheduler.mesh_io import StepMessage, UpdateBuilder
from radixmesh.services.scheduler.metrics import SchedulerMetrics
from radixmesh.services.scheduler.request_traces import RequestTraces
from radixmesh.services.scheduler.worker_link import WorkerLink

log = logging.getLogger("radixmesh.scheduler")


class Publisher:
    """The engine loop's sink on NATS, and the engine's status. The service hands it the
    disaggregation handoffs and the host tier's link as they start."""

    def __init__(self, engine_id: str, role: str, nc: nats.NATS, scheduler: Scheduler,
                 link: WorkerLink, metrics: SchedulerMetrics, traces: RequestTraces,
                 stream_interval: int = 1) -> None:
        self.engine_id = engine_id
        self.role = role
        self.nc = nc
        self.scheduler = scheduler
        self.link = link
        self.metrics = metrics
        self.traces = traces
        self.updates = UpdateBuilder(engine_id, stream_interval)
        self.handoffs: Handoffs | None = None
        self.host_link: HostLink | None = None
        self._refused: list[mpb.TokenUpdate] = []  # published with the next step
        self._instance = secrets.token_hex(8)
        self._started = time.monotonic()

    def refuse(self, req: Req, error: Exception) -> None:
        """A request the scheduler could not take (or that the loop never reached)."""
        self.metrics.refused()
        self.metrics.ended(req.rid)
        message = str(error)
        trace = self.traces.sent(req.rid, 0, FinishReason(FinishKind.ABORT, message=message), 0)
        if req.handoff is not None:  # its decode engine prefills it instead
            assert self.handoffs is not None
            self.handoffs.refused(req, message)
            return
        update = self.updates.refusal(req, message, trace)
        if update is not None:
            self._refused.append(update)

    async def publish(self, updated: list[Req]) -> None:
        """Every request's news as one TokenStep; finished sequences to the routers."""
        sched, handoffs = self.scheduler, self.handoffs
        assert handoffs is not None
        step = StepMessage(self.engine_id, self._refused)
        self._refused = []
        cached = mpb.CacheEvent(engine_id=self.engine_id)
        embedded: dict[str, mpb.TextChunks] = {}  # by owner
        updates = self.updates
        now = updates.clock()
        for req in updated:
            if req.finish is None and (req.handoff is not None or not updates.due(req, now)):
                # A prefill engine's request waits for its KV to be on its way; the others
                # for their next update.
                continue
            if req.finish is not None:
                self.metrics.ended(req.rid)
            if req.handoff is not None:  # a prefill engine's request goes back to its decode engine
                handoffs.handed(req)
                cached.inserted.add(cache_salt=req.namespace or "", token_ids=req.input_ids)
                continue
            if req.finish is not None:
                handoffs.ended(req)
            trace = self.traces.sent(req.rid, len(req.output_ids), req.finish, req.cached_tokens)
            if req.embedding is not None and (chunk := updates.embedded(req)) is not None:
                embedded.setdefault(chunk[0], mpb.TextChunks()).chunks.append(chunk[1])
                self.metrics.update(True, len(req.input_ids), req.cached_tokens, 0,
                                    req.finish.kind.value, req.cached_host_tokens,
                                    req.cached_storage_tokens)
                cached.inserted.add(cache_salt=req.namespace or "", token_ids=req.input_ids)
                continue
            sent = updates.add(step, req, trace, self.link.down)
            if sent is None:
                continue
            finish = req.finish.kind.value if req.finish is not None else None
            self.metrics.update(
                sent.first, len(req.input_ids), req.cached_tokens, sent.new_tokens, finish,
                req.cached_host_tokens, req.cached_storage_tokens,
            )
            if sent.first and req.prefetch is not None:
                self.metrics.prefetched(req.prefetch)
            if req.finish is not None:
                cached.inserted.add(cache_salt=req.namespace or "", token_ids=req.tokens)
        if self.host_link is not None:
            self.host_link.report(sched)
        # Before publishing: once a client has its answer, the gauges already show it.
        self.metrics.state(sched)
        try:
            await handoffs.send(sched)
            if step:
                await self.nc.publish(subjects.DETOK, step.to_proto().SerializeToString())
            for owner, chunks in embedded.items():
                await self.nc.publish(owner, chunks.SerializeToString())
            if cached.inserted:
                await self.nc.publish(
                    subjects.cache_events(self.engine_id), cached.SerializeToString()
                )
        except NatsError as exc:  # NATS away too long: the tokenizers end those requests
            log.warning("engine %s: output not sent (%s)", self.engine_id, exc)

    async def flushed(self) -> None:
        """Tell the routers this engine's prefix cache is empty."""
        event = mpb.CacheEvent(engine_id=self.engine_id, flushed=True)
        await self.nc.publish(subjects.cache_events(self.engine_id), event.SerializeToString())

    def status(self) -> None:
        """The engine's load and shape to the routers (and its gauges), while connected."""
        s, info = self.scheduler, self.link.info
        if info is None or not self.nc.is_connected:
            return
        self.metrics.state(s)
        self.metrics.throughput()
        link = self.host_link
        if link is not None:
            self.metrics.host_tier(link.attached, link.failures)
        status = mpb.EngineStatus(
            engine_id=self.engine_id,
            running=s.num_running(),
            waiting=len(s.waiting),
            num_slots=s.config.num_slots,
            free_slots=s.allocator.available(),
            cached_tokens=s.cache.total_size(),
            context_length=s.config.context_length,
            vocab_size=info.vocab_size,
            model_path=info.model_path,
            uptime_s=time.monotonic() - self._started,
            down=self.link.down,
            instance=self._instance,
            role=self.role,
            lora_names=info.lora_names,
            **model_shape(info),
        )
        asyncio.ensure_future(self.nc.publish(subjects.ENGINES, status.SerializeToString()))
