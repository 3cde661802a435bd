"""The process's tracer: made once from the environment by `init_tracing`, or installed by
a test; None while tracing is off, so every hook can return at once."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from opentelemetry.trace import Tracer

from radixmesh.tracing.config import TracingSettings, tracing_settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("radixmesh.tracing")

SCOPE = "radixmesh"
_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def tracer() -> Tracer | None:
    """The tracer spans are made with, or None when tracing is off."""
    return _tracer


def install(provider: TracerProvider | None) -> None:
    """Trace with `provider` (None: turn tracing off); the previous one is not shut down."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer(SCOPE) if provider is not None else None


def init_tracing(service: str, instance_id: str) -> bool:
    """Turn tracing on when OTEL_TRACES_EXPORTER asks for it; True when it is on.

    service.name defaults to radixmesh-<service> and service.instance.id to `instance_id`;
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override them. The provider flushes its
    last spans when the process exits."""
    settings = tracing_settings(os.environ)
    if settings.unknown:
        log.warning("tracing: ignoring unsupported %s", ", ".join(settings.unknown))
    if not settings.enabled:
        return False
    from opentelemetry.sdk.resources import (
        SERVICE_INSTANCE_ID,
        SERVICE_NAME,
        OTELResourceDetector,
        Resource,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    defaults = {SERVICE_NAME: f"radixmesh-{service}", SERVICE_INSTANCE_ID: instance_id}
    provider = TracerProvider(
        resource=Resource.create({**defaults, **OTELResourceDetector().detect().attributes})
    )
    for exporter in _exporters(settings):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info("tracing on: %s (%s)", ", ".join(settings.exporters), settings.protocol)
    return True


def shutdown_tracing() -> None:
    """Export what is buffered and turn tracing off."""
    provider = _provider
    install(None)
    if provider is not None:
        provider.shutdown()


def _exporters(settings: TracingSettings) -> list[SpanExporter]:
    out: list[SpanExporter] = []
    for name in settings.exporters:
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            out.append(ConsoleSpanExporter())
        elif settings.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            out.append(OTLPSpanExporter())
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            out.append(HttpExporter())
    return out
