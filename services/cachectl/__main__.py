"""`python -m radixmesh.services.cachectl`: the owner of an engine's host KV tier."""

from __future__ import annotations

import logging
import os
import platform

from radixmesh.core.service_settings import CachectlConfig
from radixmesh.mesh.service import configure_service, run_service, run_until_stopped, stop_event
from radixmesh.services.cachectl.server import CachectlService

log = logging.getLogger("radixmesh.cachectl")


async def _main(config: CachectlConfig) -> None:
    stop = stop_event()
    service = CachectlService(config)
    try:
        if await run_until_stopped(service.start(), stop):
            await stop.wait()
            log.info("cachectl stopping")
    finally:
        # However it ends, the segments must not outlive cachectl: tmpfs is memory.
        await service.stop()


def main() -> None:
    config = configure_service(
        CachectlConfig, "cachectl", lambda c: f"{platform.node()}-{os.getpid()}"
    )
    run_service(_main(config))


if __name__ == "__main__":
    main()
