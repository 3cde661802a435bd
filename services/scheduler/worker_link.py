"""The scheduler's link to its worker ranks, the engine loop's executor: which ranks it
drives (configured, or a group claimed on NATS), a gRPC stream of steps to every rank (the
batch converted to protobuf once, rank 0's result back, with the backups every rank has
finished), and whether they are there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import grpc
import nats

from radixmesh.core.service_settings import SchedulerServiceConfig
from radixmesh.core.step import StepBatch, StepResult
from radixmesh.engine.loop import EngineLoop, ExecutorLost
from radixmesh.engine.scheduler import ScheduledBatch
from radixmesh.mesh.discovery import TTL_S, Claim, claim_workers, keep_claim
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto import worker_pb2_grpc as wgrpc
from radixmesh.proto.convert import batch_to_proto, result_from_proto
from radixmesh.services.scheduler.metrics import SchedulerMetrics
from radixmesh.services.scheduler.request_traces import RequestTraces
from radixmesh.tracing.propagation import TRACEPARENT

log = logging.getLogger("radixmesh.scheduler")

WORKER_PING_S = 1.0  # how often the workers are asked whether they are there

MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


class BackupTally:
    """Which backups every rank has finished. Each rank copies its own KV heads and reports a
    backup once, in whichever step it finished there, so one rank's report is not enough."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self._reports: dict[int, int] = {}  # copy id -> ranks that reported it so far

    def add(self, per_rank: list[list[int]]) -> list[int]:
        """One step's copies_done of each rank; the backups now done on every rank."""
        done: list[int] = []
        for copy_ids in per_rank:
            for copy_id in copy_ids:
                seen = self._reports.get(copy_id, 0) + 1
                if seen == self.ranks:
                    del self._reports[copy_id]
                    done.append(copy_id)
                else:
                    self._reports[copy_id] = seen
        return done


class StepStream:
    """One rank's stream of steps: each step goes out behind the one before, and its result
    comes back in that order. Once the stream fails (the worker went away), every step
    waiting on it and every later one fails with the same AioRpcError."""

    def __init__(self, stub: wgrpc.WorkerStub) -> None:
        self._call = stub.Steps()
        self._waiting: deque[asyncio.Future[wpb.StepResult]] = deque()
        self._writing = asyncio.Lock()  # first come, first served: steps go out in order
        self.failed: grpc.aio.AioRpcError | None = None
        self._reading = asyncio.ensure_future(self._read())

    async def step(self, msg: wpb.StepBatch) -> wpb.StepResult:
        answer = asyncio.get_running_loop().create_future()
        async with self._writing:
            if self.failed is not None:
                raise self.failed
            self._waiting.append(answer)
            # A write to a failed call fails; the read fails too, and the answer with it.
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self._call.write(msg)
        return await answer

    async def _read(self) -> None:
        try:
            while (result := await self._call.read()) is not grpc.aio.EOF:
                self._waiting.popleft().set_result(result)
            self.failed = grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                "the worker ended its stream of steps")
        except grpc.aio.AioRpcError as exc:
            self.failed = exc
        while self._waiting:
            self._waiting.popleft().set_exception(self.failed)

    async def close(self) -> None:
        self._call.cancel()
        await asyncio.gather(self._reading, return_exceptions=True)


