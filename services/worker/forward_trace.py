"""The worker's "forward" span of a step: a child of the scheduler's "forward batch" span,
whose context the step's message carries, describing what the step computed."""

from __future__ import annotations

from opentelemetry.trace import Span, SpanKind

from radixmesh.core.step import StepBatch, StepResult
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.propagation import context_from_traceparent
from radixmesh.tracing.provider import tracer
from radixmesh.tracing.spans import start_span


def forward_span(traceparent: str) -> Span | None:
    """The span of a step sent with `traceparent`; None while tracing is off, or for a step
    the scheduler does not trace."""
    if tracer() is None:
        return None
    parent = context_from_traceparent(traceparent)
    if parent is None:
        return None
    return start_span("forward", parent, kind=SpanKind.SERVER)


def note_forward(span: Span, batch: StepBatch, result: StepResult, tp_rank: int,
                 rids: list[str]) -> None:
    """Describe the step on its span (`rids`: its requests)."""
    span.set_attributes({
        **attr.rid_attributes(rids),
        attr.STEP: batch.step,
        attr.TP_RANK: tp_rank,
        **attr.batch_attributes(batch),
        attr.BATCH_NEW_REQUESTS: len(batch.new_requests),
        attr.FORWARD_MS: round(result.forward_ms, 3),
    })
