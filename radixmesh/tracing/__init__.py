"""OpenTelemetry tracing of the mesh: one trace per request across every service.

Off unless OTEL_TRACES_EXPORTER names an exporter (see `config`); then each service exports
its spans over OTLP as the standard OTEL_* variables say. `radixmesh up --trace-file` runs
a receiver writing spans as JSON lines, and `radixmesh trace <rid>` prints a waterfall."""

from radixmesh.tracing.provider import init_tracing, install, shutdown_tracing, tracer

__all__ = ["init_tracing", "install", "shutdown_tracing", "tracer"]
