"""The scheduler service's one config object."""

from __future__ import annotations

from dataclasses import dataclass

from radixmesh.core.settings import (
    ModelSettings,
    NatsSettings,
    PageSettings,
    SchedulerSettings,
    ScheduleSettings,
    ServiceSettings,
    StatusSettings,
)


@dataclass(frozen=True, kw_only=True)
class SchedulerServiceConfig(
    StatusSettings,
    NatsSettings,
    ServiceSettings,
    SchedulerSettings,
    ScheduleSettings,
    PageSettings,
    ModelSettings,
):
    """One engine replica's scheduler: takes requests from NATS, drives its workers."""

    @property
    def worker_list(self) -> list[str]:
        """The worker ranks' host:port, rank 0 first."""
        return [a.strip() for a in self.worker_addrs.split(",") if a.strip()]