class WorkerClient:
    """Drives the worker ranks of one engine replica: a stream of steps to each."""

    def __init__(self, addrs: list[str]) -> None:
        self._channels: list[grpc.aio.Channel] = []
        self._open(addrs)

    def _open(self, addrs: list[str]) -> None:
        self._channels = [grpc.aio.insecure_channel(a, options=_OPTIONS) for a in addrs]
        self._stubs = [wgrpc.WorkerStub(c) for c in self._channels]
        self._streams: list[StepStream] = []
        self._closing: set[asyncio.Future[None]] = set()  # failed streams closing
        self.addrs = addrs
        self._backups = BackupTally(len(addrs))

    async def retarget(self, addrs: list[str]) -> None:
        """Drive the ranks at `addrs` from now on (a worker group found anew)."""
        if addrs != self.addrs:
            await self.close()
            self._open(addrs)

    async def connect(self, timeout: float) -> wpb.WorkerInfo:
        """Wait for every rank to answer; rank 0's info (ranks are reordered by tp_rank)."""
        if not self.addrs:
            raise ValueError("at least one worker address is needed")
        deadline = time.monotonic() + timeout
        infos = await asyncio.gather(*(self._info(s, deadline) for s in self._stubs))
        order = sorted(range(len(infos)), key=lambda i: infos[i].tp_rank)
        self._stubs = [self._stubs[i] for i in order]
        infos = [infos[i] for i in order]
        sizes = {i.tp_size for i in infos}
        if sizes != {len(infos)} or [i.tp_rank for i in infos] != list(range(len(infos))):
            raise RuntimeError(
                f"workers report tp ranks {[i.tp_rank for i in infos]} of sizes {sorted(sizes)}; "
                f"expected ranks 0..{len(infos) - 1}, one address per rank"
            )
        return infos[0]

    @staticmethod
    async def _info(stub: wgrpc.WorkerStub, deadline: float) -> wpb.WorkerInfo:
        while True:
            try:
                return await stub.GetInfo(wpb.WorkerInfoRequest(), timeout=5, wait_for_ready=True)
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def ping(self, timeout: float = 2.0) -> None:
        """Raise grpc.aio.AioRpcError unless every rank answers."""
        await asyncio.gather(*(s.GetInfo(wpb.WorkerInfoRequest(), timeout=timeout)
                               for s in self._stubs))

    async def forward(self, batch: StepBatch, traceparent: str = "") -> StepResult:
        """Run one step on every rank; they stay in lockstep, rank 0 answers, and a backup
        is done once every rank has reported it. `traceparent`: the step's trace context."""
        msg = batch_to_proto(batch)
        msg.traceparent = traceparent
        streams = self._current_streams()
        if len(streams) == 1:
            return result_from_proto(await streams[0].step(msg))
        results = await asyncio.gather(*(s.step(msg) for s in streams))
        result = result_from_proto(results[0])
        result.copies_done = self._backups.add([list(r.copies_done) for r in results])
        return result

    async def lora(self, load: bool, name: str, path: str = "") -> wpb.WorkerInfo:
        """Load (or unload) a LoRA adapter on every rank: rank 0's info after; ValueError
        with the worker's reason when a rank refuses."""
        adapter = wpb.LoraAdapter(name=name, path=path)
        try:
            infos = await asyncio.gather(*((s.LoadLora if load else s.UnloadLora)(adapter)
                                           for s in self._stubs))
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            raise ValueError(exc.details()) from None
        return infos[0]

    def _current_streams(self) -> list[StepStream]:
        """The streams a step goes out on: new ones once one has failed (a scheduler that
        starts over), opened with no await between the check and the swap, so that the
        steps behind this one (the overlap loop sends step N + 1 before N is back) queue on
        the same streams in order; the failed ones close in the background."""
        if not self._streams or any(s.failed is not None for s in self._streams):
            stale, self._streams = self._streams, [StepStream(stub) for stub in self._stubs]
            for stream in stale:
                closing = asyncio.ensure_future(stream.close())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
        return self._streams

    async def _close_streams(self) -> None:
        streams, self._streams = self._streams, []
        await asyncio.gather(*(s.close() for s in streams), *self._closing)

    async def close(self) -> None:
        await self._close_streams()
        await asyncio.gather(*(c.close() for c in self._channels))


