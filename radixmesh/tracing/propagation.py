"""W3C trace context across the mesh's transports: a `traceparent` string in a message
field, NATS message headers, gRPC metadata and HTTP headers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from opentelemetry.context import Context
from opentelemetry.trace import Span, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
_PROPAGATOR = TraceContextTextMapPropagator()


def traceparent(span: Span | None) -> str:
    """The span's context as a traceparent value; "" without a valid span."""
    if span is None:
        return ""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def context_from_traceparent(value: str) -> Context | None:
    """The remote parent a traceparent value names; None when it is empty or malformed."""
    if not value:
        return None
    return _valid(_PROPAGATOR.extract({TRACEPARENT: value}))


def headers(span: Span | None) -> dict[str, str] | None:
    """NATS or HTTP headers carrying the span's context; None without a valid span."""
    if span is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, set_span_in_context(span))
    return carrier


def context_from_headers(carrier: Mapping[str, str] | None) -> Context | None:
    """The remote parent in message headers (any letter case); None when there is none."""
    if not carrier:
        return None
    lowered = {k.lower(): v for k, v in carrier.items()}
    if TRACEPARENT not in lowered:
        return None
    return _valid(_PROPAGATOR.extract(lowered))


def grpc_metadata(span: Span | None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the span's context; None without a valid span."""
    carrier = headers(span)
    return tuple(carrier.items()) if carrier else None


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> Context | None:
    """The remote parent in gRPC invocation metadata; None when there is none."""
    if not metadata:
        return None
    return context_from_headers({k: v for k, v in metadata if isinstance(v, str)})


def _valid(context: Context) -> Context | None:
    return context if get_current_span(context).get_span_context().is_valid else None
