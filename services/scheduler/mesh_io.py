"""The scheduler's NATS messages, converted here and nowhere else: an EngineRequest
becomes a Req, an AbortRequest's reason a FinishReason, and a request's progress becomes
its update in a step's TokenStep for the detokenizers (what is new since the last update,
plus the few tokens of context any detokenizer replica needs): a TokenUpdate, or an entry
of the step's packed arrays when new ids are all it carries."""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.request import cache_namespace
from radixmesh.core.sampling_params import LogprobRequest
from radixmesh.core.step import TopLogprobs, int_array, kv_key
from radixmesh.engine.disaggregation import Committed, Handoff, Transfer, handoff_key
from radixmesh.engine.request import Req
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import finish_from_proto, finish_to_proto, sampling_from_proto


def request_from_proto(msg: mpb.EngineRequest) -> Req:
    """The scheduler's request (its sampling parameters as the front door checked them);
    ValueError when its handoff is for other tokens."""
    req = Req(
        rid=msg.rid,
        input_ids=list(msg.input_ids),
        params=sampling_from_proto(msg.sampling),
        seed=msg.sampling.seed,
        namespace=cache_namespace(msg.cache_salt or None, msg.lora_path),
        priority=msg.priority,
        logprobs=LogprobRequest(msg.return_logprob, msg.top_logprobs_num, msg.logprob_start_len),
        lora=msg.lora_path,
        pooling=msg.pooling,
        score_ids=list(msg.score_ids),
    )
    if msg.prefill_engine:
        req.transfer = Transfer(msg.prefill_engine)
    if msg.HasField("handoff"):
        h = msg.handoff
        if h.key != kv_key(req.input_ids, h.start, req.namespace):
            raise ValueError(f"the handoff from {h.decode_engine} names other tokens")
        req.rid = handoff_key(msg.rid, h.decode_engine)
        req.handoff = Handoff(msg.rid, h.decode_engine, h.start, list(h.dest_slots),
                              list(h.dest_workers), h.dest_host, h.key)
    return req


def handoff_request(msg: mpb.EngineRequest, engine_id: str, start: int, slots: list[int],
                    key: str, workers: list[str], host: str) -> bytes:
    """`msg` as this decode engine sends it on to the prefill engine, with where the KV goes."""
    out = mpb.EngineRequest()
    out.CopyFrom(msg)
    out.prefill_engine = ""
    out.handoff.CopyFrom(mpb.KVHandoff(
        decode_engine=engine_id, start=start, dest_slots=slots, dest_workers=workers,
        dest_host=host, key=key,
    ))
    return out.SerializeToString()


def commit_to_proto(req: Req, engine_id: str) -> mpb.KVCommit:
    """A prefill engine's request handed back to its decode engine: its first token(s), or
    why its KV did not go (the request ended otherwise, e.g. the worker was lost)."""
    handoff = req.handoff
    assert handoff is not None and req.finish is not None
    sent = handoff.sent
    error = sent.error if sent is not None else ""
    if not handoff.done:
        error = error or req.finish.message or "the prefill engine dropped the request"
    out = mpb.KVCommit(
        rid=handoff.rid,
        prefill_engine=engine_id,
        error=error,
        output_ids=req.output_ids,
        transfer_tokens=len(handoff.dest_slots),
        transfer_bytes=sent.bytes if sent is not None else 0,
        transfer_ms=sent.ms if sent is not None else 0.0,
        prefill_cached_tokens=req.cached_tokens,
    )
    if handoff.finish is not None:
        out.finish.CopyFrom(finish_to_proto(handoff.finish))
    if req.logprobs.return_logprob:
        out.logprobs.CopyFrom(mpb.Logprobs(
            output=req.output_logprobs,
            output_top=[_top(t) for t in req.output_top_logprobs],
            input=req.input_logprobs,
            input_top=[_top(t) for t in req.input_top_logprobs],
        ))
    return out


def committed_from_proto(msg: mpb.KVCommit) -> Committed:
    """The decode engine's side of commit_to_proto."""
    lp = msg.logprobs
    return Committed(
        error=msg.error,
        output_ids=list(msg.output_ids),
        output_logprobs=list(lp.output),
        output_top_logprobs=[[(t.token_id, t.logprob) for t in top.items]
                             for top in lp.output_top],
        input_logprobs=list(lp.input),
        input_top_logprobs=[[(t.token_id, t.logprob) for t in top.items]
                            for top in lp.input_top],
        finish=finish_from_proto(msg.finish) if msg.HasField("finish") else None,
        bytes=msg.transfer_bytes,
        ms=msg.transfer_ms,
    )


def abort_reason(msg: mpb.AbortRequest) -> FinishReason | None:
    """A stop string the detokenizer matched; None for a client that went away."""
    if msg.HasField("finish") and msg.finish.kind == FinishKind.STOP:
        return FinishReason(FinishKind.STOP, msg.finish.text or None)
    return None


