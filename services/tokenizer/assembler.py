"""The requests' TextChunks back in order, as GenerationChunks for their readers: the
conversion from the detokenizers' messages to what the front doors render (ChunkAssembler),
and what waits for each request's reader (InFlight, fed by `deliver`).

Chunks of one request may come from different detokenizer replicas, so they can arrive out
of order; `seq` numbers them 0, 1, 2, ... and the first finish (in seq order) ends it."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.meta_info import Disaggregated, TokenLogprob
from radixmesh.core.request import GenerationRequest
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import PackedChunk, finish_from_proto, packed_chunks
from radixmesh.services.tokenizer.generation import GenerationChunk


def _disaggregated(chunk: mpb.TextChunk) -> Disaggregated | None:
    if not chunk.HasField("transfer"):
        return None
    t = chunk.transfer
    return Disaggregated(t.prefill_engine, chunk.engine_id, t.tokens, t.bytes, t.ms, t.fallback)


def _logprob(value: float) -> float | None:
    # The first prompt token has no logprob (it travels as NaN); JSON has no infinities.
    return value if math.isfinite(value) else None


def _top(items: Iterable[wpb.TokenLogprob]) -> list[TokenLogprob]:
    return [(_logprob(t.logprob), t.token_id, None) for t in items]


class ChunkAssembler:
    """In-order delivery of one request's output; prompt logprobs gathered until the end."""

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self.finished = False
        self.prompt_tokens = len(request.input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.cached_host_tokens = 0
        self.cached_storage_tokens = 0
        self._next_seq = 0
        self._early: dict[int, mpb.TextChunk | PackedChunk] = {}
        self._input_logprobs: list[float] = []
        self._input_top: list[list[TokenLogprob] | None] = []

    def add(self, chunk: mpb.TextChunk | PackedChunk) -> list[GenerationChunk]:
        """Take one chunk (a packed one: new text and ids alone); returns the chunks now
        deliverable, in order."""
        if self.finished or chunk.seq < self._next_seq:
            return []
        if self._take_next(chunk):  # in order, as nearly always
            return [self._convert(chunk)]
        self._early[chunk.seq] = chunk
        ready = []
        while not self.finished and self._next_seq in self._early:
            ready.append(self._convert(self._early.pop(self._next_seq)))
            self._next_seq += 1
        if self.finished:
            self._early.clear()
        return ready

    def next_packed(self, chunk: PackedChunk) -> bool:
        """Take a packed chunk's place and count where it is the next in order with none
        held (its text and ids are then the caller's to join); False, taking nothing, where
        it must go through `add`."""
        if self.finished or not self._take_next(chunk):
            return False
        self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens)
        return True

    def _take_next(self, chunk: mpb.TextChunk | PackedChunk) -> bool:
        """Whether `chunk` is the next in order with none held early; its place is then
        taken."""
        if chunk.seq != self._next_seq or self._early:
            return False
        self._next_seq += 1
        return True

    @property
    def has_gap(self) -> bool:
        """Chunks arrived past one that has not: held until it comes."""
        return bool(self._early)

    def abort(self, message: str) -> GenerationChunk:
        """The last chunk of a request the mesh gave up on."""
        self.finished = True
        self._early.clear()
        return GenerationChunk(
            rid=self.request.rid,
            text="",
            output_ids=[],
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            finish=FinishReason(FinishKind.ABORT, message=message),
            cached_host_tokens=self.cached_host_tokens,
            cached_storage_tokens=self.cached_storage_tokens,
        )

    def _convert(self, chunk: mpb.TextChunk | PackedChunk) -> GenerationChunk:
        if isinstance(chunk, PackedChunk):
            self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens)
            return GenerationChunk(
                self.request.rid, chunk.text, chunk.ids.tolist(), self.prompt_tokens,
                self.completion_tokens,
                self.cached_tokens, cached_host_tokens=self.cached_host_tokens,
                cached_storage_tokens=self.cached_storage_tokens,
            )
        self.prompt_tokens = chunk.prompt_tokens or self.prompt_tokens
        # A chunk without a cache count (a refusal) keeps the one already known.
        if chunk.cached_tokens:
            self.cached_tokens = chunk.cached_tokens
            self.cached_host_tokens = chunk.cached_host_tokens
            self.cached_storage_tokens = chunk.cached_storage_tokens
        self.completion_tokens = max(self.completion_tokens, chunk.completion_tokens)
        ids = list(chunk.output_ids)
        out = GenerationChunk(
            rid=self.request.rid,
            text=chunk.text,
            output_ids=ids,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            cached_host_tokens=self.cached_host_tokens,
            cached_storage_tokens=self.cached_storage_tokens,
            spec_verify_ct=chunk.spec_verify_ct,
            spec_accepted_tokens=chunk.spec_accepted_tokens,
            disaggregated=_disaggregated(chunk),
            embedding=list(chunk.embedding) or None,
        )
        if chunk.HasField("logprobs"):  # only a request that asked has them
            logprobs = chunk.logprobs
            out.output_token_logprobs = [
                (_logprob(lp), tid, None) for lp, tid in zip(logprobs.output, ids, strict=False)
            ]
            out.output_top_logprobs = [_top(t.items) for t in logprobs.output_top]
            self._gather_input_logprobs(logprobs)
        if chunk.HasField("finish"):
            self.finished = True
            out.finish = finish_from_proto(chunk.finish)
            out.input_token_logprobs, out.input_top_logprobs = self._input_logprob_lists()
        return out

    def _gather_input_logprobs(self, logprobs: mpb.Logprobs) -> None:
        start = logprobs.input_offset
        end = start + len(logprobs.input)
        if end > len(self._input_logprobs):
            self._input_logprobs.extend([math.nan] * (end - len(self._input_logprobs)))
        self._input_logprobs[start:end] = logprobs.input
        tops = [_top(t.items) or None for t in logprobs.input_top]
        if tops:
            top_end = start + len(tops)
            if top_end > len(self._input_top):
                self._input_top.extend([None] * (top_end - len(self._input_top)))
            self._input_top[start:top_end] = tops

    def _input_logprob_lists(
        self,
    ) -> tuple[list[TokenLogprob], list[list[TokenLogprob] | None]]:
        first = max(self.request.logprobs.logprob_start_len, 0)
        prompt = self.request.input_ids[first:]
        token_logprobs = [
            (_logprob(lp), tid, None)
            for lp, tid in zip(self._input_logprobs, prompt, strict=False)
        ]
        return token_logprobs, list(self._input_top)


