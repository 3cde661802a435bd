"""Spans as flat records (one JSON object per line in a spans file), made from OTLP export
requests."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

_KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {Status.STATUS_CODE_UNSET: "unset", Status.STATUS_CODE_OK: "ok",
           Status.STATUS_CODE_ERROR: "error"}


@dataclass(frozen=True)
class SpanRecord:
    """One finished span; ids are lowercase hex, times nanoseconds since the epoch."""

    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    name: str
    service: str
    instance: str
    start_ns: int
    end_ns: int
    kind: str = "internal"
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    status: str = "unset"
    status_message: str = ""

    @property
    def duration_ns(self) -> int:
        """How long the span lasted."""
        return self.end_ns - self.start_ns

    def to_json(self) -> str:
        """One line of a spans file."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> SpanRecord:
        """A record from one line of a spans file."""
        return cls(**json.loads(line))


def any_value(value: AnyValue) -> Any:
    """An OTLP attribute value as plain JSON data."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return key_values(value.kvlist_value.values)
    if which == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, which)


def key_values(items: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP KeyValues as a dict."""
    return {kv.key: any_value(kv.value) for kv in items}


def _record(span: Span, resource: dict[str, Any]) -> SpanRecord:
    return SpanRecord(
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        name=span.name,
        service=str(resource.get("service.name", "")),
        instance=str(resource.get("service.instance.id", "")),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        kind=_KINDS.get(span.kind, "unspecified"),
        attributes=key_values(span.attributes),
        events=[{"name": e.name, "time_ns": e.time_unix_nano,
                 "attributes": key_values(e.attributes)} for e in span.events],
        links=[{"trace_id": ln.trace_id.hex(), "span_id": ln.span_id.hex(),
                "attributes": key_values(ln.attributes)} for ln in span.links],
        status=_STATUS.get(span.status.code, "unset"),
        status_message=span.status.message,
    )


def records_from_otlp(request: ExportTraceServiceRequest) -> list[SpanRecord]:
    """Every span of an OTLP export request, with its service's name and instance."""
    out = []
    for resource_spans in request.resource_spans:
        resource = key_values(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            out.extend(_record(span, resource) for span in scope_spans.spans)
    return out
