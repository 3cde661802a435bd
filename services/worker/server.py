"""The worker service: gRPC Steps (its scheduler's stream of steps) and GetInfo over one model
runner, gRPC health, and /health + /metrics over HTTP."""

from __future__ import annotations

import asyncio
import logging
import socket
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import Span

from radixmesh.core.model_files import served_name
from radixmesh.core.model_info import model_shape
from radixmesh.core.service_settings import WorkerConfig
from radixmesh.core.step import KVSend, StepBatch, StepResult
from radixmesh.engine.model.kv_transfer import KVInbox, KVPorter
from radixmesh.engine.model.launch import LaunchAhead, PendingStep
from radixmesh.engine.model.parallel import destroy_tensor_parallel
from radixmesh.engine.model.runner import ModelRunner, load_runner
from radixmesh.engine.model.torch_thread import TorchThread
from radixmesh.kernels import native
from radixmesh.mesh.discovery import Announcer, WorkerRank
from radixmesh.mesh.service import StatusServer
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc
from radixmesh.proto.convert import batch_from_proto, result_to_proto
from radixmesh.services.worker.forward_trace import forward_span, note_forward
from radixmesh.services.worker.kv_stream import KVSender, host_id, piece_bytes
from radixmesh.services.worker.metrics import WorkerMetrics
from radixmesh.tracing.spans import end_span

log = logging.getLogger("radixmesh.worker")

SERVICE_NAME = wpb.DESCRIPTOR.services_by_name["Worker"].full_name
MAX_MESSAGE_BYTES = 64 << 20
STOP_GRACE_S = 2.0
# How long a stop waits for the torch thread (a step or a model load) to finish.
SETTLE_TIMEOUT_S = 15.0

# A step's result, the KV it sends (each with its data) and its requests' ids.
Stepped = tuple[StepResult, list[tuple[KVSend, torch.Tensor]], list[str]]


@dataclass
class _WorkerStep:
    """A step launched on this rank; its result comes with the KV it sends, read after the
    forward (which may compute it)."""

    pending: PendingStep
    batch: StepBatch
    porter: KVPorter
    rids: list[str]

    def ready(self) -> bool:
        return self.pending.ready()

    def result(self) -> Stepped:
        result = self.pending.result()
        sends = [(send, self.porter.read(send.slots)) for send in self.batch.sends]
        return result, sends, self.rids


def worker_info(runner: ModelRunner, config: WorkerConfig) -> wpb.WorkerInfo:
    """What GetInfo answers for `runner`."""
    model = runner.config
    return wpb.WorkerInfo(
        num_slots=runner.pool.num_slots,
        vocab_size=model.vocab_size,
        max_position_embeddings=model.max_position_embeddings,
        eos_token_ids=list(model.eos_token_ids),
        model_path=str(runner.model_path),
        dtype=config.dtype,
        tp_rank=config.tp_rank,
        tp_size=config.tp_size,
        num_layers=model.num_layers,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        quantization=runner.quantization,
        host_id=host_id(),
        lora_names=sorted(runner.lora.adapters) if runner.lora else [],
        max_loras_per_batch=runner.lora.slots if runner.lora else 0,
        pinned_loras=sorted(runner.lora.pinned) if runner.lora else [],
        state_snapshots=runner.states.num_snapshots,
        **model_shape(model),
    )


@dataclass
class _Queued:
    """A step taken from the scheduler's stream: queued on the torch thread, its span open."""

    batch: StepBatch
    span: Span | None
    pending: Awaitable[Stepped]


