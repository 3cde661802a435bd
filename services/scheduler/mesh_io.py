"""The scheduler's NATS messages, converted here and nowhere else: an EngineRequest
becomes a Req, an AbortRequest's reason a FinishReason, and a request's progress becomes
TokenUpdates for the detokenizers (what is new since the last update, plus the few tokens
of context any detokenizer replica needs)."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.sampling_params import LogprobRequest
from radixmesh.core.step import TopLogprobs
from radixmesh.engine.request import Req
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.proto import worker_pb2 as wpb
from radixmesh.proto.convert import sampling_from_proto


def request_from_proto(msg: mpb.EngineRequest) -> Req:
    """The scheduler's request; ValueError when its sampling parameters are invalid."""
    return Req(
        rid=msg.rid,
        input_ids=list(msg.input_ids),
        params=sampling_from_proto(msg.sampling, msg.max_new_tokens),
        seed=msg.sampling.seed,
        namespace=msg.cache_salt or None,
        priority=msg.priority,
        logprobs=LogprobRequest(msg.return_logprob, msg.top_logprobs_num, msg.logprob_start_len),
    )


def abort_reason(msg: mpb.AbortRequest) -> FinishReason | None:
    """A stop string the detokenizer matched; None for a client that went away."""
    if msg.HasField("finish") and msg.finish.kind == FinishKind.STOP:
        return FinishReason(FinishKind.STOP, msg.finish.text or None)
    return None


def finish_to_proto(reason: FinishReason) -> mpb.Finish:
    """FinishReason as the Finish message (a length limit travels as token_id)."""
    out = mpb.Finish(kind=reason.kind.value, message=reason.message or "")
    if isinstance(reason.matched, str):
        out.text = reason.matched
    elif isinstance(reason.matched, int):
        out.token_id = reason.matched
    return out


def _top(items: TopLogprobs) -> wpb.TopLogprobs:
    return wpb.TopLogprobs(items=[wpb.TokenLogprob(token_id=t, logprob=lp) for t, lp in items])


@dataclass
class _Route:
    """Where one request's updates go and how far they have got."""

    reply_to: str
    detok: mpb.DetokSpec
    context: int
    seq: int = 0
    sent_outputs: int = 0
    sent_input_logprobs: int = 0


class UpdateBuilder:
    """Per-request delivery state, keyed by the request object (a refused duplicate id
    never takes another request's route); the scheduler's requests stay free of transport."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._routes: dict[Req, _Route] = {}

    def register(self, req: Req, msg: mpb.EngineRequest) -> None:
        """Where `req`'s updates go, from the message it came in."""
        self._routes[req] = _Route(msg.reply_to, msg.detok, max(msg.detok_context, 1))

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
        return update

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
