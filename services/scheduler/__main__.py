"""`python -m radixmesh.services.scheduler`: one engine replica's scheduler."""

from __future__ import annotations

import asyncio
import logging

from radixmesh.mesh.config import build_config
from radixmesh.mesh.service import log_config, run_until_stopped, setup_logging, stop_event
from radixmesh.services.scheduler.config import SchedulerServiceConfig
from radixmesh.services.scheduler.server import SchedulerService
from radixmesh.tracing import init_tracing

log = logging.getLogger("radixmesh.scheduler")


async def _main(config: SchedulerServiceConfig) -> None:
    stop = stop_event()
    service = SchedulerService(config)
    if await run_until_stopped(service.start(), stop):
        await service.run(stop)


def main() -> None:
    config = build_config(SchedulerServiceConfig, prog="radixmesh-scheduler")
    setup_logging(config.log_level)
    log_config(log, "scheduler", config)
    init_tracing("scheduler", config.engine_id)
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