def _top(items: TopLogprobs) -> wpb.TopLogprobs:
    return wpb.TopLogprobs(items=[wpb.TokenLogprob(token_id=t, logprob=lp) for t, lp in items])


@dataclass
class _Route:
    """Where one request's updates go and how far they have got."""

    reply_to: str
    detok: mpb.DetokSpec
    context: int
    interval: int  # output tokens between updates, after the first
    seq: int = 0
    sent_at: float = 0.0  # when its last update went (UpdateBuilder.clock)
    sent_outputs: int = 0
    sent_input_logprobs: int = 0
    # What its packed updates share with other requests': reply_to and detok less the
    # prompt's tail (which only updates with the prompt in their context need).
    shared: tuple[str, bytes] = field(init=False)

    def __post_init__(self) -> None:
        spec = mpb.DetokSpec()
        spec.CopyFrom(self.detok)
        spec.ClearField("prompt_tail")
        self.shared = (self.reply_to, spec.SerializeToString(deterministic=True))


class Sent(NamedTuple):
    """What one request's update in a step holds."""

    first: bool
    new_tokens: int


@dataclass
class StepMessage:
    """One step's TokenStep as it is built: a TokenUpdate for each request that needs one,
    every other request's update packed (PackedUpdates)."""

    engine_id: str
    updates: list[mpb.TokenUpdate] = field(default_factory=list)
    rids: list[str] = field(default_factory=list)
    seqs: array[int] = field(default_factory=int_array)
    offsets: array[int] = field(default_factory=int_array)
    routes: array[int] = field(default_factory=int_array)
    context_lens: array[int] = field(default_factory=int_array)
    context_ids: array[int] = field(default_factory=int_array)
    new_lens: array[int] = field(default_factory=int_array)
    new_ids: array[int] = field(default_factory=int_array)
    _shared: dict[tuple[str, bytes], int] = field(default_factory=dict)

    def pack(self, rid: str, route: _Route, context: list[int], new: list[int]) -> None:
        """Add a request's update of new ids alone."""
        index = self._shared.setdefault(route.shared, len(self._shared))
        self.rids.append(rid)
        self.seqs.append(route.seq)
        self.offsets.append(route.sent_outputs)
        self.routes.append(index)
        self.context_lens.append(len(context))
        self.context_ids.extend(context)
        self.new_lens.append(len(new))
        self.new_ids.extend(new)

    def __len__(self) -> int:
        return len(self.updates) + len(self.rids)

    def to_proto(self) -> mpb.TokenStep:
        step = mpb.TokenStep(updates=self.updates, engine_id=self.engine_id)
        if self.rids:
            p = step.packed
            p.rids.extend(self.rids)
            p.seqs, p.offsets = self.seqs.tobytes(), self.offsets.tobytes()
            p.routes = self.routes.tobytes()
            p.context_lens, p.context_ids = self.context_lens.tobytes(), self.context_ids.tobytes()
            p.new_lens, p.new_ids = self.new_lens.tobytes(), self.new_ids.tobytes()
            for reply_to, spec in self._shared:
                p.reply_to.append(reply_to)
                p.detok.add().ParseFromString(spec)
        return step


# Output tokens between the updates of a request whose caller waits for the whole answer:
# enough to make its updates cost next to nothing, few enough that a long answer still
# shows progress to the tokenizer (which ends a request that goes silent).
UNSTREAMED_INTERVAL = 64
# Seconds a request's new tokens may wait for their interval: a slow model's answer still
# shows progress well inside the tokenizer's stall timeout.
MAX_UPDATE_GAP_S = 5.0


