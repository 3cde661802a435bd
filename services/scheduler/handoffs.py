"""Prefill/decode disaggregation as the scheduler service does it on NATS: a decode engine
sends its requests on to their prefill engines once their slots are set aside, and hears
their KV commits and their heartbeats; a prefill engine hands its requests back with a
commit. The engine library's `Transfers` keeps the slots; this is the messages."""

from __future__ import annotations

import time
from collections.abc import Callable

import nats
from nats.aio.msg import Msg

from radixmesh.engine.disaggregation import handoff_key
from radixmesh.engine.loop import EngineLoop
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.services.scheduler.mesh_io import (
    commit_to_proto,
    committed_from_proto,
    handoff_request,
)
from radixmesh.services.scheduler.metrics import SchedulerMetrics
from radixmesh.services.scheduler.request_traces import RequestTraces

# A prefill engine silent this long (or restarted) sends no more KV: what waits for it is
# prefilled on this decode engine instead.
PEER_TIMEOUT_S = 3.0

Headers = dict[str, str] | None


class Handoffs:
    """One engine's disaggregation messages, both sides; `info` gives the workers' current
    WorkerInfo (they may come back as other processes)."""

    def __init__(self, engine_id: str, transfer_backend: str, nc: nats.NATS, loop: EngineLoop,
                 info: Callable[[], wpb.WorkerInfo], worker_addrs: Callable[[], list[str]],
                 metrics: SchedulerMetrics, traces: RequestTraces) -> None:
        self.engine_id = engine_id
        self.transfer_backend = transfer_backend
        self.nc = nc
        self.loop = loop
        self.info = info
        self.worker_addrs = worker_addrs
        self.metrics = metrics
        self.traces = traces
        # Decode side: requests to send on to their prefill engines (the message and its
        # trace headers), and when each engine was last heard (and which process it was).
        self._waiting: dict[str, tuple[mpb.EngineRequest, Headers]] = {}
        self._peers: dict[str, tuple[float, str]] = {}
        self._commits: list[tuple[str, mpb.KVCommit]] = []  # to send with the next step

    def backend(self, dest_host: str) -> str:
        """How this engine's workers send KV to workers on `dest_host`."""
        if self.transfer_backend == "auto":
            return "shm" if dest_host and dest_host == self.info().host_id else "grpc"
        return self.transfer_backend

    def arrived(self, req: Req, engine_request: mpb.EngineRequest, headers: Headers) -> None:
        """A request has come in: a prefill engine's learns how to send its KV; a decode
        engine's waits to be sent on to its prefill engine."""
        if req.handoff is not None:
            req.handoff.backend = self.backend(req.handoff.dest_host)
        if req.transfer is not None:
            self._waiting[req.rid] = (engine_request, headers)

    def ended(self, req: Req) -> None:
        """A decode engine's request finished: it is not sent on any more."""
        self._waiting.pop(req.rid, None)

    def refused(self, req: Req, message: str) -> None:
        """Prefill side: a request refused here is prefilled by its decode engine."""
        assert req.handoff is not None
        self._commits.append((req.handoff.decode_engine, mpb.KVCommit(
            rid=req.rid, prefill_engine=self.engine_id, error=message)))

    def handed(self, req: Req) -> None:
        """Prefill side: a request ended here goes back to its decode engine."""
        assert req.handoff is not None
        commit = commit_to_proto(req, self.engine_id)
        self.traces.handed(req, commit.transfer_tokens, commit.transfer_bytes,
                           commit.transfer_ms, commit.error)
        self.metrics.transfer_sent(commit.transfer_tokens, commit.transfer_bytes,
                                   commit.transfer_ms, bool(commit.error))
        self._commits.append((req.handoff.decode_engine, commit))

    async def send(self, sched: Scheduler) -> None:
        """This step's messages: requests on to their prefill engines (now that the step
        telling the workers to expect their KV is on its way), aborts to prefill engines,
        commits back to decode engines."""
        for r in sched.disagg.take_reservations():
            held = self._waiting.get(r.req.rid)
            transfer = r.req.transfer
            if held is None or transfer is None:
                continue
            engine_request, headers = held
            payload = handoff_request(engine_request, self.engine_id, r.start, r.dest_slots, r.key,
                                      self.worker_addrs(), self.info().host_id)
            await self.nc.publish(subjects.engine_generate(transfer.prefill_engine), payload,
                                  headers=headers)
        for rid, engine_id in sched.disagg.take_cancelled():
            self.metrics.transfer_fallback()
            abort = mpb.AbortRequest(rid=handoff_key(rid, self.engine_id))
            await self.nc.publish(subjects.engine_abort(engine_id), abort.SerializeToString())
        commits, self._commits = self._commits, []
        for engine_id, commit in commits:
            await self.nc.publish(subjects.engine_kv(engine_id), commit.SerializeToString())

    async def on_commit(self, msg: Msg) -> None:
        """Decode side: a prefill engine handed a request back (its KV is here, or is not
        coming)."""
        commit = mpb.KVCommit.FromString(msg.data)
        committed = committed_from_proto(commit)
        self.metrics.transfer_received(commit.transfer_tokens, commit.transfer_bytes,
                                       commit.transfer_ms, bool(commit.error))
        self.loop.apply(lambda s: s.transfers.commit(commit.rid, committed))

    async def on_peer(self, msg: Msg) -> None:
        """Every engine's heartbeat: a prefill engine that is down or restarted sends no
        more KV (one that falls silent is noticed by `expire`)."""
        status = mpb.EngineStatus.FromString(msg.data)
        if status.engine_id == self.engine_id:
            return
        known = self._peers.get(status.engine_id)
        if status.down or (known is not None and known[1] != status.instance):
            self._peer_lost(status.engine_id)
        self._peers[status.engine_id] = (time.monotonic(), status.instance)

    def expire(self, sched: Scheduler) -> None:
        """Each heartbeat: engines silent too long are gone; transfers that time out need a
        step to notice."""
        now = time.monotonic()
        for engine_id, (seen, _) in list(self._peers.items()):
            if now - seen > PEER_TIMEOUT_S:
                del self._peers[engine_id]
                self._peer_lost(engine_id)
        if sched.disagg.awaiting:
            self.loop.wake()

    def _peer_lost(self, engine_id: str) -> None:
        self.loop.apply(lambda s: s.transfers.lose_prefill_engine(engine_id))
