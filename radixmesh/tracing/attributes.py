"""Names of the span attributes radixmesh sets, in one place, and tagging spans with the
requests they serve."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry.trace import Span

if TYPE_CHECKING:
    from radixmesh.core.step import StepBatch

RID = "radixmesh.rid"  # the request; on a span that serves several, the first of them
RIDS = "radixmesh.rids"  # every request a span serves, when it serves more than one
ENGINE_ID = "radixmesh.engine_id"
PROMPT_TOKENS = "radixmesh.prompt_tokens"
CACHED_TOKENS = "radixmesh.cached_tokens"
COMPLETION_TOKENS = "radixmesh.completion_tokens"
MAX_NEW_TOKENS = "radixmesh.max_new_tokens"
LORA = "radixmesh.lora"  # the LoRA adapter a request runs with
FINISH = "radixmesh.finish"
FINISH_MESSAGE = "radixmesh.finish_message"
ROUTE_MATCHED = "radixmesh.route.matched_tokens"
ROUTE_ENGINES = "radixmesh.route.engines"
PREFIX_MATCHED = "radixmesh.prefix.matched_tokens"
PREFIX_TIER = "radixmesh.prefix.tier"  # the slowest tier the match reached
PREFIX_DEVICE = "radixmesh.prefix.device_tokens"
PREFIX_HOST = "radixmesh.prefix.host_tokens"
PREFIX_STORAGE = "radixmesh.prefix.storage_tokens"
PREFETCH_POLICY = "radixmesh.prefetch.policy"
PREFETCH_PAGES_ASKED = "radixmesh.prefetch.pages_asked"
PREFETCH_PAGES_ARRIVED = "radixmesh.prefetch.pages_arrived"
PREFETCH_TOKENS = "radixmesh.prefetch.tokens"
CHUNK_INDEX = "radixmesh.chunk.index"
CHUNK_START = "radixmesh.chunk.start"
CHUNK_TOKENS = "radixmesh.chunk.tokens"
CHUNK_LAST = "radixmesh.chunk.last"
DECODE_STEPS = "radixmesh.decode.steps"
SPEC_DRAFT_TOKENS = "radixmesh.spec.draft_tokens"
SPEC_ACCEPTED_TOKENS = "radixmesh.spec.accepted_tokens"
TRANSFER_TOKENS = "radixmesh.transfer.tokens"  # prompt tokens whose KV went to a decode engine
TRANSFER_BYTES = "radixmesh.transfer.bytes"
STEP = "radixmesh.step"
BATCH_REQUESTS = "radixmesh.batch.requests"
BATCH_PREFILL_TOKENS = "radixmesh.batch.prefill_tokens"
BATCH_DECODES = "radixmesh.batch.decodes"
BATCH_NEW_REQUESTS = "radixmesh.batch.new_requests"
FORWARD_MS = "radixmesh.forward.model_ms"
TP_RANK = "radixmesh.tp_rank"
DETOK_SEQ = "radixmesh.detok.seq"
DETOK_NEW_TOKENS = "radixmesh.detok.new_tokens"
DETOK_TEXT_CHARS = "radixmesh.detok.text_chars"
DETOK_STEP_UPDATES = "radixmesh.detok.step_updates"
STOP_MATCHED = "radixmesh.detok.stop_matched"
STREAM_CHUNKS = "radixmesh.stream.chunks"
ABORT_REASON = "radixmesh.abort.reason"
ABORT_FOUND = "radixmesh.abort.found"


def rid_attributes(rids: Iterable[str]) -> dict[str, str | list[str]]:
    """RID (the first request) and, for several requests, RIDS (all of them)."""
    ordered = list(dict.fromkeys(rids))
    if not ordered:
        return {}
    out: dict[str, str | list[str]] = {RID: ordered[0]}
    if len(ordered) > 1:
        out[RIDS] = ordered
    return out


def batch_attributes(step: StepBatch) -> dict[str, int]:
    """A step's size: requests, prompt tokens, decodes (packed ones and entries')."""
    return {
        BATCH_REQUESTS: step.num_requests,
        BATCH_PREFILL_TOKENS: sum(len(e.input_ids) for e in step.entries),
        BATCH_DECODES: len(step.decode_rows) + sum(not e.input_ids for e in step.entries),
    }


def tag_rid(span: Span, rid: str) -> None:
    """Add a request to a span that may already serve others (e.g. a batch /generate)."""
    if not span.is_recording():
        return
    attributes = getattr(span, "attributes", None) or {}
    first = attributes.get(RID)
    if first is None:
        span.set_attribute(RID, rid)
        return
    rids = list(attributes.get(RIDS) or [first])
    if rid not in rids:
        span.set_attribute(RIDS, [*rids, rid])
