"""Reading the standard OTEL_* environment variables: whether tracing is on and how spans
leave the process. Tracing is off unless OTEL_TRACES_EXPORTER names an exporter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

EXPORTERS = ("otlp", "console")
PROTOCOLS = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL = "http/protobuf"


@dataclass(frozen=True)
class TracingSettings:
    """What the environment asks for; `exporters` is empty when tracing is off."""

    exporters: tuple[str, ...] = ()
    protocol: str = DEFAULT_PROTOCOL
    unknown: tuple[str, ...] = ()  # exporter or protocol names that were ignored

    @property
    def enabled(self) -> bool:
        """Whether any span leaves the process."""
        return bool(self.exporters)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def tracing_settings(env: Mapping[str, str]) -> TracingSettings:
    """Settings from OTEL_SDK_DISABLED, OTEL_TRACES_EXPORTER and the OTLP protocol variables."""
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return TracingSettings()
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n and n != "none"]
    exporters = tuple(dict.fromkeys(n for n in names if n in EXPORTERS))
    unknown = [n for n in names if n not in EXPORTERS]
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or DEFAULT_PROTOCOL
    ).strip().lower()
    if protocol not in PROTOCOLS:
        unknown.append(protocol)
        protocol = DEFAULT_PROTOCOL
    return TracingSettings(exporters, protocol, tuple(unknown))


def exporter_env(endpoint: str, env: Mapping[str, str]) -> dict[str, str]:
    """Variables that send a child process's spans to an OTLP/HTTP receiver at `endpoint`
    (its base URL); a schedule delay the caller already set is kept."""
    return {
        "OTEL_SDK_DISABLED": "false",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint.rstrip("/") + "/v1/traces",
        # Spans reach the file within half a second instead of the default five.
        "OTEL_BSP_SCHEDULE_DELAY": env.get("OTEL_BSP_SCHEDULE_DELAY", "500"),
    }


def instance_env(instance_id: str, env: Mapping[str, str]) -> dict[str, str]:
    """OTEL_RESOURCE_ATTRIBUTES naming one replica, unless the caller already names one."""
    current = env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    if "service.instance.id=" in current:
        return {}
    parts = [p for p in current.split(",") if p.strip()]
    return {"OTEL_RESOURCE_ATTRIBUTES": ",".join([*parts, f"service.instance.id={instance_id}"])}