class UpdateBuilder:
    """Per-request delivery state, keyed by the request object (a refused duplicate id
    never takes another request's route); the scheduler's requests stay free of transport.
    A request's first output goes at once, then one update every `stream_interval` tokens
    if it streams (UNSTREAMED_INTERVAL if not) or MAX_UPDATE_GAP_S after the last, and its
    finish; every token where it has stop strings, which the detokenizer looks for."""

    def __init__(self, engine_id: str, stream_interval: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine_id = engine_id
        self.stream_interval = stream_interval
        self.clock = clock
        self._routes: dict[Req, _Route] = {}

    def register(self, req: Req, msg: mpb.EngineRequest) -> None:
        """Where `req`'s updates go, from the message it came in."""
        interval = 1
        if not msg.detok.stop:
            interval = self.stream_interval if msg.stream else UNSTREAMED_INTERVAL
        self._routes[req] = _Route(msg.reply_to, msg.detok, max(msg.detok_context, 1), interval)

    def due(self, req: Req, now: float) -> bool:
        """Whether `req`'s news goes out with this step at `now` (on `clock`): always once
        it has finished."""
        route = self._routes.get(req)
        return (route is None or req.finish is not None or not route.seq
                or len(req.output_ids) - route.sent_outputs >= route.interval
                or now - route.sent_at >= MAX_UPDATE_GAP_S)

    def add(self, step: StepMessage, req: Req, traceparent: str = "", lost: bool = False
            ) -> Sent | None:
        """Put what is new for `req` in `step`: packed when new ids are all it carries; with
        `lost`, a finish says the engine lost its workers."""
        route = self._routes.get(req)
        if route is None:
            return None
        offset, end = route.sent_outputs, len(req.output_ids)
        if (route.seq and not traceparent and req.finish is None
                and not req.logprobs.return_logprob and req.transfer is None
                and not req.spec_verify_ct):
            # Packed updates carry no prompt tail: a context of exactly the output so far
            # takes one prompt id more, as the tail would have come before it.
            size = route.context + (offset == route.context)
            step.pack(req.rid, route, _context(req, offset, size), req.output_ids[offset:end])
            route.seq += 1
            route.sent_outputs = end
            route.sent_at = self.clock()
            return Sent(False, end - offset)
        update = self.build(req, traceparent)
        assert update is not None
        if lost and update.HasField("finish"):
            update.finish.engine_lost = True
        step.updates.append(update)
        return Sent(update.seq == 0, len(update.new_ids))

    def build(self, req: Req, traceparent: str = "") -> mpb.TokenUpdate | None:
        """What is new for `req` since its last update; forgets it once finished."""
        route = self._routes.get(req)
        if route is None:
            return None
        offset, end = route.sent_outputs, len(req.output_ids)
        update = mpb.TokenUpdate(
            rid=req.rid,
            reply_to=route.reply_to,
            seq=route.seq,
            offset=offset,
            context_ids=_context(req, offset, route.context),
            new_ids=req.output_ids[offset:end],
            detok=route.detok,
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            cached_host_tokens=req.cached_host_tokens,
            cached_storage_tokens=req.cached_storage_tokens,
            spec_verify_ct=req.spec_verify_ct,
            spec_accepted_tokens=req.spec_accepted_tokens,
            engine_id=self.engine_id,
            traceparent=traceparent,
        )
        if req.transfer is not None:
            t = req.transfer
            update.transfer.CopyFrom(mpb.Transfer(
                prefill_engine=t.prefill_engine, tokens=t.tokens if not t.fallback else 0,
                bytes=t.bytes, ms=t.ms, fallback=t.fallback,
            ))
        if req.logprobs.return_logprob:
            start = route.sent_input_logprobs
            update.logprobs.CopyFrom(
                mpb.Logprobs(
                    output=req.output_logprobs[offset:end],
                    output_top=[_top(t) for t in req.output_top_logprobs[offset:end]],
                    input_offset=start,
                    input=req.input_logprobs[start:],
                    input_top=[_top(t) for t in req.input_top_logprobs[start:]],
                )
            )
            route.sent_input_logprobs = len(req.input_logprobs)
        if req.finish is not None:
            update.finish.CopyFrom(finish_to_proto(req.finish))
            del self._routes[req]
        route.seq += 1
        route.sent_outputs = end
        route.sent_at = self.clock()
        return update

    def embedded(self, req: Req) -> tuple[str, mpb.TextChunk] | None:
        """A finished embedding request's one chunk, with its vector, and its owner's subject:
        nothing to detokenize, so it goes there directly."""
        route = self._routes.pop(req, None)
        if route is None or req.finish is None:
            return None
        return route.reply_to, mpb.TextChunk(
            rid=req.rid,
            finish=finish_to_proto(req.finish),
            prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            cached_host_tokens=req.cached_host_tokens,
            cached_storage_tokens=req.cached_storage_tokens,
            engine_id=self.engine_id,
            embedding=req.embedding or [],
        )

    def refusal(self, req: Req, message: str, traceparent: str = "") -> mpb.TokenUpdate | None:
        """The one update of a request the scheduler could not take."""
        route = self._routes.pop(req, None)
        if route is None:
            return None
        return self.rejection(req.rid, route.reply_to, route.detok, message, traceparent)

    def rejection(
        self, rid: str, reply_to: str, detok: mpb.DetokSpec, message: str, traceparent: str = ""
    ) -> mpb.TokenUpdate:
        """The one update of a request refused before it became a Req."""
        return mpb.TokenUpdate(
            rid=rid,
            reply_to=reply_to,
            detok=detok,
            finish=mpb.Finish(kind=FinishKind.ABORT.value, message=message),
            engine_id=self.engine_id,
            traceparent=traceparent,
        )


def _context(req: Req, offset: int, size: int) -> list[int]:
    """The `size` tokens right before output position `offset` (prompt tail first)."""
    if offset >= size:
        return req.output_ids[offset - size : offset]
    return req.input_ids[max(0, len(req.input_ids) - (size - offset)) :] + req.output_ids[:offset]
