"""Making spans through the process's tracer; each helper does nothing while tracing is off."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry.context import Context
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode, set_span_in_context

from radixmesh.tracing.provider import tracer

Attributes = Mapping[str, Any]


def start_span(
    name: str,
    parent: Context | Span | None = None,
    attributes: Attributes | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: Sequence[Link] = (),
    start_time: int | None = None,
) -> Span | None:
    """A started span (end it yourself), child of `parent` (None: the current context);
    None while tracing is off."""
    t = tracer()
    if t is None:
        return None
    context = set_span_in_context(parent) if isinstance(parent, Span) else parent
    return t.start_span(name, context, kind, attributes, links, start_time)


@contextlib.contextmanager
def current_span(
    name: str,
    parent: Context | None = None,
    attributes: Attributes | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Iterator[Span | None]:
    """A span that is the current one inside the block; yields None while tracing is off."""
    t = tracer()
    if t is None:
        yield None
        return
    with t.start_as_current_span(name, parent, kind, attributes) as span:
        yield span


def end_span(span: Span | None, end_time: int | None = None, error: str | None = None) -> None:
    """End a span that may be None, marking it failed with `error` when given."""
    if span is None:
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time)


def link_to(span: Span | None) -> list[Link]:
    """A link to `span`, or none."""
    return [Link(span.get_span_context())] if span is not None else []
