"""The scheduler service: one engine replica's radix cache and batching loop, fed by
NATS, driving its worker ranks over gRPC, sending token ids on to the detokenizers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any

import nats
from nats.aio.msg import Msg

from radixmesh.core.model_files import resolve_model_path, served_name
from radixmesh.core.request import FinishKind, FinishReason, LogprobRequest
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.mesh import subjects
from radixmesh.mesh.service import StatusServer
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import engine_params_from_proto
from radixmesh.services.scheduler.config import SchedulerServiceConfig
from radixmesh.services.scheduler.metrics import SchedulerMetrics
from radixmesh.services.scheduler.request import Req
from radixmesh.services.scheduler.request_traces import RequestTraces
from radixmesh.services.scheduler.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from radixmesh.services.scheduler.updates import UpdateBuilder
from radixmesh.services.scheduler.worker_client import WorkerClient

log = logging.getLogger("radixmesh.scheduler")

HEARTBEAT_S = 0.5


class SchedulerService:
    """Everything runs on one asyncio loop: NATS callbacks only queue work for the loop."""

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self.workers = WorkerClient(config.worker_list)
        self.updates = UpdateBuilder(config.engine_id)
        self.metrics = SchedulerMetrics(config.engine_id)
        self.traces = RequestTraces(config.engine_id)
        self.scheduler: Scheduler | None = None
        self.info: wpb.WorkerInfo | None = None
        self._inbox: deque[tuple[str, Any]] = deque()
        self._refused: list[tuple[str, str]] = []  # (rid, why) to report next publish
        self._wake = asyncio.Event()
        self._stopping = False
        self._started = time.monotonic()
        self._nc: nats.NATS | None = None
        self._status = StatusServer(config.host, config.metrics_port, self._health)

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the workers and NATS, then start taking requests."""
        await self._status.start()
        self.info = await self.workers.connect(self.config.worker_timeout)
        eos = list(self.info.eos_token_ids)
        model_path = resolve_model_path(self.config.model_path)
        tokenizer = Tokenizer.from_path(str(model_path))
        eos = tuple(dict.fromkeys(eos + list(tokenizer.eos_token_ids)))
        context = self.info.max_position_embeddings
        if self.config.context_length:
            context = min(context, self.config.context_length)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_slots=self.info.num_slots,
                page_size=self.config.page_size,
                max_running_requests=self.config.max_running_requests,
                chunked_prefill_size=self.config.chunked_prefill_size,
                schedule_policy=self.config.schedule_policy,
                eviction_policy=self.config.eviction_policy,
                context_length=context,
                eos_token_ids=eos,
            )
        )
        self.metrics.start(served_name(model_path), self.info.num_slots)
        self._nc = await nats.connect(self.config.nats_url, name=f"scheduler-{self.engine_id}")
        nc = self._nc
        await nc.subscribe(
            subjects.engine_generate(self.engine_id),
            queue=subjects.engine_queue(self.engine_id),
            cb=self._on_request,
        )
        await nc.subscribe(subjects.engine_abort(self.engine_id), cb=self._on_abort)
        await nc.subscribe(subjects.engine_control(self.engine_id), cb=self._on_control)
        log.info(
            "scheduler %s ready: %d KV slots, context %d, workers %s, /metrics on %s:%d",
            self.engine_id, self.info.num_slots, context, self.workers.addrs,
            self.config.host, self._status.port,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then finish cleanly."""
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        loop = asyncio.create_task(self._loop())
        await asyncio.wait([loop, asyncio.create_task(stop.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
        self._stopping = True
        self._wake.set()
        try:
            await loop
        finally:
            heartbeat.cancel()
            await self._shutdown()

    async def _shutdown(self) -> None:
        if self._nc is not None and self.scheduler is not None:
            for rid in list(self.scheduler.requests):
                self.scheduler.abort(rid, FinishReason(FinishKind.ABORT, message="engine stopped"))
            await self._publish_updates()
            await self._nc.drain()
        await self.workers.close()
        await self._status.stop()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        ok = self.scheduler is not None and self._nc is not None and self._nc.is_connected
        return ok, {"engine_id": self.engine_id}

    # ---- NATS callbacks: queue work for the loop -----------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        request = mpb.EngineRequest.FromString(msg.data)
        self.traces.received(request, msg.headers)
        self._post("add", request)

    async def _on_abort(self, msg: Msg) -> None:
        abort = mpb.AbortRequest.FromString(msg.data)
        self.traces.aborted(abort, msg.headers)
        self._post("abort", abort)

    async def _on_control(self, msg: Msg) -> None:
        op = json.loads(msg.data or b"{}").get("op")
        done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._post(op, done)
        await msg.respond(json.dumps(await done).encode())

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        self._wake.set()

    # ---- the loop ----------------------------------------------------------------------

    async def _loop(self) -> None:
        sched = self.scheduler
        assert sched is not None
        in_flight: tuple[ScheduledBatch, asyncio.Task[wpb.ForwardResult]] | None = None
        while not self._stopping or in_flight is not None:
            if in_flight is None and not sched.has_work() and not self._inbox:
                self._wake.clear()
                await self._wake.wait()
                if self._stopping:
                    break
            self._drain_inbox()
            batch = self.traces.schedule(sched) if not self._stopping else None
            if batch is not None:
                entries = batch.proto.entries
                self.metrics.batch(sum(len(e.slots) for e in entries), len(entries))
            if self.config.enable_overlap:
                task = asyncio.create_task(self._forward(batch)) if batch else None
                if in_flight is not None:
                    sched.process_result(in_flight[0], await in_flight[1])
                in_flight = (batch, task) if batch is not None and task is not None else None
            elif batch is not None:
                sched.process_result(batch, await self._forward(batch))
            await self._publish_updates()

    async def _forward(self, batch: ScheduledBatch) -> wpb.ForwardResult:
        with self.metrics.forward_timer(), self.traces.forward(batch) as metadata:
            return await self.workers.forward(batch.proto, metadata)

    def _drain_inbox(self) -> None:
        sched = self.scheduler
        assert sched is not None
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "add":
                self._admit(payload)
            elif kind == "abort":
                reason = None
                if payload.HasField("finish") and payload.finish.kind == "stop":
                    reason = FinishReason(FinishKind.STOP, payload.finish.text or None)
                sched.abort(payload.rid, reason)
            elif kind == "flush":
                flushed = sched.flush_cache()
                if flushed and self._nc is not None:
                    event = mpb.CacheEvent(engine_id=self.engine_id, flushed=True)
                    asyncio.ensure_future(
                        self._nc.publish(subjects.cache_events(self.engine_id),
                                         event.SerializeToString())
                    )
                payload.set_result({"success": flushed})
            elif kind == "info":
                payload.set_result(self._server_info())
            elif isinstance(payload, asyncio.Future):
                payload.set_result({"error": f"unknown op {kind!r}"})

    def _admit(self, msg: mpb.EngineRequest) -> None:
        sched = self.scheduler
        assert sched is not None
        self.updates.register(msg.rid, msg.reply_to, msg.detok, msg.detok_context)
        try:
            req = Req(
                rid=msg.rid,
                input_ids=list(msg.input_ids),
                params=engine_params_from_proto(msg.sampling, msg.max_new_tokens),
                seed=msg.sampling.seed,
                namespace=msg.cache_salt or None,
                priority=msg.priority,
                logprobs=LogprobRequest(
                    msg.return_logprob, msg.top_logprobs_num, msg.logprob_start_len
                ),
            )
            sched.add_request(req)
        except ValueError as exc:
            self.metrics.refused()
            self._refused.append((msg.rid, str(exc)))
            return
        self.metrics.admitted(len(req.input_ids))

    async def _publish_updates(self) -> None:
        """Send every request's news as one TokenStep; cached sequences to the routers."""
        sched = self.scheduler
        assert sched is not None and self._nc is not None
        step = mpb.TokenStep()
        cached = mpb.CacheEvent(engine_id=self.engine_id)
        for rid, message in self._refused:
            update = self.updates.refusal(rid, message)
            if update is not None:
                step.updates.append(update)
        self._refused.clear()
        for req in sched.drain_updates():
            update = self.updates.build(req)
            if update is None:
                continue
            finish = req.finish.kind.value if req.finish is not None else None
            self.metrics.update(update.seq == 0, update.cached_tokens, len(update.new_ids), finish)
            step.updates.append(update)
            if req.finish is not None:
                cached.inserted.add(cache_salt=req.namespace or "", token_ids=req.tokens)
        # Before publishing: once a client has its answer, the gauges already show it.
        self.metrics.state(sched)
        self.traces.sent(step.updates)
        if step.updates:
            await self._nc.publish(subjects.DETOK, step.SerializeToString())
        if cached.inserted:
            await self._nc.publish(
                subjects.cache_events(self.engine_id), cached.SerializeToString()
            )

    # ---- status ------------------------------------------------------------------------

    def _server_info(self) -> dict[str, Any]:
        s = self.scheduler
        assert s is not None and self.info is not None
        return {
            "engine_id": self.engine_id,
            **s.stats(),
            "context_length": s.config.context_length,
            "page_size": s.config.page_size,
            "schedule_policy": s.config.schedule_policy,
            "model_path": self.info.model_path,
            "dtype": self.info.dtype,
            "tp_size": self.info.tp_size,
        }

    async def _heartbeat_loop(self) -> None:
        while True:
            self._publish_status()
            await asyncio.sleep(HEARTBEAT_S)

    def _publish_status(self) -> None:
        s = self.scheduler
        if s is None or self._nc is None or self.info is None or not self._nc.is_connected:
            return
        running = s.num_running()
        free = s.allocator.available()
        self.metrics.state(s)
        self.metrics.throughput()
        status = mpb.EngineStatus(
            engine_id=self.engine_id,
            running=running,
            waiting=len(s.waiting),
            num_slots=s.config.num_slots,
            free_slots=free,
            cached_tokens=s.cache.total_size(),
            context_length=s.config.context_length,
            vocab_size=self.info.vocab_size,
            model_path=self.info.model_path,
            uptime_s=time.monotonic() - self._started,
        )
        asyncio.ensure_future(self._nc.publish(subjects.ENGINES, status.SerializeToString()))
