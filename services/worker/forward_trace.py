"""What the worker's "forward" span (opened by the gRPC interceptor) says about a step."""

from __future__ import annotations

from opentelemetry.trace import get_current_span

from radixmesh.core.step import StepBatch, StepResult
from radixmesh.tracing import attributes as attr

FORWARD_RPC = "/radixmesh.worker.Worker/Forward"
TRACED_RPCS = {FORWARD_RPC: "forward"}


def note_forward(batch: StepBatch, result: StepResult, tp_rank: int, rids: list[str]) -> None:
    """Describe the step on the current span (`rids`: its requests), when it is recording."""
    span = get_current_span()
    if not span.is_recording():
        return
    span.set_attributes({
        **attr.rid_attributes(rids),
        attr.STEP: batch.step,
        attr.TP_RANK: tp_rank,
        **attr.batch_attributes(batch),
        attr.BATCH_NEW_REQUESTS: len(batch.new_requests),
        attr.FORWARD_MS: round(result.forward_ms, 3),
    })
