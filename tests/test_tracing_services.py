"""Each service's spans without sockets: the scheduler's (driven like its loop drives it,
against a model-free worker), the tokenizer's per-request trace and the detokenizer's."""

from __future__ import annotations

import time

import pytest
from fake_worker import FakeWorker, Model, next_token
from opentelemetry.trace import SpanKind, StatusCode
from tracing_helpers import by_name, one, traced

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.request import GenerationRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.settings import SpeculativeSettings
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import Scheduler
from radixmesh.engine.scheduler_config import SchedulerConfig
from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.services.detokenizer.server import StepReplies
from radixmesh.services.detokenizer.step_trace import StepTrace
from radixmesh.services.scheduler.mesh_io import UpdateBuilder
from radixmesh.services.scheduler.request_traces import RequestTraces
from radixmesh.services.tokenizer.generation import GenerationChunk
from radixmesh.services.tokenizer.request_trace import RequestTrace, encode_traced
from radixmesh.services.tokenizer.router import Router
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.propagation import (
    context_from_headers,
    context_from_metadata,
    headers,
    traceparent,
)
from radixmesh.tracing.spans import current_span, start_span

# ---- scheduler --------------------------------------------------------------------------


class Engine:
    """The scheduler service's loop without NATS or gRPC, with its RequestTraces."""

    def __init__(self, chunk: int = 8, speculative: SpeculativeSettings | None = None,
                 model: Model = next_token) -> None:
        self.sched = Scheduler(SchedulerConfig(
            num_slots=1024, chunked_prefill_size=chunk,
            speculative=speculative or SpeculativeSettings()))
        self.worker = FakeWorker(1024, model=model)
        self.updates = UpdateBuilder("e0")
        self.traces = RequestTraces("e0")
        self.sent: list[mpb.TokenUpdate] = []
        self.metadata: list[tuple[tuple[str, str], ...] | None] = []

    def add(self, rid: str, prompt: list[int], max_new: int, hdrs: dict[str, str] | None) -> Req:
        req = Req(rid=rid, input_ids=prompt, params=SamplingParams(max_new_tokens=max_new), seed=0)
        self.traces.received(req, hdrs)
        self.updates.register(req, mpb.EngineRequest(reply_to="reply", detok_context=1))
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        started = time.time_ns()
        batch = self.sched.schedule()
        if batch is not None:
            self.traces.scheduled(batch, started, time.time_ns())
            with self.traces.forward(batch) as metadata:
                self.metadata.append(metadata)
                result = self.worker.forward(batch.batch)
                self.traces.verified(batch, result)
            self.sched.process_result(batch, result)
        for req in self.sched.drain_updates():
            trace = self.traces.sent(req.rid, len(req.output_ids), req.finish, req.cached_tokens)
            update = self.updates.build(req, trace)
            if update is not None:
                self.sent.append(update)

    def run(self) -> None:
        while self.sched.has_work():
            self.step()


def _ids(span) -> tuple[int, int]:
    return span.context.trace_id, span.context.span_id


