"""`python -m radixmesh.services.detokenizer`: one stateless detokenizer replica."""

from __future__ import annotations

import logging

from radixmesh.core.service_settings import DetokenizerConfig
from radixmesh.mesh.service import configure_service, run_service, run_until_stopped, stop_event
from radixmesh.services.detokenizer.server import DetokenizerService

log = logging.getLogger("radixmesh.detokenizer")


async def _main(config: DetokenizerConfig) -> None:
    stop = stop_event()
    service = DetokenizerService(config)
    try:
        if await run_until_stopped(service.start(), stop):
            await stop.wait()
            log.info("detokenizer %s stopping", config.replica_id)
    finally:
        await service.stop()


def main() -> None:
    config = configure_service(DetokenizerConfig, "detokenizer", lambda c: c.replica_id)
    run_service(_main(config))


if __name__ == "__main__":
    main()
