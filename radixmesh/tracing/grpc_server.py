"""A server span per call of chosen gRPC methods, continuing the caller's traceparent."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from opentelemetry.trace import SpanKind

from radixmesh.tracing.propagation import context_from_metadata
from radixmesh.tracing.provider import tracer


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the unary-unary and unary-stream methods in `names` (full method path to span
    name); other methods, and every method while tracing is off, pass untouched."""

    def __init__(self, names: Mapping[str, str]) -> None:
        self.names = dict(names)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        name = self.names.get(details.method)  # type: ignore[attr-defined]
        if handler is None or name is None or tracer() is None:
            return handler
        metadata = details.invocation_metadata  # type: ignore[attr-defined]
        service, _, method = details.method.lstrip("/").rpartition("/")  # type: ignore[attr-defined]
        attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, name, metadata, attributes),
                handler.request_deserializer, handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _streaming(handler.unary_stream, name, metadata, attributes),
                handler.request_deserializer, handler.response_serializer,
            )
        return handler


def _unary(behavior: Any, name: str, metadata: Any, attributes: dict[str, str]) -> Any:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
        t = tracer()
        if t is None:
            return await behavior(request, context)
        parent = context_from_metadata(metadata)
        with t.start_as_current_span(name, parent, SpanKind.SERVER, attributes):
            return await behavior(request, context)

    return traced


def _streaming(behavior: Any, name: str, metadata: Any, attributes: dict[str, str]) -> Any:
    async def traced(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        t = tracer()
        if t is None:
            async for response in behavior(request, context):
                yield response
            return
        parent = context_from_metadata(metadata)
        # grpc runs the whole call in one task, so the span stays current across yields.
        with t.start_as_current_span(name, parent, SpanKind.SERVER, attributes):
            async for response in behavior(request, context):
                yield response

    return traced


def tracing_interceptors(names: Mapping[str, str]) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors a gRPC server needs: none while tracing is off, so calls pay nothing."""
    return [TracingInterceptor(names)] if tracer() is not None else []