def test_scheduler_spans_of_one_request_and_a_prefix_hit():
    with traced() as exported:
        upstream = start_span("generate")
        assert upstream is not None
        engine = Engine(chunk=8)
        engine.add("a", list(range(1, 21)), 4, headers(upstream))
        engine.run()
        engine.add("b", list(range(1, 21)) + [40, 41, 42], 2, headers(upstream))
        engine.run()
        upstream.end()
        spans = exported.get_finished_spans()

    roots = by_name(spans, "engine request")
    assert [r.attributes[attr.RID] for r in roots] == ["a", "b"]
    root = roots[0]
    assert root.kind is SpanKind.CONSUMER
    assert root.parent.span_id == upstream.get_span_context().span_id
    assert root.attributes[attr.FINISH] == "length"
    assert root.attributes[attr.COMPLETION_TOKENS] == 4
    assert root.attributes[attr.CACHED_TOKENS] == 0
    assert root.status.status_code is StatusCode.UNSET

    def children(name: str, rid: str) -> list:
        found = [s for s in by_name(spans, name) if s.attributes[attr.RID] == rid]
        for s in found:
            assert s.parent.span_id == next(
                r for r in roots if r.attributes[attr.RID] == rid).context.span_id
        return found

    (queue,) = children("queue wait", "a")
    (match,) = children("prefix match", "a")
    assert queue.end_time <= match.start_time <= match.end_time
    assert match.attributes[attr.PREFIX_MATCHED] == 0
    assert match.attributes[attr.PREFIX_TIER] == "device"
    chunks = sorted(children("prefill chunk", "a"), key=lambda s: s.start_time)
    assert [(c.attributes[attr.CHUNK_INDEX], c.attributes[attr.CHUNK_START],
             c.attributes[attr.CHUNK_TOKENS], c.attributes[attr.CHUNK_LAST]) for c in chunks] == [
        (0, 0, 8, False), (1, 8, 8, False), (2, 16, 4, True)]
    (decode,) = children("decode", "a")
    assert decode.attributes[attr.DECODE_STEPS] == 3  # the first token came with the prefill
    assert decode.attributes[attr.COMPLETION_TOKENS] == 4
    # The first token came before decoding started; then a mark at each power of two.
    assert [(e.name, e.attributes[attr.COMPLETION_TOKENS]) for e in decode.events] == [
        ("output tokens", 2), ("output tokens", 4)]

    # One forward batch per step, each linked to its request; its parent is the prefill
    # chunk it computes, else the decode; its context goes to the worker.
    batches = sorted((s for s in by_name(spans, "forward batch")
                      if s.attributes[attr.RID] == "a"), key=lambda s: s.start_time)
    assert len(batches) == 6
    for batch in batches:
        assert batch.kind is SpanKind.CLIENT
        assert [_ids_of_link(ln) for ln in batch.links] == [_ids(root)]
    assert [b.parent.span_id for b in batches[:3]] == [c.context.span_id for c in chunks]
    assert {b.parent.span_id for b in batches[3:]} == {decode.context.span_id}
    sent = [context_from_metadata(m) for m in engine.metadata[:6]]
    assert [_remote(c) for c in sent] == [_ids(b) for b in batches]

    # Updates name the tokenizer's request, so detokenizer spans hang under it.
    assert {u.traceparent for u in engine.sent} == {traceparent(upstream)}

    (hit,) = children("prefix match", "b")
    assert hit.attributes[attr.PREFIX_MATCHED] == 20
    assert roots[1].attributes[attr.CACHED_TOKENS] == 20
    assert len(engine.traces) == 0


def _ids_of_link(link) -> tuple[int, int]:
    return link.context.trace_id, link.context.span_id


def _remote(context) -> tuple[int, int]:
    from opentelemetry.trace import get_current_span

    ctx = get_current_span(context).get_span_context()
    return ctx.trace_id, ctx.span_id


def test_batch_span_links_every_request_and_names_them():
    with traced() as exported:
        engine = Engine(chunk=64)
        engine.add("a", [1, 2, 3], 3, None)
        engine.add("b", [4, 5, 6, 7], 3, None)
        engine.run()
        spans = exported.get_finished_spans()
    roots = {s.attributes[attr.RID]: s for s in by_name(spans, "engine request")}
    first = min(by_name(spans, "forward batch"), key=lambda s: s.start_time)
    assert first.attributes[attr.RIDS] == ("a", "b")
    assert first.attributes[attr.BATCH_PREFILL_TOKENS] == 7
    assert first.attributes[attr.BATCH_NEW_REQUESTS] == 2
    assert sorted(_ids_of_link(ln) for ln in first.links) == sorted(
        _ids(roots[r]) for r in ("a", "b"))
    # Without an incoming context each request starts its own trace.
    assert roots["a"].context.trace_id != roots["b"].context.trace_id
    assert first.context.trace_id == roots["a"].context.trace_id


def test_each_verify_step_is_a_span_under_decode():
    with traced() as exported:
        engine = Engine(speculative=SpeculativeSettings(speculative_algorithm="NGRAM"),
                        model=lambda tokens: tokens[-3])  # copies its context: drafts hit
        req = engine.add("s", [1, 2, 3, 1, 2, 3], 20, None)
        engine.run()
        spans = exported.get_finished_spans()
    decode = one(spans, "decode")
    verifies = by_name(spans, "verify")
    assert len(verifies) == req.spec_verify_ct > 0
    assert all(v.parent.span_id == decode.context.span_id for v in verifies)
    assert sum(v.attributes[attr.SPEC_ACCEPTED_TOKENS] for v in verifies) == (
        req.spec_accepted_tokens)
    assert all(0 < v.attributes[attr.SPEC_DRAFT_TOKENS] <= 8 for v in verifies)


