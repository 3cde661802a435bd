"""Tracing into memory for tests: the process tracer writes to an InMemorySpanExporter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from radixmesh.tracing import install


@contextmanager
def traced(service: str = "test") -> Iterator[InMemorySpanExporter]:
    """Trace into memory inside the block; tracing is off again after it."""
    exporter = InMemorySpanExporter()
    resource = Resource.create({"service.name": service, "service.instance.id": "i0"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    install(provider)
    try:
        yield exporter
    finally:
        install(None)
        provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> list[ReadableSpan]:
    """The finished spans called `name`, in the order they ended."""
    return [s for s in spans if s.name == name]


def one(spans: tuple[ReadableSpan, ...] | list[ReadableSpan], name: str) -> ReadableSpan:
    """The only finished span called `name`."""
    found = by_name(spans, name)
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]
