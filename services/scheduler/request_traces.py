"""The scheduler's spans, read off what its loop does: per request "engine request" with
queue wait, prefix match, each prefill chunk, one decode span (with a "verify" span for each
step that verified its drafts) and aborts beneath it; per step a "forward batch" span linked
to every request in the batch, whose context travels to the worker. The Scheduler itself
knows nothing of tracing."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from opentelemetry.trace import Link, Span, SpanKind, get_current_span

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.step import StepResult
from radixmesh.engine.request import Req
from radixmesh.engine.scheduler import ScheduledBatch
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.propagation import context_from_headers, grpc_metadata, traceparent
from radixmesh.tracing.provider import tracer
from radixmesh.tracing.spans import end_span, start_span

GrpcMetadata = tuple[tuple[str, str], ...]
# The worker's KV pool; the host tier and the storage tier (HiCache).
DEVICE_TIER, HOST_TIER, STORAGE_TIER = "device", "host", "storage"


@dataclass(eq=False)
class _RequestSpans:
    root: Span
    queue: Span | None
    traceparent: str  # what the request's TokenUpdates carry
    decode: Span | None = None
    steps: int = 0
    chunks: int = 0
    admitted: bool = False
    aborts: list[Span] = field(default_factory=list)
    next_mark: int = 1  # output count of the next progress event on the decode span


class RequestTraces:
    """Every hook returns at once while tracing is off."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._requests: dict[str, _RequestSpans] = {}
        # By step: the (rid, prefill chunk span) pairs that the step's result ends.
        self._chunks: dict[int, list[tuple[str, Span]]] = {}
        # By step: the "load back" spans of host-tier hits the step loads before it computes.
        self._loads: dict[int, list[Span]] = {}
        # By step: the (rid, "verify" span) pairs of the drafts the step verifies.
        self._verifies: dict[int, list[tuple[str, Span]]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def received(self, req: Req, headers: Mapping[str, str] | None) -> None:
        """A request arrived: it starts waiting in the queue."""
        if tracer() is None:
            return
        parent = context_from_headers(headers)
        root = start_span("engine request", parent, {
            attr.RID: req.rid,
            attr.ENGINE_ID: self.engine_id,
            attr.PROMPT_TOKENS: len(req.input_ids),
            attr.MAX_NEW_TOKENS: req.params.max_new_tokens,
            **({attr.LORA: req.lora} if req.lora else {}),
        }, kind=SpanKind.CONSUMER)
        assert root is not None
        queue = start_span("queue wait", root, {attr.RID: req.rid})
        # Detokenizer spans hang under the tokenizer's request, which outlives this one.
        upstream = traceparent(get_current_span(parent)) if parent is not None else ""
        self._requests[req.rid] = _RequestSpans(root, queue, upstream or traceparent(root))

    def scheduled(self, batch: ScheduledBatch, started: int, ended: int) -> None:
        """A step was scheduled between `started` and `ended` (time.time_ns): note what it
        admitted and computes."""
        if not self._requests:
            return
        matched = {n.rid: len(n.prefix_ids) for n in batch.batch.new_requests}
        chunks = []
        verifies: list[tuple[str, Span]] = []
        for req in batch.decodes:
            spans = self._requests.get(req.rid)
            if spans is not None:
                self._decoding(spans, req, ended)
        for entry, req in zip(batch.batch.entries, batch.reqs, strict=True):
            spans = self._requests.get(req.rid)
            if spans is None:
                continue
            if req.rid in matched:
                first = not spans.admitted
                self._admitted(spans, req, matched[req.rid], started, ended)
                if first and (req.cached_host_tokens or req.cached_storage_tokens):
                    load = start_span("load back", spans.root, {
                        attr.RID: req.rid,
                        attr.PREFIX_HOST: req.cached_host_tokens,
                        attr.PREFIX_STORAGE: req.cached_storage_tokens,
                        attr.STEP: batch.batch.step,
                    }, start_time=ended)
                    if load is not None:
                        self._loads.setdefault(batch.batch.step, []).append(load)
            if entry.input_ids and req.rid not in batch.jumps:
                n = len(entry.input_ids)
                chunk = start_span("prefill chunk", spans.root, {
                    attr.RID: req.rid,
                    attr.CHUNK_INDEX: spans.chunks,
                    attr.CHUNK_START: len(req.slots) - n,
                    attr.CHUNK_TOKENS: n,
                    attr.CHUNK_LAST: entry.sample,
                    attr.STEP: batch.batch.step,
                }, start_time=ended)
                spans.chunks += 1
                if chunk is not None:
                    chunks.append((req.rid, chunk))
            else:
                self._decoding(spans, req, ended)
                if entry.draft:
                    verify = start_span("verify", spans.decode, {
                        attr.RID: req.rid,
                        attr.SPEC_DRAFT_TOKENS: len(entry.draft),
                        attr.STEP: batch.batch.step,
                    }, start_time=ended)
                    if verify is not None:
                        verifies.append((req.rid, verify))
        self._chunks[batch.batch.step] = chunks
        if verifies:
            self._verifies[batch.batch.step] = verifies

    @staticmethod
    def _decoding(spans: _RequestSpans, req: Req, ended: int) -> None:
        """A decode step of the request: its "decode" span starts with the first."""
        if spans.decode is None:
            spans.decode = start_span("decode", spans.root, {attr.RID: req.rid},
                                      start_time=ended)
        spans.steps += 1

    def _admitted(
        self, spans: _RequestSpans, req: Req, matched: int, started: int, ended: int
    ) -> None:
        if spans.admitted:  # back from a retraction
            if spans.decode is not None:
                spans.decode.add_event("readmitted", {attr.PREFIX_MATCHED: matched}, ended)
            return
        spans.admitted = True
        end_span(spans.queue, started)
        spans.queue = None
        if (outcome := req.prefetch) is not None:
            prefetch = start_span("prefetch", spans.root, {
                attr.RID: req.rid,
                attr.PREFETCH_POLICY: outcome.policy,
                attr.PREFETCH_PAGES_ASKED: outcome.pages_asked,
                attr.PREFETCH_PAGES_ARRIVED: outcome.pages_arrived,
                attr.PREFETCH_TOKENS: outcome.tokens,
            }, start_time=started - int(outcome.waited_s * 1e9))
            end_span(prefetch, started)
        host, storage = req.cached_host_tokens, req.cached_storage_tokens
        tier = STORAGE_TIER if storage else HOST_TIER if host else DEVICE_TIER
        match = start_span("prefix match", spans.root, {
            attr.RID: req.rid,
            attr.PREFIX_MATCHED: matched,
            attr.PREFIX_TIER: tier,
            attr.PREFIX_DEVICE: matched - host - storage,
            attr.PREFIX_HOST: host,
            attr.PREFIX_STORAGE: storage,
            attr.PROMPT_TOKENS: len(req.input_ids),
        }, start_time=started)
        end_span(match, ended)

    @contextlib.contextmanager
    def forward(self, batch: ScheduledBatch) -> Iterator[GrpcMetadata | None]:
        """A "forward batch" span around running `batch`; yields the gRPC metadata that
        makes the workers' spans its children. Its parent is the batch's first prefill chunk
        (else its first decode), so one request's trace shows the model's work."""
        if not self._requests:
            yield None
            return
        chunks = self._chunks.pop(batch.batch.step, [])
        loads = self._loads.pop(batch.batch.step, [])
        verifies = self._verifies.get(batch.batch.step, [])  # verified() reads them too
        members = [(r.rid, self._requests[r.rid]) for r in batch.all_reqs
                   if r.rid in self._requests]
        if not members:
            for _, verify in self._verifies.pop(batch.batch.step, []):
                end_span(verify)
            yield None
            return
        anchor_rid, anchor = chunks[0] if chunks else next(
            ((rid, s.decode) for rid, s in members if s.decode is not None),
            (members[0][0], members[0][1].root))
        step = batch.batch
        span = start_span("forward batch", anchor, {
            **attr.rid_attributes([anchor_rid, *(rid for rid, _ in members)]),
            attr.ENGINE_ID: self.engine_id,
            attr.STEP: step.step,
            **attr.batch_attributes(step),
            attr.BATCH_NEW_REQUESTS: len(step.new_requests),
        }, kind=SpanKind.CLIENT, links=[Link(s.root.get_span_context()) for _, s in members])
        error = None
        try:
            yield grpc_metadata(span)
        except BaseException as exc:
            error = repr(exc)
            raise
        finally:
            end_span(span, error=error)
            now = time.time_ns()
            for _, chunk in chunks:
                end_span(chunk, now, error)
            for load in loads:
                end_span(load, now, error)
            for _, verify in verifies:
                end_span(verify, now, error)
            self._verifies.pop(step.step, None)

    def verified(self, batch: ScheduledBatch, result: StepResult) -> None:
        """A step's result, before its spans end: how many drafts each verify accepted."""
        verifies = self._verifies.get(batch.batch.step)
        if not verifies:
            return
        accepted = {r.rid: len(r.accepted_ids) for r in result.results}
        for rid, span in verifies:
            span.set_attribute(attr.SPEC_ACCEPTED_TOKENS, accepted.get(rid, 0))

    def aborted(self, rid: str, stop: bool, headers: Mapping[str, str] | None) -> None:
        """An abort arrived (`stop`: a stop string matched); its span lasts until the
        request's last update is out."""
        if tracer() is None:
            return
        spans = self._requests.get(rid)
        reason = "stop string" if stop else "requested"
        parent = context_from_headers(headers) or (spans.root if spans is not None else None)
        span = start_span("abort", parent, {
            attr.RID: rid, attr.ABORT_REASON: reason, attr.ABORT_FOUND: spans is not None,
        })
        if spans is None:
            end_span(span)
            return
        if span is not None:
            spans.aborts.append(span)
        if spans.decode is not None:
            spans.decode.add_event("abort requested", {attr.ABORT_REASON: reason})

    def sent(self, rid: str, outputs: int, finish: FinishReason | None, cached: int) -> str:
        """An update of `rid` is on its way to the detokenizers, with `outputs` output
        tokens so far: the trace context it carries ("" when untraced). A finishing update
        ends the request's spans."""
        spans = self._requests.get(rid)
        if spans is None:
            return ""
        self._progress(spans, outputs)
        if finish is not None:
            del self._requests[rid]
            self._finished(spans, outputs, finish, cached)
        return spans.traceparent

    def handed(self, req: Req, tokens: int, nbytes: int, ms: float, error: str) -> None:
        """A prefill engine's request goes back to its decode engine: a "kv transfer" span
        (the send's own duration, `tokens` and `nbytes` of KV, or its `error`) ends its
        spans here."""
        spans = self._requests.pop(req.rid, None)
        if spans is None:
            return
        now = time.time_ns()
        transfer = start_span("kv transfer", spans.root, {
            attr.RID: req.rid, attr.TRANSFER_TOKENS: tokens, attr.TRANSFER_BYTES: nbytes,
        }, start_time=now - int(ms * 1e6), kind=SpanKind.PRODUCER)
        end_span(transfer, now, error=error or None)
        self._finished(spans, len(req.output_ids), FinishReason(FinishKind.STOP),
                       req.cached_tokens)

    @staticmethod
    def _progress(spans: _RequestSpans, outputs: int) -> None:
        """An event each time the output count reaches a power of two: the decode rate over
        time in a handful of events, never one per token."""
        if spans.decode is None or outputs < spans.next_mark:
            return
        spans.decode.add_event("output tokens", {attr.COMPLETION_TOKENS: outputs})
        while spans.next_mark <= outputs:
            spans.next_mark *= 2

    def _finished(
        self, spans: _RequestSpans, outputs: int, finish: FinishReason, cached: int
    ) -> None:
        refused = finish.kind is FinishKind.ABORT and not spans.admitted and not spans.aborts
        outcome = {attr.FINISH: finish.kind.value, attr.COMPLETION_TOKENS: outputs}
        end_span(spans.queue)
        if spans.decode is not None:
            spans.decode.set_attributes({**outcome, attr.DECODE_STEPS: spans.steps})
            end_span(spans.decode)
        spans.root.set_attributes({**outcome, attr.CACHED_TOKENS: cached})
        if finish.message:
            spans.root.set_attribute(attr.FINISH_MESSAGE, finish.message)
        end_span(spans.root, error=finish.message if refused else None)
        for span in spans.aborts:
            end_span(span)
