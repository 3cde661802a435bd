"""`python -m radixmesh.services.tokenizer`: one tokenizer replica (HTTP + gRPC front doors)."""

from __future__ import annotations

import asyncio
import logging

from radixmesh.mesh.config import build_config
from radixmesh.mesh.service import log_config, setup_logging, stop_event
from radixmesh.services.tokenizer.config import TokenizerServiceConfig
from radixmesh.services.tokenizer.server import TokenizerServer
from radixmesh.tracing import init_tracing

log = logging.getLogger("radixmesh.tokenizer")


async def _main(config: TokenizerServiceConfig) -> None:
    stop = stop_event()
    server = TokenizerServer(config)
    await server.start()
    try:
        await stop.wait()
    finally:
        await server.stop()


def main() -> None:
    config = build_config(TokenizerServiceConfig, prog="radixmesh-tokenizer")
    setup_logging(config.log_level)
    log_config(log, "tokenizer", config)
    init_tracing("tokenizer", config.replica_id)
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
