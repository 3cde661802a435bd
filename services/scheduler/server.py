"""The scheduler service: one engine replica's engine loop, fed by NATS, driving its worker
ranks over gRPC (the executor) and sending token ids on to the detokenizers (the sink)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import Awaitable
from typing import Any

import grpc
import nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.hicache import KVGeometry
from radixmesh.core.model_files import model_fingerprint, resolve_model_path, served_name
from radixmesh.core.model_info import model_shape
from radixmesh.core.service_settings import SchedulerServiceConfig
from radixmesh.core.step import StepResult
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.host_link import HostLink
from radixmesh.engine.loop import EngineLoop, ExecutorLost
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.mesh import subjects
from radixmesh.mesh.discovery import TTL_S, Claim, claim_workers, keep_claim
from radixmesh.mesh.service import StatusServer, connect_bus
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.services.scheduler.cachectl_client import CachectlClient
from radixmesh.services.scheduler.handoffs import Handoffs
from radixmesh.services.scheduler.mesh_io import (
    StepMessage,
    UpdateBuilder,
    abort_reason,
    request_from_proto,
)
from radixmesh.services.scheduler.metrics import SchedulerMetrics
from radixmesh.services.scheduler.request_traces import RequestTraces
from radixmesh.services.scheduler.worker_client import WorkerClient

log = logging.getLogger("radixmesh.scheduler")

HEARTBEAT_S = 0.5
WORKER_PING_S = 1.0  # how often the workers are asked whether they are there


class SchedulerService:
    """Everything runs on one asyncio loop. The service is the engine loop's executor
    (gRPC to the workers) and its sink (TokenSteps on NATS)."""

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self.workers = WorkerClient(config.worker_list)
        self.updates = UpdateBuilder(config.engine_id)
        self.metrics = SchedulerMetrics(config.engine_id)
        self.traces = RequestTraces(config.engine_id)
        self.scheduler: Scheduler | None = None
        self.loop: EngineLoop | None = None
        self.host_link: HostLink | None = None
        self.info: wpb.WorkerInfo | None = None
        self.handoffs: Handoffs | None = None  # disaggregation's messages, once started
        self._refused: list[mpb.TokenUpdate] = []  # published with the next step
        self._down = False  # lost its workers; waiting for them to come back
        self._instance = secrets.token_hex(8)
        self._started = time.monotonic()
        self._nc: nats.NATS | None = None
        self._claim: Claim | None = None  # the worker group found on NATS, if not configured
        self._keeping: asyncio.Task[None] | None = None
        self._status = StatusServer(config.host, config.metrics_port, self._health)

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the workers and NATS, then start taking requests."""
        await self._status.start()
        self._nc = await connect_bus(self.config.nats_url, f"scheduler-{self.engine_id}")
        self.info = await self._connect_workers()
        model_path = await asyncio.to_thread(
            resolve_model_path, self.config.model_path, self.config.revision
        )
        tokenizer = Tokenizer.from_path(str(model_path))
        self.scheduler = Scheduler(dataclasses.replace(
            SchedulerConfig.from_settings(
                self.config,
                self.config.page_size,
                self.info.num_slots,
                self.info.max_position_embeddings,
                [*self.info.eos_token_ids, *tokenizer.eos_token_ids],
                model_fingerprint(model_path) if self.config.enable_hierarchical_cache else "",
            ),
            transfer_timeout=self.config.disaggregation_timeout,
        ))
        self.loop = EngineLoop(
            self.scheduler, self, self, not self.config.disable_overlap_schedule, self._scheduled,
            self._workers_lost,
        )
        nc = self._nc
        self.handoffs = Handoffs(
            self.engine_id, self.config.disaggregation_transfer_backend, nc, self.loop,
            self._info, lambda: self.workers.addrs, self.metrics, self.traces,
        )
        await self._start_host_tier()
        self.metrics.start(served_name(model_path), self.info.num_slots)
        await nc.subscribe(
            subjects.engine_generate(self.engine_id),
            queue=subjects.engine_queue(self.engine_id),
            cb=self._on_request,
        )
        await nc.subscribe(subjects.engine_abort(self.engine_id), cb=self._on_abort)
        await nc.subscribe(subjects.engine_control(self.engine_id), cb=self._on_control)
        await nc.subscribe(subjects.engine_kv(self.engine_id), cb=self.handoffs.on_commit)
        await nc.subscribe(subjects.ENGINES, cb=self.handoffs.on_peer)
        log.info(
            "scheduler %s ready: %d KV slots, context %d, workers %s, disaggregation %s "
            "(KV by %s), /metrics on %s:%d",
            self.engine_id, self.info.num_slots, self.scheduler.config.context_length,
            self.workers.addrs, self.config.disaggregation_mode,
            self.config.disaggregation_transfer_backend, self.config.host, self._status.port,
        )

    def _info(self) -> wpb.WorkerInfo:
        assert self.info is not None
        return self.info

    async def _connect_workers(self) -> wpb.WorkerInfo:
        """The configured workers once they answer; without any configured, the first
        group announced on NATS that is free (the one held before, when it is back)."""
        if self.config.worker_list:
            return await self.workers.connect(self.config.worker_timeout)
        assert self._nc is not None
        while True:
            prefer = self._claim.group if self._claim is not None else None
            claim = await claim_workers(self._nc, self.engine_id, prefer,
                                        self.config.disaggregation_mode)
            if self._claim is None or claim.group != self._claim.group:
                await self._release()
                self._claim = claim
                self._keeping = asyncio.create_task(keep_claim(self._nc, claim, self.engine_id))
            await self.workers.retarget(claim.addrs)
            try:  # an announcement outlives a killed worker by up to TTL_S
                return await self.workers.connect(2 * TTL_S)
            except grpc.aio.AioRpcError as exc:
                log.warning("engine %s: worker group %s does not answer (%s)", self.engine_id,
                            claim.group, exc.code())

    async def _release(self) -> None:
        if self._keeping is not None:
            self._keeping.cancel()
            await asyncio.gather(self._keeping, return_exceptions=True)
            self._keeping = None
        self._claim = None

    async def _start_host_tier(self) -> None:
        config, info = self.config, self.info
        assert self.loop is not None and info is not None
        if not config.enable_hierarchical_cache:
            return
        if not config.cachectl_addr:
            log.warning("enable_hierarchical_cache needs cachectl_addr: the host tier is off")
            return
        geometry = KVGeometry(
            info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, config.page_size
        )
        self.host_link = HostLink(
            CachectlClient(config.cachectl_addr), self.loop, self.engine_id, geometry,
            info.num_slots, config,
        )
        self.metrics.token_bytes = geometry.token_bytes
        await self.host_link.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then finish cleanly."""
        assert self.loop is not None
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        watch = asyncio.create_task(self._watch_workers())
        running = asyncio.create_task(self.loop.run())
        await asyncio.wait([running, asyncio.create_task(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        self.loop.stop()
        try:
            await running
        finally:
            heartbeat.cancel()
            watch.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        if self._nc is not None and self.scheduler is not None and self.loop is not None:
            stopped = FinishReason(FinishKind.ABORT, message="engine stopped")
            self.loop.fail_pending(RuntimeError("engine stopped"))
            for rid in list(self.scheduler.requests):
                self.scheduler.abort(rid, stopped)
            await self.publish(self.scheduler.drain_updates())
        await self._release()
        if self._nc is not None:
            await self._nc.drain()
        if self.host_link is not None:
            await self.host_link.close()
        await self.workers.close()
        await self._status.stop()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        ok = self.scheduler is not None and self._nc is not None and self._nc.is_connected
        return ok and not self._down, {"engine_id": self.engine_id, "down": self._down}

    async def _watch_workers(self) -> None:
        """An idle engine notices lost workers too, before a request finds out."""
        assert self.loop is not None
        while True:
            await asyncio.sleep(WORKER_PING_S)
            if self._down:
                continue
            try:
                await self.workers.ping()
            except grpc.aio.AioRpcError as exc:
                if not self._down:
                    self.loop.lose(self._going_down(exc.code().name))

    def _going_down(self, why: str) -> ExecutorLost:
        """Say the engine is down (before its requests' aborts go out, so routers send the
        retries elsewhere); the loss to hand the engine loop."""
        self._down = True
        self._publish_status()
        return ExecutorLost(f"engine {self.engine_id} lost its worker ({why})")

    async def _workers_lost(self, lost: ExecutorLost) -> None:
        """Every request has ended: say so to the routers, then wait for the workers (the
        supervisor restarts them) and start over with an empty cache."""
        log.warning("engine %s lost its workers (%s); waiting for them", self.engine_id, lost)
        if self._nc is not None:
            event = mpb.CacheEvent(engine_id=self.engine_id, flushed=True)
            await self._nc.publish(subjects.cache_events(self.engine_id),
                                   event.SerializeToString())
        if self.host_link is not None:
            self.host_link.reopen()  # the new workers map a fresh host pool
        while True:
            try:
                info = await self._connect_workers()
                break
            except grpc.aio.AioRpcError as exc:
                log.warning("engine %s: workers still away (%s)", self.engine_id, exc.code())
        assert self.scheduler is not None
        if info.num_slots != self.scheduler.config.num_slots:
            raise RuntimeError(
                f"the workers came back with {info.num_slots} KV slots instead of "
                f"{self.scheduler.config.num_slots}: restart the engine"
            )
        self.info = info
        self._down = False
        self._publish_status()
        log.info("engine %s: workers are back; serving with an empty prefix cache",
                 self.engine_id)

    # ---- NATS callbacks: hand work to the engine loop ------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        assert self.loop is not None and self.handoffs is not None
        request = mpb.EngineRequest.FromString(msg.data)
        down = f"engine {self.engine_id} is down (lost its workers)" if self._down else ""
        try:
            req = None if down else request_from_proto(request)
        except ValueError as exc:
            req, down = None, str(exc)
            self.metrics.refused()
        if req is None:  # refused at once, even while down (the loop waits then)
            assert self._nc is not None
            if request.HasField("handoff"):  # its decode engine prefills it instead
                target = subjects.engine_kv(request.handoff.decode_engine)
                payload = mpb.KVCommit(rid=request.rid, prefill_engine=self.engine_id,
                                       error=down).SerializeToString()
            else:
                update = self.updates.rejection(request.rid, request.reply_to, request.detok,
                                                down)
                update.finish.engine_lost = self._down  # sent before the routers heard
                target = subjects.DETOK
                payload = mpb.TokenStep(updates=[update]).SerializeToString()
            await self._nc.publish(target, payload)
            return
        self.traces.received(req, msg.headers)
        self.handoffs.arrived(req, request, msg.headers)
        if req.handoff is None:
            self.updates.register(req, request)
        self.metrics.queued(req)
        self.loop.add(req)

    async def _on_abort(self, msg: Msg) -> None:
        assert self.loop is not None
        abort = mpb.AbortRequest.FromString(msg.data)
        reason = abort_reason(abort)
        self.traces.aborted(abort.rid, reason is not None, msg.headers)
        self.loop.abort(abort.rid, reason)

    async def _on_control(self, msg: Msg) -> None:
        op = json.loads(msg.data or b"{}").get("op")
        if op == "flush":
            reply = {"success": await self._flush()}
        elif op == "info":
            reply = await self._server_info()
        else:
            reply = {"error": f"unknown op {op!r}"}
        await msg.respond(json.dumps(reply).encode())

    async def _flush(self) -> bool:
        assert self.loop is not None and self._nc is not None
        flushed = await asyncio.wrap_future(self.loop.flush())
        if flushed:
            event = mpb.CacheEvent(engine_id=self.engine_id, flushed=True)
            await self._nc.publish(subjects.cache_events(self.engine_id),
                                   event.SerializeToString())
        return flushed

    # ---- the engine loop's executor and sink ----------------------------------------------

    def submit(self, batch: ScheduledBatch) -> Awaitable[StepResult]:
        """Run one step on every worker rank, timed and traced."""
        return asyncio.ensure_future(self._forward(batch))

    async def _forward(self, batch: ScheduledBatch) -> StepResult:
        with self.metrics.forward_timer(), self.traces.forward(batch) as metadata:
            try:
                result = await self.workers.forward(batch.batch, metadata)
            except grpc.aio.AioRpcError as exc:
                raise self._going_down(f"{exc.code().name}: {exc.details()}") from exc
            self.traces.verified(batch, result)
            return result

    def _scheduled(self, batch: ScheduledBatch, started: int, ended: int) -> None:
        self.traces.scheduled(batch, started, ended)
        self.metrics.batch(batch.batch.num_tokens, batch.batch.num_requests)
        self.metrics.admitted(batch)

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
        assert sched is not None and handoffs is not None and self._nc is not None
        step = StepMessage(self.engine_id, self._refused)
        self._refused = []
        cached = mpb.CacheEvent(engine_id=self.engine_id)
        for req in updated:
            if req.finish is not None:
                self.metrics.ended(req.rid)
            if req.handoff is not None:  # a prefill engine's request goes back to its decode engine
                if req.finish is None:
                    continue  # its first token is in; its KV is still on its way
                handoffs.handed(req)
                cached.inserted.add(cache_salt=req.namespace or "", token_ids=req.input_ids)
                continue
            if req.finish is not None:
                handoffs.ended(req)
            trace = self.traces.sent(req.rid, len(req.output_ids), req.finish, req.cached_tokens)
            sent = self.updates.add(step, req, trace, self._down)
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
                await self._nc.publish(subjects.DETOK, step.to_proto().SerializeToString())
            if cached.inserted:
                await self._nc.publish(
                    subjects.cache_events(self.engine_id), cached.SerializeToString()
                )
        except NatsError as exc:  # NATS away too long: the tokenizers end those requests
            log.warning("engine %s: output not sent (%s)", self.engine_id, exc)

    # ---- status ------------------------------------------------------------------------

    async def _server_info(self) -> dict[str, Any]:
        s, loop = self.scheduler, self.loop
        assert s is not None and loop is not None and self.info is not None
        return {
            "engine_id": self.engine_id,
            **await asyncio.wrap_future(loop.info()),
            "context_length": s.config.context_length,
            "page_size": s.config.page_size,
            "schedule_policy": s.config.schedule_policy,
            "disaggregation_mode": self.config.disaggregation_mode,
            "model_path": self.info.model_path,
            "dtype": self.info.dtype,
            "quantization": self.info.quantization,
            "tp_size": self.info.tp_size,
            **model_shape(self.info),
        }

    async def _heartbeat_loop(self) -> None:
        while True:
            self._publish_status()
            if self.scheduler is not None and self.handoffs is not None:
                self.handoffs.expire(self.scheduler)
            await asyncio.sleep(HEARTBEAT_S)

    def _publish_status(self) -> None:
        s = self.scheduler
        if s is None or self._nc is None or self.info is None or not self._nc.is_connected:
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
            vocab_size=self.info.vocab_size,
            model_path=self.info.model_path,
            uptime_s=time.monotonic() - self._started,
            down=self._down,
            instance=self._instance,
            role=self.config.disaggregation_mode,
            **model_shape(self.info),
        )
        asyncio.ensure_future(self._nc.publish(subjects.ENGINES, status.SerializeToString()))
