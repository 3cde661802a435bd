"""The detokenizer's spans of one TokenStep: a "detokenize" span for the first and the last
update of each request and for any that ends it on a stop string. The updates between
stay untraced: a span per token would cost more than the work it shows."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from opentelemetry.trace import Span

from radixmesh.proto import mesh_pb2 as mpb
from radixmesh.tracing import attributes as attr
from radixmesh.tracing.propagation import context_from_traceparent, headers
from radixmesh.tracing.provider import tracer
from radixmesh.tracing.spans import start_span

if TYPE_CHECKING:
    from radixmesh.services.detokenizer.server import StepReplies


class StepTrace:
    """Made when a step arrives; `decoded` opens the spans, `end` closes them."""

    __slots__ = ("started", "_spans")

    def __init__(self) -> None:
        self.started = time.time_ns()
        self._spans: dict[str, Span] = {}

    def decoded(self, step: mpb.TokenStep, replies: StepReplies) -> None:
        """Open the spans of the updates worth one (their parents are in the updates)."""
        if tracer() is None:
            return
        chunks = {c.rid: c for group in replies.chunks.values() for c in group.chunks}
        stopped = {abort.rid for _, abort in replies.aborts}
        for update in step.updates:
            last = update.HasField("finish") or update.rid in stopped
            if not (update.seq == 0 or last):
                continue
            parent = context_from_traceparent(update.traceparent)
            if parent is None:
                continue
            attributes: dict[str, object] = {
                attr.RID: update.rid,
                attr.DETOK_SEQ: update.seq,
                attr.DETOK_NEW_TOKENS: len(update.new_ids),
                attr.DETOK_STEP_UPDATES: len(step.updates),
                attr.STOP_MATCHED: update.rid in stopped,
            }
            chunk = chunks.get(update.rid)
            if chunk is not None:
                attributes[attr.DETOK_TEXT_CHARS] = len(chunk.text)
                if chunk.HasField("finish"):
                    attributes[attr.FINISH] = chunk.finish.kind
            span = start_span("detokenize", parent, attributes, start_time=self.started)
            if span is not None:
                self._spans[update.rid] = span

    def headers(self, rid: str) -> dict[str, str] | None:
        """NATS headers that make an abort of `rid` a child of its detokenize span."""
        return headers(self._spans.get(rid))

    def end(self) -> None:
        """The step's chunks and aborts are out."""
        for span in self._spans.values():
            span.end()
        self._spans.clear()