@dataclass
class InFlight:
    """One request this replica sent and is waiting on."""

    engine_id: str
    assembler: ChunkAssembler
    last_output: float = field(default_factory=time.monotonic)  # sent, or its last chunk
    gap_since: float | None = None  # since when a chunk is missing
    lost: bool = False  # its engine went away or lost its workers
    # Output not yet taken by the request's reader: what arrives before it wakes joins one
    # chunk, so a reader that falls behind catches up in one go.
    ready: GenerationChunk | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)

    def arrived(self, chunks: list[GenerationChunk], now: float) -> None:
        """Output came (`chunks`: what is now in order): deliver it, note any gap."""
        self.last_output = now
        for chunk in chunks:
            self.deliver(chunk)
        if not self.assembler.has_gap:
            self.gap_since = None
        elif self.gap_since is None:
            self.gap_since = now

    def packed(self, chunk: PackedChunk, now: float) -> None:
        """A packed chunk came (new text and ids alone): where it is next in order and
        output waits for the reader, as with a busy front door, it joins that output."""
        ready = self.ready
        if ready is not None and ready.finish is None and self.assembler.next_packed(chunk):
            ready.text += chunk.text
            ready.output_ids += chunk.ids
            ready.completion_tokens = self.assembler.completion_tokens
            self.last_output = now
        else:
            self.arrived(self.assembler.add(chunk), now)

    def deliver(self, chunk: GenerationChunk) -> None:
        if self.ready is None:
            self.ready = chunk
        else:
            self.ready.merge(chunk)
        self.wake.set()

    def pop(self) -> GenerationChunk | None:
        """The output that arrived since the last take, if any."""
        chunk, self.ready = self.ready, None
        return chunk

    async def take(self) -> GenerationChunk:
        """The output that arrived since the last take; waits for some."""
        while (chunk := self.pop()) is None:
            self.wake.clear()
            await self.wake.wait()
        return chunk

    def restart(self, engine_id: str) -> None:
        """Start over on `engine_id`, as if new (its engine lost it before any output)."""
        self.engine_id, self.lost = engine_id, False
        self.assembler = ChunkAssembler(self.assembler.request)
        self.last_output, self.gap_since = time.monotonic(), None

    def end(self, message: str, lost: bool = False) -> None:
        """End it with an abort (the mesh gave up on it; `lost`: with its engine)."""
        if not self.assembler.finished:
            self.lost = self.lost or lost
            self.deliver(self.assembler.abort(message))


def deliver(message: mpb.TextChunks, flights: Mapping[str, InFlight], now: float) -> None:
    """A TextChunks' chunks to their requests (those still in `flights`, by id)."""
    for chunk in message.chunks:
        flight = flights.get(chunk.rid)
        if flight is None:
            continue  # a late chunk of a request that already ended
        if chunk.finish.engine_lost:
            flight.lost = True
        flight.arrived(flight.assembler.add(chunk), now)
    for packed in packed_chunks(message.packed):
        flight = flights.get(packed.rid)
        if flight is not None:
            flight.packed(packed, now)
