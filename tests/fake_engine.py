"""A stand-in for an engine replica (scheduler + workers + detokenizers) on NATS: it
heartbeats, and answers each EngineRequest by echoing the prompt's tokens back as
TextChunks sent straight to the request's reply_to subject, with the longest prefix it has
seen before as the cache hit (part of it from the host tier). No model runs."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from radixmesh.core.step import int_array
from radixmesh.mesh import subjects
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb

# The model shape the fake's heartbeats report.
MOE_SHAPE = {"architecture": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}


def token_text(token_id: int) -> str:
    """The text the fake engine gives each output token."""
    return f" t{token_id}"


def echo_ids(input_ids: list[int], n: int) -> list[int]:
    """The fake's output: the prompt's tokens over and over, n of them."""
    return [input_ids[i % len(input_ids)] for i in range(n)]


def host_part(cached: int) -> int:
    """How much of a prefix hit the fake says came back from the host tier (HiCache)."""
    return cached // 2


def output_logprob(i: int) -> float:
    return -(i + 1) / 10


def input_logprob(position: int) -> float:
    """NaN for the first prompt token, which has no logprob."""
    return math.nan if position == 0 else -position / 100


def _top(token_id: int, n: int) -> wpb.TopLogprobs:
    return wpb.TopLogprobs(
        items=[wpb.TokenLogprob(token_id=token_id + k, logprob=-(k + 1.0)) for k in range(n)]
    )


class FakeEngine:
    """Options: `reverse` sends a request's chunks last first; `extra_finish` sends a second,
    later finish that must be ignored; `hold` sends one chunk and waits for the abort;
    `delay_s` spaces the chunks; `lose` ends each request at once as an engine that lost its
    workers does; `gap` never sends a request's first chunk (as if a detokenizer died with
    it); `refuse_grammars` refuses a request with a regex as an engine whose compile failed
    does; `packed` sends the chunks between the first and the last packed, as detokenizers
    send those of packed updates. `down` makes its heartbeats say it is down. Its heartbeats
    report a mixture-of-experts model (MOE_SHAPE)."""

    def __init__(
        self,
        nc: NATS,
        engine_id: str,
        *,
        context_length: int = 4096,
        vocab_size: int = 49152,
        heartbeat_s: float = 0.05,
        reverse: bool = False,
        extra_finish: bool = False,
        hold: bool = False,
        delay_s: float = 0.0,
        lose: bool = False,
        gap: bool = False,
        refuse_grammars: bool = False,
        packed: bool = False,
    ) -> None:
        self.nc = nc
        self.engine_id = engine_id
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.heartbeat_s = heartbeat_s
        self.reverse = reverse
        self.extra_finish = extra_finish
        self.hold = hold
        self.delay_s = delay_s
        self.lose = lose
        self.gap = gap
        self.refuse_grammars = refuse_grammars
        self.packed = packed
        self.down = False
        self.load = 0  # running + waiting it reports
        self.flush_ok = True
        self.requests: list[mpb.EngineRequest] = []
        self.aborts: list[str] = []
        self.flushes = 0
        self._seen: list[list[int]] = []
        self._changed = asyncio.Condition()
        self._subs: list[Any] = []
        self._heartbeat: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> FakeEngine:
        eid = self.engine_id
        self._subs = [
            await self.nc.subscribe(subjects.engine_generate(eid),
                                    queue=subjects.engine_queue(eid), cb=self._on_request),
            await self.nc.subscribe(subjects.engine_abort(eid), cb=self._on_abort),
            await self.nc.subscribe(subjects.engine_control(eid), cb=self._on_control),
        ]
        await self.nc.flush()
        self._heartbeat = asyncio.create_task(self._beat())
        return self

    async def stop(self) -> None:
        """Fall silent: no heartbeats, no answers."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        for task in list(self._tasks):
            task.cancel()
        for sub in self._subs:
            await sub.unsubscribe()
        self._subs.clear()

    async def wait_for(self, what: str, count: int = 1, timeout_s: float = 5.0) -> None:
        """Until `requests` or `aborts` holds `count` entries."""
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: len(getattr(self, what)) >= count), timeout_s
            )

    async def announce_cached(self, token_ids: list[int], cache_salt: str = "") -> None:
        """Publish a CacheEvent as a scheduler does for a finished request."""
        event = mpb.CacheEvent(engine_id=self.engine_id)
        event.inserted.add(cache_salt=cache_salt, token_ids=token_ids)
        await self.nc.publish(subjects.cache_events(self.engine_id), event.SerializeToString())

    def status(self) -> mpb.EngineStatus:
        return mpb.EngineStatus(
            engine_id=self.engine_id,
            running=self.load,
            context_length=self.context_length,
            vocab_size=self.vocab_size,
            model_path="fake",
            down=self.down,
            **MOE_SHAPE,
        )

    async def _beat(self) -> None:
        while True:
            await self.nc.publish(subjects.ENGINES, self.status().SerializeToString())
            await asyncio.sleep(self.heartbeat_s)

    async def _on_request(self, msg: Msg) -> None:
        request = mpb.EngineRequest.FromString(msg.data)
        async with self._changed:
            self.requests.append(request)
            self._changed.notify_all()
        task = asyncio.create_task(self._answer(request))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_abort(self, msg: Msg) -> None:
        async with self._changed:
            self.aborts.append(mpb.AbortRequest.FromString(msg.data).rid)
            self._changed.notify_all()

    async def _on_control(self, msg: Msg) -> None:
        op = json.loads(msg.data)["op"]
        if op == "flush":
            self.flushes += 1
            await msg.respond(json.dumps({"success": self.flush_ok}).encode())
        else:
            await msg.respond(json.dumps({"engine_id": self.engine_id, "fake": True}).encode())

    def _cached(self, ids: list[int]) -> int:
        best = 0
        for seen in self._seen:
            n = 0
            while n < min(len(seen), len(ids)) and seen[n] == ids[n]:
                n += 1
            best = max(best, n)
        self._seen.append(ids)
        return best

    async def _answer(self, request: mpb.EngineRequest) -> None:
        chunks = self._chunks(request)
        if self.lose:
            lost = mpb.TextChunk(rid=request.rid, seq=0, prompt_tokens=len(request.input_ids))
            lost.finish.CopyFrom(mpb.Finish(kind="abort", message=f"engine {self.engine_id} "
                                            "lost its worker", engine_lost=True))
            chunks = [lost]
        elif self.gap:
            chunks = chunks[1:]
        elif self.refuse_grammars and request.sampling.regex:
            refused = mpb.TextChunk(rid=request.rid, seq=0, prompt_tokens=len(request.input_ids))
            refused.finish.CopyFrom(mpb.Finish(kind="abort", status=400, message=(
                "the regex could not be compiled: unbalanced parenthesis")))
            chunks = [refused]
        if self.hold:
            await self._send(request, chunks[:1])
            await self.wait_for("aborts", len(self.aborts) + 1, timeout_s=30)
            return
        if self.reverse:
            chunks.reverse()
        for chunk in chunks:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            await self._send(request, [chunk])

    async def _send(self, request: mpb.EngineRequest, chunks: list[mpb.TextChunk]) -> None:
        message = mpb.TextChunks()
        for chunk in chunks:
            plain = chunk.seq and not chunk.HasField("finish") and not chunk.HasField("logprobs")
            if not (self.packed and plain):
                message.chunks.append(chunk)
                continue
            p = message.packed
            p.rids.append(chunk.rid)
            p.texts.append(chunk.text)
            p.seqs += int_array([chunk.seq]).tobytes()
            p.id_lens += int_array([len(chunk.output_ids)]).tobytes()
            p.ids += int_array(chunk.output_ids).tobytes()
            p.completion_tokens += int_array([chunk.completion_tokens]).tobytes()
        payload = message.SerializeToString()
        await self.nc.publish(request.reply_to, payload)

    def _chunks(self, request: mpb.EngineRequest) -> list[mpb.TextChunk]:
        ids = list(request.input_ids)
        out = echo_ids(ids, request.sampling.max_new_tokens)
        cached = self._cached(ids)
        common = {"rid": request.rid, "prompt_tokens": len(ids), "cached_tokens": cached,
                  "cached_host_tokens": host_part(cached)}
        chunks = [
            mpb.TextChunk(seq=i, text=token_text(t), output_ids=[t], completion_tokens=i + 1,
                          **common)
            for i, t in enumerate(out)
        ] or [mpb.TextChunk(seq=0, **common)]
        if request.return_logprob:
            for i, (chunk, t) in enumerate(zip(chunks, out, strict=False)):
                chunk.logprobs.output.append(output_logprob(i))
                if request.top_logprobs_num:
                    chunk.logprobs.output_top.append(_top(t, request.top_logprobs_num))
            self._add_input_logprobs(request, chunks)
        limit = request.sampling.max_new_tokens
        chunks[-1].finish.CopyFrom(mpb.Finish(kind="length", token_id=limit))
        if self.extra_finish:
            late = mpb.TextChunk(seq=len(chunks), text="LATE", **common)
            late.finish.CopyFrom(mpb.Finish(kind="abort", message="late"))
            chunks.append(late)
        return chunks

    def _add_input_logprobs(self, request: mpb.EngineRequest, chunks: list[mpb.TextChunk]) -> None:
        """Prompt logprobs from logprob_start_len on, split over the first two chunks."""
        if request.logprob_start_len < 0:
            return
        positions = list(range(request.logprob_start_len, len(request.input_ids)))
        if len(chunks) == 1:
            parts = [(chunks[0], positions, 0)]
        else:
            half = len(positions) // 2
            parts = [(chunks[0], positions[:half], 0), (chunks[1], positions[half:], half)]
        for chunk, part, offset in parts:
            chunk.logprobs.input_offset = offset
            chunk.logprobs.input.extend(input_logprob(p) for p in part)
            if request.top_logprobs_num:
                chunk.logprobs.input_top.extend(
                    _top(request.input_ids[p], request.top_logprobs_num) if p else wpb.TopLogprobs()
                    for p in part
                )
