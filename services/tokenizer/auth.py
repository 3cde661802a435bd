"""The API key on the tokenizer's front doors: HTTP requests carry it as OpenAI clients do
(`Authorization: Bearer <key>`), gRPC calls as the same `authorization` metadata. Without
a configured key everything is open. /health and /metrics (HTTP), the gRPC health service
and reflection (which describes the public contract, nothing more) stay open for probes,
scrapers and tools. A missing or wrong key is a 401 (HTTP) or
UNAUTHENTICATED (gRPC); the key is compared in constant time and never logged."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web

from radixmesh.services.tokenizer.http_util import Handler

OPEN_PATHS = frozenset({"/health", "/metrics"})
OPEN_RPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def key_matches(api_key: str, authorization: str | None) -> bool:
    """Whether an Authorization value (`Bearer <key>`) carries the key."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(),
                                                              api_key.encode())


def auth_middleware(api_key: str) -> Callable[[web.Request, Handler], Awaitable[Any]]:
    """An aiohttp middleware refusing requests without the key (401, OpenAI's error body)."""

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or key_matches(api_key,
                                                     request.headers.get("Authorization")):
            return await handler(request)
        message = ("missing API key: send Authorization: Bearer <key>"
                   if "Authorization" not in request.headers else "invalid API key")
        return web.json_response(
            {"error": {"message": message, "type": "invalid_request_error",
                       "code": "invalid_api_key"}},
            status=401, headers={"WWW-Authenticate": "Bearer"},
        )

    return check_key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without the key in their `authorization` metadata."""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith(OPEN_RPC_PREFIXES):
            return await continuation(details)
        metadata = dict(details.invocation_metadata or ())
        given = metadata.get("authorization")
        if isinstance(given, str) and key_matches(self._api_key, given):
            return await continuation(details)
        message = "missing API key" if given is None else "invalid API key"
        handler = await continuation(details)
        return _refusal(handler, message)


def _refusal(handler: grpc.RpcMethodHandler | None, message: str) -> grpc.RpcMethodHandler:
    """A handler for a guarded method (unary request: Generate, or an unknown method) that
    aborts with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # abort raises: never reached

    decode = handler.request_deserializer if handler is not None else None
    encode = handler.response_serializer if handler is not None else None
    if handler is not None and handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, decode, encode)
    return grpc.unary_unary_rpc_method_handler(unary, decode, encode)
