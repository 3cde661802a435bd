"""The mesh client: the tokenizer's NATS client that runs what its front doors ask.

A front door checks and tokenizes a prompt into a GenerationRequest (`build_request`), then
iterates `MeshClient.generate`: the request is admitted, routed to an engine, sent as an
EngineRequest, and the TextChunks that come back on this replica's own subject are put in
order (`assembler.py`) as GenerationChunks. The client also retries a request its engine lost
before any output, ends requests whose output stalls, and makes the control calls
(server_info, flush_cache)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError

from radixmesh.core.detokenize import detok_context_size
from radixmesh.core.pooling import Pooling, Reranker
from radixmesh.core.request import GenerationRequest
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto.convert import sampling_to_proto
from radixmesh.services.tokenizer import metrics
from radixmesh.services.tokenizer.assembler import ChunkAssembler, InFlight, deliver
from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError
from radixmesh.services.tokenizer.request_trace import RequestTrace
from radixmesh.services.tokenizer.router import EngineRegistry, EngineStatus, Route, Router

log = logging.getLogger("radixmesh.tokenizer.mesh")

_PROMPT_TAIL = 4  # prompt tokens the detokenizer gets as left context for the first output
# How long output may stay out of order before the missing part counts as lost (two
# detokenizer replicas deliver out of order by milliseconds; a dead one never delivers).
GAP_TIMEOUT_S = 5.0


class MeshClient:
    """GenerationClient over NATS with cache-aware routing among the live engines, found
    by their heartbeats; output comes back on this replica's own subject."""

    def __init__(
        self,
        nc: NATS,
        tokenizer: Tokenizer,
        model_name: str,
        replica_id: str,
        router: Router | None = None,
        engine_timeout_s: float = 3.0,
        control_timeout_s: float = 5.0,
        grammar_backend: str = "xgrammar",
        max_queued: int = 0,
        stall_timeout_s: float = 0.0,
        pooling: Pooling | None = None,
        reranker: Reranker | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.grammar_backend = grammar_backend
        self.pooling = pooling
        self.reranker = reranker
        self.metrics = metrics.TokenizerMetrics(model_name)
        self.replica_id = replica_id
        self.router = router or Router()
        self.engines = EngineRegistry(engine_timeout_s)
        self._nc = nc
        self._control_timeout_s = control_timeout_s
        self._reply_to = subjects.tokenizer_out(replica_id)
        self._in_flight: dict[str, InFlight] = {}
        self.max_queued = max_queued  # 0: no limit
        self.stall_timeout_s = stall_timeout_s  # 0: a request may wait for output forever
        self.queued = 0  # requests sent that have no output yet
        self._subs: list[Subscription] = []
        self._reaper: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for engines, their cache events and this replica's output."""
        nc = self._nc
        self._subs = [
            await nc.subscribe(subjects.ENGINES, cb=self._on_status),
            await nc.subscribe(subjects.CACHE_EVENTS_ALL, cb=self._on_cache_event),
            await nc.subscribe(self._reply_to, cb=self._on_output),
        ]
        self._reaper = asyncio.create_task(self._reap_loop())

    async def close(self) -> None:
        """Stop listening; requests still waiting end with an abort."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for sub in self._subs:
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()
        self._subs.clear()
        for rid, flight in list(self._in_flight.items()):
            if not flight.assembler.finished:
                await self._give_up(rid, flight, "the tokenizer is shutting down")

    # ---- what the front doors read -------------------------------------------------------

    @property
    def context_length(self) -> int:
        """Longest prompt + output every known engine accepts (0 until one is known)."""
        return self.engines.context_length

    @property
    def vocab_size(self) -> int:
        """The engines' vocabulary size, else the tokenizer's."""
        return self.engines.vocab_size or self.tokenizer.vocab_size

    @property
    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters the engines serve."""
        return self.engines.lora_names

    @property
    def hidden_size(self) -> int:
        """The model's hidden size, an embedding's dimensions (0 until an engine is known)."""
        return self.engines.hidden_size

    @property
    def in_flight(self) -> int:
        """Requests sent to engines and not finished."""
        return len(self._in_flight)

    async def wait_for_engines(self, count: int = 1, timeout_s: float = 10.0) -> None:
        """Block until at least `count` engines are known."""
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(self.engines) >= count), timeout_s
            )

    # ---- generation ----------------------------------------------------------------------

    async def generate(self, request: GenerationRequest, stream: bool = True
                       ) -> AsyncIterator[GenerationChunk]:
        """Run a request on an engine; closing the iterator early aborts it there. Without
        `stream`, its engine sends output now and then rather than token by token (the
        chunks still add up to the whole answer)."""
        if request.rid in self._in_flight:
            raise GenerationError(f"request id {request.rid!r} is already running", 400)
        if self.max_queued and self.queued >= self.max_queued:
            self.metrics.overloaded()
            raise GenerationError(
                f"the server is busy: {self.queued} requests are waiting for their first "
                f"token (max_queued_requests {self.max_queued}); retry later", 503,
                retry_after=1,
            )
        trace = RequestTrace(request)
        try:
            route = trace.route(self.router, request)
        except LookupError:
            trace.end("no engine is available")
            raise GenerationError("no engine is available", 503) from None
        try:
            payload = self._engine_request(request, route, stream)
        except ValueError as exc:  # a value the message cannot carry, e.g. out of int32
            trace.end(f"invalid request: {exc}")
            raise GenerationError(f"invalid request: {exc}", 400) from exc
        flight = InFlight(route.engine_id, ChunkAssembler(request))
        self._in_flight[request.rid] = flight
        observed = self.metrics.request(len(request.input_ids))
        finished = retried = False
        waiting = True
        self.queued += 1
        try:
            await self._nc.publish(
                subjects.engine_generate(route.engine_id), payload, headers=trace.headers()
            )
            while not finished:
                chunk = await flight.take()
                if not retried and await self._retry(flight, chunk, request, trace, stream):
                    retried = True  # once: on another engine, as if new
                    continue
                if waiting:
                    waiting = False
                    self.queued -= 1
                finished = chunk.finish is not None
                if finished and chunk.finish.status and not chunk.completion_tokens:
                    # Refused by its engine for what it asked (a constraint that does not
                    # compile): an error answer, as if refused here.
                    grammar = request.params.grammar
                    raise GenerationError(chunk.finish.message or "refused by the engine",
                                          chunk.finish.status,
                                          param=grammar[0] if grammar else None)
                observed.on_chunk(chunk)
                trace.chunk(chunk)
                yield chunk
        finally:
            if waiting:
                self.queued -= 1
            del self._in_flight[request.rid]
            observed.close()
            if not finished and not flight.assembler.finished:
                with trace.aborting("the caller stopped reading") as abort_headers:
                    await self._abort(flight.engine_id, request.rid, abort_headers)
            trace.end()

    async def _retry(self, flight: InFlight, chunk: GenerationChunk,
                     request: GenerationRequest, trace: RequestTrace, stream: bool) -> bool:
        """Send a request its engine lost before any output to another engine; whether it
        went (False: nothing to retry, or no other engine)."""
        if chunk.finish is None or not flight.lost or flight.assembler.completion_tokens:
            return False
        lost = flight.engine_id
        self.router.remove_engine(lost)  # until it says it is back
        try:
            route = trace.route(self.router, request)
        except LookupError:
            return False
        log.warning("request %s: engine %s lost it before any output; retrying on %s",
                    request.rid, lost, route.engine_id)
        flight.engine_id, flight.lost = route.engine_id, False
        flight.assembler = ChunkAssembler(request)
        flight.last_output, flight.gap_since = time.monotonic(), None
        await self._nc.publish(subjects.engine_generate(route.engine_id),
                               self._engine_request(request, route, stream),
                               headers=trace.headers())
        return True

    def _engine_request(self, request: GenerationRequest, route: Route, stream: bool) -> bytes:
        params = request.params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        lp = request.logprobs
        message = mpb.EngineRequest(
            rid=request.rid,
            input_ids=request.input_ids,
            sampling=sampling_to_proto(params, seed),
            cache_salt=request.cache_salt or "",
            lora_path=request.lora_path or "",
            pooling=request.pooling,
            score_ids=request.score_ids,
            priority=request.priority,
            return_logprob=lp.return_logprob,
            top_logprobs_num=lp.top_logprobs_num,
            logprob_start_len=lp.logprob_start_len,
            reply_to=self._reply_to,
            detok=mpb.DetokSpec(
                stop=params.stop,
                no_stop_trim=params.no_stop_trim,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                min_new_tokens=params.min_new_tokens,
                prompt_tail=request.input_ids[-_PROMPT_TAIL:],
            ),
            detok_context=detok_context_size(params.stop),
            prefill_engine=route.prefill_engine,
            stream=stream,
        )
        log.debug("request %s -> engine %s (%d cached)%s", request.rid, route.engine_id,
                  route.matched_tokens,
                  f", prefilled on {route.prefill_engine}" if route.prefill_engine else "")
        return message.SerializeToString()

    async def _abort(
        self, engine_id: str, rid: str, abort_headers: dict[str, str] | None = None
    ) -> None:
        try:
            await self._nc.publish(
                subjects.engine_abort(engine_id), mpb.AbortRequest(rid=rid).SerializeToString(),
                headers=abort_headers,
            )
        except NatsError as exc:
            log.warning("could not abort %s on engine %s: %s", rid, engine_id, exc)

    # ---- control -------------------------------------------------------------------------

    async def control(self, engine_id: str, op: str, **fields: str) -> dict[str, Any]:
        """One JSON request/reply with an engine's scheduler."""
        reply = await self._nc.request(
            subjects.engine_control(engine_id),
            json.dumps({"op": op, **fields}).encode(),
            timeout=self._control_timeout_s,
        )
        return json.loads(reply.data)

    async def change_lora(self, load: bool, lora_name: str, lora_path: str = "") -> str:
        """Load (or unload) a LoRA adapter on every engine; the first engine's reason when
        one refuses ("" when all did it). Requests may name it as soon as this returns."""
        ids = self.engines.ids
        if not ids:
            return "no engine is available"
        op = "load_lora" if load else "unload_lora"
        replies = await asyncio.gather(
            *(self.control(e, op, lora_name=lora_name, lora_path=lora_path) for e in ids),
            return_exceptions=True)
        error = ""
        for engine_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, dict) and reply.get("success"):
                self.engines.served(engine_id, reply.get("lora_names", []))
            else:
                why = reply.get("error") if isinstance(reply, dict) else repr(reply)
                log.warning("engine %s did not %s %r: %s", engine_id, op, lora_name, why)
                error = error or f"engine {engine_id}: {why}"
        return error

    async def flush_cache(self) -> bool:
        """Ask every engine to drop its prefix cache; True when all did."""
        ids = self.engines.ids
        replies = await asyncio.gather(*(self.control(e, "flush") for e in ids),
                                       return_exceptions=True)
        ok = bool(ids)
        for engine_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, dict) and reply.get("success"):
                self.router.flush(engine_id)
            else:
                log.warning("engine %s did not flush its cache: %s", engine_id, reply)
                ok = False
        return ok

    async def engine_infos(self) -> list[dict[str, Any]]:
        """Each engine's own server info, or its last heartbeat when it does not answer."""
        ids = self.engines.ids
        replies = await asyncio.gather(*(self.control(e, "info") for e in ids),
                                       return_exceptions=True)
        out = []
        for engine_id, reply in zip(ids, replies, strict=True):
            if isinstance(reply, dict):
                out.append(reply)
            elif engine_id in self.engines:
                out.append(dataclasses.asdict(self.engines.status(engine_id)))
        return out

    # ---- NATS callbacks ------------------------------------------------------------------

    async def _on_status(self, msg: Msg) -> None:
        status = _status_from_proto(mpb.EngineStatus.FromString(msg.data))
        if not status.engine_id:
            return
        if status.down:  # lost its workers: it ends its requests itself, route around it
            if self.engines.forget(status.engine_id):
                log.warning("engine %s is down; routing around it", status.engine_id)
                self.router.remove_engine(status.engine_id)
                await self._membership_changed()
            return
        heard = self.engines.heard(status)
        if heard == "restarted":  # the requests sent to the one before are lost
            log.warning("engine %s restarted", status.engine_id)
            self.router.remove_engine(status.engine_id)
            self._engine_lost(status.engine_id, f"engine {status.engine_id} restarted")
        self.router.update_engine(status.engine_id, status.running + status.waiting,
                                  status.role)
        if heard:
            log.info("engine %s joined (context %d)", status.engine_id, status.context_length)
            await self._membership_changed()

    async def _on_cache_event(self, msg: Msg) -> None:
        event = mpb.CacheEvent.FromString(msg.data)
        if event.flushed:
            self.router.flush(event.engine_id)
        for seq in event.inserted:
            self.router.record_cached(event.engine_id, seq.token_ids, seq.cache_salt)

    async def _on_output(self, msg: Msg) -> None:
        deliver(mpb.TextChunks.FromString(msg.data), self._in_flight, time.monotonic())

    async def _reap_loop(self) -> None:
        period = min(self.engines.timeout_s / 4, 1.0)
        while True:
            slept = time.monotonic()
            await asyncio.sleep(period)
            if time.monotonic() - slept > 2 * period:
                continue  # this loop was busy: heartbeats may be waiting to be read
            gone = self.engines.expire()
            for engine_id in gone:
                log.warning("engine %s fell silent; dropping it", engine_id)
                self.router.remove_engine(engine_id)
                self._engine_lost(engine_id, f"engine {engine_id} went away")
            if gone:
                await self._membership_changed()
            await self._end_stalled()

    async def bus_interrupted(self) -> None:
        """NATS came back: output sent meanwhile is lost, so every request in flight ends
        (aborted on its engine), with a clear error rather than a hole in its text."""
        for rid, flight in list(self._in_flight.items()):
            if not flight.assembler.finished:
                await self._give_up(rid, flight,
                                    "the connection to the mesh's message bus was interrupted")

    async def _give_up(self, rid: str, flight: InFlight, message: str) -> None:
        """End a request here with `message` and abort it on its engine."""
        flight.end(message)
        await self._abort(flight.engine_id, rid)

    def _engine_lost(self, engine_id: str, message: str) -> None:
        """End the requests sent to an engine that is gone (retried when they had no
        output yet)."""
        for flight in self._in_flight.values():
            if flight.engine_id == engine_id:
                flight.end(message, lost=True)

    async def _end_stalled(self) -> None:
        """End requests whose output has a hole that is not filling (a detokenizer died
        holding part of it), or that had no output for stall_timeout_s."""
        now = time.monotonic()
        for rid, flight in list(self._in_flight.items()):
            if flight.assembler.finished:
                continue
            if flight.gap_since is not None and now - flight.gap_since > GAP_TIMEOUT_S:
                message = "part of the output was lost on its way (a detokenizer went away)"
            elif self.stall_timeout_s and now - flight.last_output > self.stall_timeout_s:
                message = f"no output for {self.stall_timeout_s:g} s"
            else:
                continue
            log.warning("request %s: %s; ending it", rid, message)
            await self._give_up(rid, flight, message)

    async def _membership_changed(self) -> None:
        metrics.ENGINES.set(len(self.engines))
        async with self._changed:
            self._changed.notify_all()


def _status_from_proto(msg: mpb.EngineStatus) -> EngineStatus:
    """An engine's heartbeat as the registry keeps it."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(EngineStatus)}
    # Repeated fields (the adapters' names) as tuples, not protobuf containers.
    return EngineStatus(**{name: value if isinstance(value, str | int | float) else tuple(value)
                           for name, value in values.items()})
