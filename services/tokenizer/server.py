"""A tokenizer replica: the SGLang-native and OpenAI HTTP APIs and the public gRPC port
(Generate, health, reflection), in front of a MeshClient that routes requests to the
engines over NATS."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from aiohttp import web
from nats.aio.client import Client as NATS

from radixmesh.core.flags import shown
from radixmesh.core.model_files import resolve_model_path, served_name
from radixmesh.core.pooling import model_serving
from radixmesh.core.service_settings import TokenizerServiceConfig
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.mesh.service import connect_bus
from radixmesh.services.tokenizer.auth import ApiKeyInterceptor, auth_middleware
from radixmesh.services.tokenizer.client import MeshClient
from radixmesh.services.tokenizer.embedding_api import EmbeddingRoutes
from radixmesh.services.tokenizer.grpc_api import TRACED_RPCS, PublicPort
from radixmesh.services.tokenizer.http_util import metrics_middleware
from radixmesh.services.tokenizer.native_api import NativeApi
from radixmesh.services.tokenizer.openai_api import add_openai_routes
from radixmesh.services.tokenizer.router import Router
from radixmesh.tracing.grpc_server import tracing_interceptors
from radixmesh.tracing.http_server import tracing_middleware

log = logging.getLogger("radixmesh.tokenizer")


def public_args(config: TokenizerServiceConfig) -> dict[str, Any]:
    """The config as /server_info shows it: no API key, no credentials in the NATS address."""
    return shown(config)


class TokenizerServer:
    """Start with `start()`, stop with `stop()`; `port` and `grpc_port` are the bound ones."""

    def __init__(self, config: TokenizerServiceConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.port = config.port
        self.grpc_port = config.grpc_port
        self.client: MeshClient | None = None
        self._tokenizer = tokenizer
        self._nc: NATS | None = None
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._public: PublicPort | None = None

    async def start(self) -> None:
        """Load the tokenizer, join the mesh, then open the HTTP and gRPC ports."""
        cfg = self.config
        model_path = await asyncio.to_thread(resolve_model_path, cfg.model_path, cfg.revision)
        tokenizer = self._tokenizer or await asyncio.to_thread(Tokenizer.from_path, str(model_path))
        pooling, reranker = await asyncio.to_thread(model_serving, model_path, tokenizer, cfg)
        self._nc = await connect_bus(cfg.nats_url, f"tokenizer-{cfg.replica_id}",
                                     self._bus_back)
        client = self.client = MeshClient(
            self._nc,
            tokenizer,
            cfg.served_model_name or served_name(model_path),
            cfg.replica_id,
            Router(cfg),
            engine_timeout_s=cfg.engine_timeout,
            grammar_backend=cfg.grammar_backend,
            max_queued=cfg.max_queued_requests,
            stall_timeout_s=cfg.stall_timeout,
            pooling=pooling,
            reranker=reranker,
        )
        await client.start()

        middlewares = [tracing_middleware, metrics_middleware]
        if cfg.api_key:
            middlewares.append(auth_middleware(cfg.api_key))
        app = web.Application(middlewares=middlewares)
        NativeApi(client, str(model_path), public_args(cfg),
                  incremental_streaming_output=cfg.incremental_streaming_output).add_routes(app)
        add_openai_routes(app, client, cfg.tool_call_parser, cfg.reasoning_parser)
        EmbeddingRoutes(client).add_routes(app)
        # Cancelling the handler of a client that hung up closes its generation, which
        # aborts the request on its engine.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=cfg.shutdown_grace, access_log=None
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, cfg.host, cfg.port).start()
        self.port = self._runner.addresses[0][1]

        if cfg.grpc_port >= 0:
            interceptors = tracing_interceptors(TRACED_RPCS)
            if cfg.api_key:
                interceptors = [ApiKeyInterceptor(cfg.api_key), *interceptors]
            self._grpc = grpc.aio.server(interceptors=interceptors)
            self._public = PublicPort(self._grpc, client)
            self.grpc_port = self._grpc.add_insecure_port(f"{cfg.host}:{cfg.grpc_port}")
            await self._public.serving()
            await self._grpc.start()
        log.info(
            "tokenizer %s serving %s: HTTP on %s:%d, gRPC %s, %s",
            cfg.replica_id, client.model_name, cfg.host, self.port,
            f"on {cfg.host}:{self.grpc_port}" if self._grpc else "off",
            "API key required" if cfg.api_key else "no API key",
        )

    async def _bus_back(self) -> None:
        if self.client is not None:
            await self.client.bus_interrupted()

    async def stop(self) -> None:
        """Turn gRPC health NOT_SERVING, stop accepting, let in-flight requests finish
        within the grace period (then abort them), and leave NATS."""
        grace = self.config.shutdown_grace
        if self._public is not None:
            await self._public.stopping()
        closing = []
        if self._grpc is not None:
            closing.append(self._grpc.stop(grace))
        if self._runner is not None:
            closing.append(self._runner.cleanup())
        await asyncio.gather(*closing)
        if self.client is not None:
            await self.client.close()
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.drain()
        log.info("tokenizer %s stopped", self.config.replica_id)

