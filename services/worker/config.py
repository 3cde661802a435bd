"""The worker service's one config object."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.settings import (
    DeviceSettings,
    KVSettings,
    ModelSettings,
    ServiceSettings,
    StatusSettings,
    WorkerSettings,
)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(
    StatusSettings, ServiceSettings, WorkerSettings, KVSettings, DeviceSettings, ModelSettings
):
    """One worker rank: loads the model, holds the KV pool, runs Forward over gRPC."""
