"""The mesh client: the tokenizer's NATS client that runs what its front doors ask.

A front door checks and tokenizes a prompt into a GenerationRequest (`build_request`), then
iterates `MeshClient.generate`: the request is admitted, routed to an engine (`router.py`),
sent as an EngineRequest, and the TextChunks that come back on this replica's own subject are
delivered to it (`flights.py`) and put in order (`assembler.py`) as GenerationChunks; a
request its engine lost before any output is sent once more, to another engine. Which
engines there are is `membership.py`'s, the control calls (server info, flush_cache, LoRA
adapters) `engine_control.py`'s; the client composes them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from nats.aio.client import Client as NATS
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
from radixmesh.services.tokenizer.assembler import InFlight
from radixmesh.services.tokenizer.engine_control import EngineControl
from radixmesh.services.tokenizer.flights import Flights
from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError
from radixmesh.services.tokenizer.membership import Membership
from radixmesh.services.tokenizer.request_trace import RequestTrace
from radixmesh.services.tokenizer.router import EngineRegistry, Route, Router

log = logging.getLogger("radixmesh.tokenizer.mesh")

_PROMPT_TAIL = 4  # prompt tokens the detokenizer gets as left context for the first output


class MeshClient:
    """GenerationClient over NATS with cache-aware routing among the live engines, found
    by their heartbeats; output comes back on this replica's own subject. Its parts:
    `flights` (the requests waiting on output), `membership` (the engines known) and
    `control` (the calls to every engine's scheduler)."""

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
        self.flights = Flights(nc)
        self.membership = Membership(self.engines, self.router, self.flights)
        self.control = EngineControl(nc, self.engines, self.router, control_timeout_s)
        self.max_queued = max_queued  # 0: no limit
        self.stall_timeout_s = stall_timeout_s  # 0: a request may wait for output forever
        self.queued = 0  # requests sent that have no output yet
        self._nc = nc
        self._reply_to = subjects.tokenizer_out(replica_id)
        self._subs: list[Subscription] = []
        self._reaper: asyncio.Task[None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Listen for engines, their cache events and this replica's output."""
        nc = self._nc
        self._subs = [
            await nc.subscribe(subjects.ENGINES, cb=self.membership.on_status),
            await nc.subscribe(subjects.CACHE_EVENTS_ALL, cb=self.membership.on_cache_event),
            await nc.subscribe(self._reply_to, cb=self.flights.on_output),
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
        await self.flights.end_all("the tokenizer is shutting down")

    async def bus_interrupted(self) -> None:
        """NATS came back: output sent meanwhile is lost, so every request in flight ends
        (aborted on its engine), with a clear error rather than a hole in its text."""
        await self.flights.end_all("the connection to the mesh's message bus was interrupted")

    async def _reap_loop(self) -> None:
        period = min(self.engines.timeout_s / 4, 1.0)
        while True:
            slept = time.monotonic()
            await asyncio.sleep(period)
            if time.monotonic() - slept > 2 * period:
                continue  # this loop was busy: heartbeats may be waiting to be read
            await self.membership.expire()
            await self.flights.end_stalled(self.stall_timeout_s)

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
        return len(self.flights)

    async def wait_for_engines(self, count: int = 1, timeout_s: float = 10.0) -> None:
        """Block until at least `count` engines are known."""
        await self.membership.wait_for(count, timeout_s)

    async def change_lora(self, load: bool, lora_name: str, lora_path: str = "") -> str:
        """EngineControl.change_lora: the first engine's reason when one refuses, else ""."""
        return await self.control.change_lora(load, lora_name, lora_path)

    async def flush_cache(self) -> bool:
        """EngineControl.flush_cache: True when every engine dropped its prefix cache."""
        return await self.control.flush_cache()

    async def engine_infos(self) -> list[dict[str, Any]]:
        """EngineControl.engine_infos: each engine's server info, else its last heartbeat."""
        return await self.control.engine_infos()

    # ---- generation ----------------------------------------------------------------------

    async def generate(self, request: GenerationRequest, stream: bool = True
                       ) -> AsyncIterator[GenerationChunk]:
        """Run a request on an engine; closing the iterator early aborts it there. Without
        `stream`, its engine sends output now and then rather than token by token (the
        chunks still add up to the whole answer)."""
        if request.rid in self.flights:
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
        flight = self.flights.open(request, route.engine_id)
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
            self.flights.close(request.rid)
            observed.close()
            if not finished and not flight.assembler.finished:
                with trace.aborting("the caller stopped reading") as abort_headers:
                    await self.flights.abort(flight.engine_id, request.rid, abort_headers)
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
        flight.restart(route.engine_id)
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