class WorkerLink:
    """The worker ranks one engine replica drives, as the engine loop's executor: each step
    run on every rank, timed and traced. `down` from the first failure (a step's, or a ping
    between steps) until `reconnect` finds them again; `on_down` then says so at once."""

    def __init__(self, config: SchedulerServiceConfig, metrics: SchedulerMetrics,
                 traces: RequestTraces, on_down: Callable[[], None]) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self.client = WorkerClient(config.worker_list)
        self.metrics = metrics
        self.traces = traces
        self.on_down = on_down
        self.info: wpb.WorkerInfo | None = None  # rank 0's, once connected
        self.down = False
        self._nc: nats.NATS | None = None
        self._claim: Claim | None = None  # the worker group found on NATS, if not configured
        self._keeping: asyncio.Task[None] | None = None

    @property
    def addrs(self) -> list[str]:
        return self.client.addrs

    def worker_info(self) -> wpb.WorkerInfo:
        assert self.info is not None
        return self.info

    async def connect(self, nc: nats.NATS) -> wpb.WorkerInfo:
        """The configured workers once they answer; without any configured, the first
        group announced on NATS that is free (the one held before, when it is back)."""
        self._nc = nc
        if self.config.worker_list:
            self.info = await self.client.connect(self.config.worker_timeout)
            return self.info
        while True:
            prefer = self._claim.group if self._claim is not None else None
            claim = await claim_workers(nc, self.engine_id, prefer,
                                        self.config.disaggregation_mode)
            if self._claim is None or claim.group != self._claim.group:
                await self.release()
                self._claim = claim
                self._keeping = asyncio.create_task(keep_claim(nc, claim, self.engine_id))
            await self.client.retarget(claim.addrs)
            try:  # an announcement outlives a killed worker by up to TTL_S
                self.info = await self.client.connect(2 * TTL_S)
                return self.info
            except grpc.aio.AioRpcError as exc:
                log.warning("engine %s: worker group %s does not answer (%s)", self.engine_id,
                            claim.group, exc.code())

    async def reconnect(self) -> wpb.WorkerInfo:
        """Wait for the workers to come back (the supervisor restarts them), then serve
        with them: the engine is up again."""
        assert self._nc is not None
        while True:
            try:
                info = await self.connect(self._nc)
                break
            except grpc.aio.AioRpcError as exc:
                log.warning("engine %s: workers still away (%s)", self.engine_id, exc.code())
        self.down = False
        return info

    async def watch(self, loop: EngineLoop) -> None:
        """An idle engine notices lost workers too, before a request finds out."""
        while True:
            await asyncio.sleep(WORKER_PING_S)
            if self.down:
                continue
            try:
                await self.client.ping()
            except grpc.aio.AioRpcError as exc:
                if not self.down:
                    loop.lose(self._going_down(exc.code().name))

    def _going_down(self, why: str) -> ExecutorLost:
        """Say the engine is down (before its requests' aborts go out, so routers send the
        retries elsewhere); the loss to hand the engine loop."""
        self.down = True
        self.on_down()
        return ExecutorLost(f"engine {self.engine_id} lost its worker ({why})")

    def submit(self, batch: ScheduledBatch) -> Awaitable[StepResult]:
        """Run one step on every worker rank, timed and traced."""
        return asyncio.ensure_future(self._forward(batch))

    async def _forward(self, batch: ScheduledBatch) -> StepResult:
        with self.metrics.forward_timer(), self.traces.forward(batch) as metadata:
            try:
                result = await self.client.forward(batch.batch, dict(metadata or ()).get(
                    TRACEPARENT, ""))
            except grpc.aio.AioRpcError as exc:
                raise self._going_down(f"{exc.code().name}: {exc.details()}") from exc
            self.traces.verified(batch, result)
            return result

    async def close(self) -> None:
        await self.client.close()

    async def release(self) -> None:
        """Give up the claimed worker group, if any (on NATS: before the bus drains)."""
        if self._keeping is not None:
            self._keeping.cancel()
            await asyncio.gather(self._keeping, return_exceptions=True)
            self._keeping = None
        self._claim = None
