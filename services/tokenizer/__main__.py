"""`python -m radixmesh.services.tokenizer`: one tokenizer replica (HTTP + gRPC front doors)."""

from __future__ import annotations

from radixmesh.core.service_settings import TokenizerServiceConfig
from radixmesh.mesh.service import configure_service, run_service, settle_heap, stop_event
from radixmesh.services.tokenizer.server import TokenizerServer


async def _main(config: TokenizerServiceConfig) -> None:
    stop = stop_event()
    server = TokenizerServer(config)
    await server.start()
    settle_heap()
    try:
        await stop.wait()
    finally:
        await server.stop()


def main() -> None:
    config = configure_service(TokenizerServiceConfig, "tokenizer", lambda c: c.replica_id)
    run_service(_main(config))


if __name__ == "__main__":
    main()
