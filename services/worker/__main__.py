"""`python -m radixmesh.services.worker`: one worker rank."""

from __future__ import annotations

import asyncio
import logging
import os
import platform

from radixmesh.core.service_settings import WorkerConfig
from radixmesh.mesh.service import configure_service, run_until_stopped, stop_event
from radixmesh.services.worker.server import WorkerService

log = logging.getLogger("radixmesh.worker")


async def _main(config: WorkerConfig) -> bool:
    """Serve until SIGTERM/SIGINT; whether the torch thread settled on the way out."""
    stop = stop_event()
    service = WorkerService(config)
    try:
        if await run_until_stopped(service.start(), stop):
            await stop.wait()
    finally:
        settled = await service.stop()
    return settled


def main() -> None:
    config = configure_service(
        WorkerConfig, "worker", lambda c: f"rank{c.tp_rank}-{platform.node()}-{os.getpid()}"
    )
    if not asyncio.run(_main(config)):
        # A thread blocked in a collective on a dead peer would hold the interpreter's exit.
        os._exit(0)
    log.info("worker rank %d stopped", config.tp_rank)


if __name__ == "__main__":
    main()
