"""`python -m radixmesh.services.detokenizer`: one stateless detokenizer replica."""

from __future__ import annotations

import asyncio
import logging

from radixmesh.mesh.config import build_config
from radixmesh.mesh.service import log_config, run_until_stopped, setup_logging, stop_event
from radixmesh.services.detokenizer.config import DetokenizerConfig
from radixmesh.services.detokenizer.server import DetokenizerService
from radixmesh.tracing import init_tracing

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
    config = build_config(DetokenizerConfig, prog="radixmesh-detokenizer")
    setup_logging(config.log_level)
    log_config(log, "detokenizer", config)
    init_tracing("detokenizer", config.replica_id)
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
