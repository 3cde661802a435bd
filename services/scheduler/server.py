"""The scheduler service: one engine replica's engine loop, fed by NATS (requests, aborts,
control), driving its worker ranks over gRPC (WorkerLink, the loop's executor) and saying
what happened on NATS (Publisher, the loop's sink); Handoffs for prefill/decode
disaggregation, HostLink for the host tier."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

import nats
from nats.aio.msg import Msg

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.hicache import KVGeometry
from radixmesh.core.model_files import model_fingerprint, resolve_model_path, served_name
from radixmesh.core.model_info import model_shape
from radixmesh.core.service_settings import SchedulerServiceConfig
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.engine.host_link import HostLink
from radixmesh.engine.loop import EngineLoop, ExecutorLost
from radixmesh.engine.scheduler import ScheduledBatch, Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.mesh import subjects
from radixmesh.mesh.service import StatusServer, connect_bus
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.scheduler.cachectl_client import CachectlClient
from radixmesh.services.scheduler.handoffs import Handoffs
from radixmesh.services.scheduler.mesh_io import abort_reason, request_from_proto
from radixmesh.services.scheduler.metrics import SchedulerMetrics
from radixmesh.services.scheduler.publisher import Publisher
from radixmesh.services.scheduler.request_traces import RequestTraces
from radixmesh.services.scheduler.worker_link import WorkerLink

log = logging.getLogger("radixmesh.scheduler")

HEARTBEAT_S = 0.5


class SchedulerService:
    """Everything runs on one asyncio loop: the engine loop, its executor (WorkerLink) and
    sink (Publisher), and the NATS callbacks that feed it."""

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self.metrics = SchedulerMetrics(config.engine_id)
        self.traces = RequestTraces(config.engine_id)
        self.link = WorkerLink(config, self.metrics, self.traces, self._status)
        self.scheduler: Scheduler | None = None
        self.loop: EngineLoop | None = None
        self.publisher: Publisher | None = None
        self.handoffs: Handoffs | None = None  # disaggregation's messages, once started
        self.host_link: HostLink | None = None
        self._nc: nats.NATS | None = None
        self._status_server = StatusServer(config.host, config.metrics_port, self._health)

    # ---- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Connect to the workers and NATS, then start taking requests."""
        await self._status_server.start()
        self._nc = nc = await connect_bus(self.config.nats_url, f"scheduler-{self.engine_id}")
        info = await self.link.connect(nc)
        model_path = await asyncio.to_thread(
            resolve_model_path, self.config.model_path, self.config.revision
        )
        tokenizer = Tokenizer.from_path(str(model_path))
        self.scheduler = Scheduler(dataclasses.replace(
            SchedulerConfig.from_settings(
                self.config,
                self.config.page_size,
                info.num_slots,
                info.max_position_embeddings,
                [*info.eos_token_ids, *tokenizer.eos_token_ids],
                model_fingerprint(model_path) if self.config.enable_hierarchical_cache else "",
                info.architecture,
                self.config.disaggregation_mode,
                info.state_snapshots,
            ),
            transfer_timeout=self.config.disaggregation_timeout,
            lora_names=frozenset(info.lora_names),
            max_loras_per_batch=info.max_loras_per_batch or SchedulerConfig.max_loras_per_batch,
            lora_pinned=frozenset(info.pinned_loras),
        ))
        self.publisher = Publisher(self.engine_id, self.config.disaggregation_mode, nc,
                                   self.scheduler, self.link, self.metrics, self.traces,
                                   self.config.stream_interval)
        self.loop = EngineLoop(
            self.scheduler, self.link, self.publisher, not self.config.disable_overlap_schedule,
            self._scheduled, self._workers_lost,
        )
        self.handoffs = self.publisher.handoffs = Handoffs(
            self.engine_id, self.config.disaggregation_transfer_backend, nc, self.loop,
            self.link.worker_info, lambda: self.link.addrs, self.metrics, self.traces,
        )
        await self._start_host_tier()
        self.metrics.start(served_name(model_path), info.num_slots)
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
            self.engine_id, info.num_slots, self.scheduler.config.context_length,
            self.link.addrs, self.config.disaggregation_mode,
            self.config.disaggregation_transfer_backend, self.config.host,
            self._status_server.port,
        )

    async def _start_host_tier(self) -> None:
        config, info = self.config, self.link.info
        assert self.loop is not None and self.publisher is not None and info is not None
        if not config.enable_hierarchical_cache:
            return
        if not config.cachectl_addr:
            log.warning("enable_hierarchical_cache needs cachectl_addr: the host tier is off")
            return
        geometry = KVGeometry(
            info.num_layers, info.num_kv_heads, info.head_dim, info.dtype, config.page_size
        )
        self.host_link = self.publisher.host_link = HostLink(
            CachectlClient(config.cachectl_addr), self.loop, self.engine_id, geometry,
            info.num_slots, config,
        )
        self.metrics.token_bytes = geometry.token_bytes
        await self.host_link.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then finish cleanly."""
        assert self.loop is not None
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        watch = asyncio.create_task(self.link.watch(self.loop))
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
        if self.publisher is not None and self.scheduler is not None and self.loop is not None:
            stopped = FinishReason(FinishKind.ABORT, message="engine stopped")
            self.loop.fail_pending(RuntimeError("engine stopped"))
            for rid in list(self.scheduler.requests):
                self.scheduler.abort(rid, stopped)
            await self.publisher.publish(self.scheduler.drain_updates())
        await self.link.release()
        if self._nc is not None:
            await self._nc.drain()
        if self.host_link is not None:
            await self.host_link.close()
        await self.link.close()
        await self._status_server.stop()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        ok = self.scheduler is not None and self._nc is not None and self._nc.is_connected
        down = self.link.down
        return ok and not down, {"engine_id": self.engine_id, "down": down}

    def _status(self) -> None:
        if self.publisher is not None:
            self.publisher.status()

    async def _workers_lost(self, lost: ExecutorLost) -> None:
        """Every request has ended: say so to the routers, then wait for the workers (the
        supervisor restarts them) and start over with an empty cache."""
        log.warning("engine %s lost its workers (%s); waiting for them", self.engine_id, lost)
        assert self.publisher is not None and self.scheduler is not None
        await self.publisher.flushed()
        if self.host_link is not None:
            self.host_link.reopen()  # the new workers map a fresh host pool
        info = await self.link.reconnect()
        if info.num_slots != self.scheduler.config.num_slots:
            raise RuntimeError(
                f"the workers came back with {info.num_slots} KV slots instead of "
                f"{self.scheduler.config.num_slots}: restart the engine"
            )
        self._status()
        log.info("engine %s: workers are back; serving with an empty prefix cache",
                 self.engine_id)

    # ---- NATS callbacks: hand work to the engine loop ------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        assert self.loop is not None and self.handoffs is not None
        assert self.publisher is not None and self._nc is not None
        engine_request = mpb.EngineRequest.FromString(msg.data)
        lost = self.link.down
        down = f"engine {self.engine_id} is down (lost its workers)" if lost else ""
        try:
            req = None if down else request_from_proto(engine_request)
        except ValueError as exc:
            req, down = None, str(exc)
            self.metrics.refused()
        if req is None:  # refused at once, even while down (the loop waits then)
            if engine_request.HasField("handoff"):  # its decode engine prefills it instead
                target = subjects.engine_kv(engine_request.handoff.decode_engine)
                payload = mpb.KVCommit(rid=engine_request.rid, prefill_engine=self.engine_id,
                                       error=down).SerializeToString()
            else:
                update = self.publisher.updates.rejection(
                    engine_request.rid, engine_request.reply_to, engine_request.detok, down)
                update.finish.engine_lost = lost  # sent before the routers heard
                target = subjects.DETOK
                payload = mpb.TokenStep(updates=[update]).SerializeToString()
            await self._nc.publish(target, payload)
            return
        self.traces.received(req, msg.headers)
        self.handoffs.arrived(req, engine_request, msg.headers)
        if req.handoff is None:
            self.publisher.updates.register(req, engine_request)
        self.metrics.queued(req)
        self.loop.add(req)

    async def _on_abort(self, msg: Msg) -> None:
        assert self.loop is not None
        abort = mpb.AbortRequest.FromString(msg.data)
        reason = abort_reason(abort)
        self.traces.aborted(abort.rid, reason is not None, msg.headers)
        self.loop.abort(abort.rid, reason)

    async def _on_control(self, msg: Msg) -> None:
        ask = json.loads(msg.data or b"{}")
        op = ask.get("op")
        if op == "flush":
            reply = {"success": await self._flush()}
        elif op == "info":
            reply = await self._server_info()
        elif op in ("load_lora", "unload_lora"):
            reply = await self._lora(op == "load_lora", str(ask.get("lora_name") or ""),
                                     str(ask.get("lora_path") or ""))
        else:
            reply = {"error": f"unknown op {op!r}"}
        await msg.respond(json.dumps(reply).encode())

    async def _lora(self, load: bool, name: str, path: str) -> dict[str, Any]:
        """Load a LoRA adapter on every worker rank and then take requests for it; or take
        no more requests for one (refused while a request uses it) and then unload it."""
        assert self.loop is not None
        try:
            if load:
                self.link.info = await self.link.client.lora(True, name, path)
                await asyncio.wrap_future(self.loop.call(lambda s: s.adapters.serve(name)))
            else:
                await asyncio.wrap_future(self.loop.call(
                    lambda s: s.adapters.stop(name, s.requests.values())))
                self.link.info = await self.link.client.lora(False, name)
        except ValueError as exc:
            return {"success": False, "error": str(exc)}
        self._status()
        return {"success": True, "lora_names": list(self.link.worker_info().lora_names)}

    async def _flush(self) -> bool:
        assert self.loop is not None and self.publisher is not None
        flushed = await asyncio.wrap_future(self.loop.flush())
        if flushed:
            await self.publisher.flushed()
        return flushed

    def _scheduled(self, batch: ScheduledBatch, started: int, ended: int) -> None:
        self.traces.scheduled(batch, started, ended)
        self.metrics.batch(batch.batch.num_tokens, batch.batch.num_requests)
        self.metrics.admitted(batch)

    # ---- status ------------------------------------------------------------------------

    async def _server_info(self) -> dict[str, Any]:
        s, loop, info = self.scheduler, self.loop, self.link.info
        assert s is not None and loop is not None and info is not None
        return {
            "engine_id": self.engine_id,
            **await asyncio.wrap_future(loop.info()),
            "context_length": s.config.context_length,
            "page_size": s.config.page_size,
            "schedule_policy": s.config.schedule_policy,
            "disaggregation_mode": self.config.disaggregation_mode,
            "model_path": info.model_path,
            "dtype": info.dtype,
            "quantization": info.quantization,
            "tp_size": info.tp_size,
            **model_shape(info),
        }

    async def _heartbeat_loop(self) -> None:
        while True:
            self._status()
            if self.scheduler is not None and self.handoffs is not None:
                self.handoffs.expire(self.scheduler)
            await asyncio.sleep(HEARTBEAT_S)
