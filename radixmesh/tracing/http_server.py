"""A server span per HTTP request of an aiohttp app, continuing the client's traceparent."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from opentelemetry.trace import SpanKind, Status, StatusCode

from radixmesh.tracing.propagation import context_from_headers
from radixmesh.tracing.provider import tracer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Probes and scrapes would bury the requests worth reading.
UNTRACED_PATHS = frozenset({"/health", "/metrics"})


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


@web.middleware
async def tracing_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Run the handler inside a SERVER span named like "POST /generate"."""
    t = tracer()
    if t is None or request.path in UNTRACED_PATHS:
        return await handler(request)
    route = _route(request)
    attributes = {"http.request.method": request.method, "http.route": route,
                  "url.path": request.path}
    parent = context_from_headers(request.headers)
    with t.start_as_current_span(f"{request.method} {route}", parent, SpanKind.SERVER,
                                 attributes) as span:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            span.set_attribute("http.response.status_code", exc.status)
            raise
        span.set_attribute("http.response.status_code", response.status)
        if response.status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {response.status}"))
        return response