class WorkerService(wgrpc.WorkerServicer):
    """One rank: every torch call runs on one dedicated thread, in the order batches came."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.runner: ModelRunner | None = None
        self.info: wpb.WorkerInfo | None = None
        self.port = 0
        self._torch = TorchThread("radixmesh-torch", config.num_threads)
        self._health = health.aio.HealthServicer()
        opts = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self._server = grpc.aio.server(options=opts)
        wgrpc.add_WorkerServicer_to_server(self, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._status = StatusServer(config.host, config.metrics_port, self._check)
        self.metrics = WorkerMetrics(config.tp_rank)
        self._started = False
        self._announcer: Announcer | None = None
        self._steps: LaunchAhead[Stepped] = LaunchAhead(self._torch)
        # Disaggregation: KV this rank sends to decode engines, and accepts from prefill ones.
        self.inbox = KVInbox()
        self.porter: KVPorter | None = None
        self.sender: KVSender | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve at once (health NOT_SERVING), then load the model and turn SERVING."""
        c = self.config
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port = self._server.add_insecure_port(f"{c.host}:{c.port}")
        await self._server.start()
        await self._status.start()
        self._started = True
        where = f"gRPC on {c.host}:{self.port}, /metrics on {c.host}:{self._status.port}"
        log.info("worker rank %d/%d: %s", c.tp_rank, c.tp_size, where)
        loop = asyncio.get_running_loop()
        self.runner = await loop.run_in_executor(self._torch, self._load)
        self.info = worker_info(self.runner, c)
        self.porter = KVPorter(self.runner.pool, self.runner.config.num_kv_heads, c.tp_rank,
                               c.tp_size)
        self.sender = KVSender(self.porter)
        self.metrics.loaded(served_name(Path(self.info.model_path)), self.info.num_slots)
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("model %s loaded: %d KV slots", self.info.model_path, self.info.num_slots)
        if c.announce:
            self._announcer = Announcer(c.nats_url, self._rank())
            self._announcer.start()

    def _rank(self) -> WorkerRank:
        """This rank as schedulers reach it. The ranks of a group share its meeting address."""
        c = self.config
        host = c.host
        if host in ("0.0.0.0", "::", ""):
            try:  # in a container: its address on the compose network
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                log.warning("this host's name does not resolve: announcing 127.0.0.1")
                host = "127.0.0.1"
        addr = f"{host}:{self.port}"
        group = c.dist_init_addr if c.tp_size > 1 and c.dist_init_addr else addr
        return WorkerRank(group=group, rank=c.tp_rank, tp_size=c.tp_size, addr=addr,
                          disaggregation_mode=c.disaggregation_mode)

    def _load(self) -> ModelRunner:
        """Load (and, with tp_size > 1, join the group and shard) on the torch thread."""
        c = self.config
        runner = load_runner(c, c.tp_rank, c.tp_size, c.dist_init_addr, lora=c)
        log.info(
            "rank %d on %s: %s attention, CUDA graphs for decode batches up to %d, "
            "native CPU kernels %s",
            c.tp_rank,
            runner.device,
            type(runner.attention).__name__,
            runner.graphs.buckets[-1] if runner.graphs is not None else 0,
            "on" if runner.device.type == "cpu" and native.library() is not None else "off",
        )
        return runner

    async def stop(self) -> bool:
        """Stop serving and leave the rank group; False when the torch thread is still busy
        (a step stuck on a dead peer, or a load) after SETTLE_TIMEOUT_S."""
        if self._announcer is not None:
            await self._announcer.close()
        if self.sender is not None:
            await self.sender.close()
        if self._started:
            await self._health.enter_graceful_shutdown()
            await self._server.stop(STOP_GRACE_S)
            await self._status.stop()
        settled = asyncio.get_running_loop().run_in_executor(self._torch, destroy_tensor_parallel)
        try:
            await asyncio.wait_for(settled, SETTLE_TIMEOUT_S)
        except TimeoutError:
            log.warning("the torch thread is still busy after %.0f s", SETTLE_TIMEOUT_S)
            self._torch.shutdown(wait=False, cancel_futures=True)
            return False
        self._torch.shutdown()
        return True

    def _check(self) -> tuple[bool, dict[str, Any]]:
        return self.runner is not None, {
            "tp_rank": self.config.tp_rank,
            "tp_size": self.config.tp_size,
        }

    # ---- RPCs -----------------------------------------------------------------------------

    async def Steps(
        self, requests: AsyncIterator[wpb.StepBatch], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.StepResult]:
        """The scheduler's steps, each queued on the torch thread as it comes (so step N+1
        is there when step N ends) and answered in the order sent."""
        runner = self.runner
        if runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert runner is not None
        queued: asyncio.Queue[_Queued | None] = asyncio.Queue()

        async def take() -> None:
            try:
                async for request in requests:
                    batch = batch_from_proto(request)
                    span = forward_span(request.traceparent)
                    launch = partial(self._launch, runner, batch, span is not None)
                    queued.put_nowait(_Queued(batch, span, self._steps.submit(launch)))
            finally:
                queued.put_nowait(None)

        taking = asyncio.ensure_future(take())
        try:
            while (step := await queued.get()) is not None:
                yield await self._answer(step, context)
        finally:
            taking.cancel()

    async def _answer(self, step: _Queued, context: grpc.aio.ServicerContext) -> wpb.StepResult:
        """A queued step's result once it has run, with the KV sends it started."""
        try:
            result, reads, rids = await step.pending
        except Exception as exc:
            log.exception("step %d failed", step.batch.step)
            end_span(step.span, error=repr(exc))
            await context.abort(grpc.StatusCode.INTERNAL, f"forward failed: {exc!r}")
        sender = self.sender
        assert sender is not None
        for send, data in reads:
            sender.start(send, data)
        if not step.batch.num_requests and sender.pending:
            await sender.wait(0.05)  # an idle step waits a little for a send to end
        result.sends_done = sender.finished()
        self.metrics.forward(step.batch, result.forward_ms)
        if self.runner is not None and self.runner.lora is not None:
            self.metrics.lora(self.runner.lora)
        if step.span is not None:
            note_forward(step.span, step.batch, result, self.config.tp_rank, rids)
            end_span(step.span)
        return result_to_proto(result)

    def _launch(self, runner: ModelRunner, batch: StepBatch, traced: bool) -> _WorkerStep:
        """One step on the torch thread: what KV this rank accepts, then the forward,
        launched (see LaunchAhead); with `traced`, the step's requests for its span."""
        if batch.step == 1:
            self.inbox.clear()
        for rid in batch.release:
            self.inbox.release(rid)
        for expect in batch.expects:
            self.inbox.expect(expect)
        assert self.porter is not None
        pending = runner.launch(batch)
        return _WorkerStep(pending, batch, self.porter, runner.rids(batch) if traced else [])

    async def PutKV(
        self, request_iterator: AsyncIterator[wpb.KVPages], context: grpc.aio.ServicerContext
    ) -> wpb.KVPagesAck:
        """Write a prefill engine's KV into slots this rank's scheduler set aside for it."""
        porter = self.porter
        if porter is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        loop = asyncio.get_running_loop()
        total = 0
        async for piece in request_iterator:
            nbytes = len(piece.data)
            if piece.shm_path:  # what the file must hold (the shape is checked next)
                nbytes = porter.piece_bytes(len(piece.slots), piece.head_end - piece.head_start)
            error = porter.check(len(piece.slots), piece.head_start, piece.head_end,
                                 piece.num_layers, piece.dtype, nbytes)
            if error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
            try:
                data = await asyncio.to_thread(piece_bytes, piece, nbytes)
            except (OSError, ValueError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if len(data) != nbytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{piece.shm_path} is shorter than its {nbytes} bytes")
            error = await loop.run_in_executor(self._torch, self._put, piece, data)
            if error:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, error)
            total += nbytes
        self.metrics.received(total)
        return wpb.KVPagesAck(bytes=total)

    def _put(self, piece: wpb.KVPages, data: bytes) -> str:
        """On the torch thread, in order with the steps: write a piece if it is expected."""
        porter = self.porter
        assert porter is not None
        slots = list(piece.slots)
        error = self.inbox.admit(piece.rid, piece.key, slots, len(data))
        if error:
            return error
        with warnings.catch_warnings():  # read only: the bytes are copied into the pool
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=porter.dtype)
        shape = (2 * piece.num_layers, len(slots), piece.head_end - piece.head_start, -1)
        porter.write(slots, piece.head_start, flat.view(shape))
        return ""

    async def GetInfo(
        self, request: wpb.WorkerInfoRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerInfo:
        """The loaded model and KV pool."""
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.info

    async def LoadLora(
        self, request: wpb.LoraAdapter, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerInfo:
        """Serve another LoRA adapter (on the torch thread, between steps)."""
        return await self._lora(context, lambda r: r.load_lora(request.name, request.path))

    async def UnloadLora(
        self, request: wpb.LoraAdapter, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerInfo:
        """Stop serving a LoRA adapter."""
        return await self._lora(context, lambda r: r.unload_lora(request.name))

    async def _lora(self, context: grpc.aio.ServicerContext,
                    change: Callable[[ModelRunner], None]) -> wpb.WorkerInfo:
        runner = self.runner
        if runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert runner is not None
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._torch, change, runner)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.info = worker_info(runner, self.config)
        return self.info
