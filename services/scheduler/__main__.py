"""`python -m radixmesh.services.scheduler`: one engine replica's scheduler."""

from __future__ import annotations

from radixmesh.core.service_settings import SchedulerServiceConfig
from radixmesh.mesh.service import configure_service, run_service, run_until_stopped, stop_event
from radixmesh.services.scheduler.server import SchedulerService


async def _main(config: SchedulerServiceConfig) -> None:
    stop = stop_event()
    service = SchedulerService(config)
    if await run_until_stopped(service.start(), stop):
        await service.run(stop)


def main() -> None:
    config = configure_service(SchedulerServiceConfig, "scheduler", lambda c: c.engine_id)
    run_service(_main(config))


if __name__ == "__main__":
    main()