def test_abort_and_refusal_spans():
    with traced() as exported:
        engine = Engine()
        engine.add("c", [1, 2, 3], 100, None)
        engine.step()
        engine.step()
        asked = start_span("abort")
        assert asked is not None
        engine.traces.aborted("c", False, headers(asked))
        asked.end()
        engine.sched.abort("c")
        engine.run()
        engine.traces.aborted("gone", False, None)
        refused = Req(rid="d", input_ids=[1], params=SamplingParams(), seed=0)
        engine.traces.received(refused, None)
        reason = FinishReason(FinishKind.ABORT, message="prompt too long")
        engine.traces.sent("d", 0, reason, 0)
        spans = exported.get_finished_spans()
    aborts = {s.attributes[attr.RID]: s for s in by_name(spans, "abort")
              if s.attributes.get(attr.ABORT_REASON) == "requested"}
    assert aborts["c"].parent.span_id == asked.get_span_context().span_id
    assert aborts["c"].attributes[attr.ABORT_FOUND] is True
    assert aborts["gone"].attributes[attr.ABORT_FOUND] is False
    roots = {s.attributes[attr.RID]: s for s in by_name(spans, "engine request")}
    assert roots["c"].attributes[attr.FINISH] == "abort"
    assert roots["c"].status.status_code is StatusCode.UNSET
    (decode,) = [s for s in by_name(spans, "decode") if s.attributes[attr.RID] == "c"]
    assert [e.name for e in decode.events] == ["output tokens", "abort requested"]
    assert roots["d"].status.status_code is StatusCode.ERROR
    assert roots["d"].attributes[attr.FINISH_MESSAGE] == "prompt too long"
    waits = {s.attributes[attr.RID]: s for s in by_name(spans, "queue wait")}
    assert waits["d"].end_time <= roots["d"].end_time
    assert all(s.attributes[attr.RID] != "d" for s in by_name(spans, "prefix match"))


def test_scheduler_hooks_do_nothing_while_tracing_is_off():
    engine = Engine()
    engine.add("a", [1, 2, 3], 3, {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    engine.run()
    assert len(engine.traces) == 0
    assert engine.metadata == [None] * len(engine.metadata)
    assert {u.traceparent for u in engine.sent} == {""}


# ---- tokenizer ----------------------------------------------------------------------------


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, [1, 2, 3], SamplingParams(max_new_tokens=2))


def test_tokenizer_spans_of_a_request():
    router = Router()
    router.update_engine("e0", 0)
    with traced() as exported:
        with current_span("POST /generate") as http:
            assert encode_traced(_Tokenizer(), "hey", "r1") == [104, 101, 121]
            trace = RequestTrace(_request("r1"))
        assert trace.route(router, _request("r1")).engine_id == "e0"
        sent = context_from_headers(trace.headers())
        trace.chunk(GenerationChunk("r1", "a", [5], 3, 1, 0))
        trace.chunk(GenerationChunk("r1", "b", [6], 3, 2, 1, FinishReason(FinishKind.LENGTH, 2)))
        trace.end()
        spans = exported.get_finished_spans()
    generate = one(spans, "generate")
    assert _remote(sent) == _ids(generate)
    assert generate.parent.span_id == http.get_span_context().span_id
    assert generate.attributes[attr.ENGINE_ID] == "e0"
    assert generate.attributes[attr.FINISH] == "length"
    assert generate.attributes[attr.COMPLETION_TOKENS] == 2
    assert generate.attributes[attr.CACHED_TOKENS] == 1
    assert one(spans, "POST /generate").attributes[attr.RID] == "r1"
    tokenize = one(spans, "tokenize")
    assert tokenize.attributes[attr.PROMPT_TOKENS] == 3 and tokenize.attributes[attr.RID] == "r1"
    route = one(spans, "route")
    assert route.parent.span_id == generate.context.span_id
    assert route.attributes[attr.ENGINE_ID] == "e0"
    assert route.attributes[attr.ROUTE_MATCHED] == 0
    stream = one(spans, "stream out")
    assert stream.attributes[attr.STREAM_CHUNKS] == 2
    assert stream.parent.span_id == generate.context.span_id


def test_tokenizer_abort_and_no_engine():
    with traced() as exported:
        trace = RequestTrace(_request("r2"))
        with trace.aborting("the caller stopped reading") as sent:
            pass
        trace.end()
        lost = RequestTrace(_request("r3"))
        with pytest.raises(LookupError):
            lost.route(Router(), _request("r3"))
        lost.end("no engine is available")
        spans = exported.get_finished_spans()
    abort = one(spans, "abort")
    assert _remote(context_from_headers(sent)) == _ids(abort)
    assert abort.attributes[attr.ABORT_REASON] == "the caller stopped reading"
    assert one(spans, "route").status.status_code is StatusCode.ERROR
    failed = [s for s in by_name(spans, "generate") if s.attributes[attr.RID] == "r3"]
    assert failed[0].status.description == "no engine is available"


def test_tokenizer_trace_is_inert_while_tracing_is_off():
    router = Router()
    router.update_engine("e0", 0)
    trace = RequestTrace(_request("r1"))
    assert trace.route(router, _request("r1")).engine_id == "e0"
    assert trace.headers() is None
    trace.chunk(GenerationChunk("r1", "a", [5], 3, 1, 0))
    with trace.aborting("x") as sent:
        assert sent is None
    trace.end()


# ---- detokenizer ----------------------------------------------------------------------------


def test_detokenize_spans_cover_first_last_and_stopped_updates():
    with traced() as exported:
        parents = {rid: start_span(f"generate {rid}") for rid in "abcde"}
        tp = {rid: traceparent(span) for rid, span in parents.items()}
        step = mpb.TokenStep(updates=[
            mpb.TokenUpdate(rid="a", seq=0, new_ids=[1, 2], traceparent=tp["a"]),
            mpb.TokenUpdate(rid="b", seq=3, new_ids=[3], traceparent=tp["b"]),
            mpb.TokenUpdate(rid="c", seq=5, new_ids=[4], traceparent=tp["c"],
                            finish=mpb.Finish(kind="length")),
            mpb.TokenUpdate(rid="d", seq=0, new_ids=[5]),
            mpb.TokenUpdate(rid="e", seq=2, new_ids=[6], traceparent=tp["e"]),
        ])
        chunks = mpb.TextChunks(chunks=[
            mpb.TextChunk(rid="a", text="hi"), mpb.TextChunk(rid="b", text="x"),
            mpb.TextChunk(rid="c", text="yz", finish=mpb.Finish(kind="length")),
        ])
        stop = mpb.AbortRequest(rid="b", finish=mpb.Finish(kind="stop", text="x"))
        replies = StepReplies({"reply": chunks}, [("rm.engine.e0.abort", stop)], 1, 0)
        trace = StepTrace()
        trace.decoded(step, replies)
        abort_parent = context_from_headers(trace.headers("b"))
        assert trace.headers("e") is None
        trace.end()
        spans = exported.get_finished_spans()
    detok = {s.attributes[attr.RID]: s for s in by_name(spans, "detokenize")}
    assert sorted(detok) == ["a", "b", "c"]
    for rid, span in detok.items():
        assert span.parent.span_id == parents[rid].get_span_context().span_id
        assert span.attributes[attr.DETOK_STEP_UPDATES] == 5
    assert detok["a"].attributes[attr.DETOK_TEXT_CHARS] == 2
    assert detok["b"].attributes[attr.STOP_MATCHED] is True
    assert detok["c"].attributes[attr.FINISH] == "length"
    assert _remote(abort_parent) == _ids(detok["b"])


def test_a_requests_lora_adapter_is_on_its_spans():
    with traced() as exported:
        request = GenerationRequest("t", [1, 2, 3], SamplingParams(), lora_path="poet")
        RequestTrace(request).end()
        traces = RequestTraces("e0")
        traces.received(Req("t", [1, 2, 3], SamplingParams(), 0, lora="poet"), None)
        traces.received(Req("u", [1, 2, 3], SamplingParams(), 0), None)
        traces.sent("t", 0, FinishReason(FinishKind.ABORT), 0)
        traces.sent("u", 0, FinishReason(FinishKind.ABORT), 0)
        spans = exported.get_finished_spans()
    assert one(spans, "generate").attributes[attr.LORA] == "poet"
    roots = {s.attributes[attr.RID]: s for s in by_name(spans, "engine request")}
    assert roots["t"].attributes[attr.LORA] == "poet" and attr.LORA not in roots["u"].attributes
