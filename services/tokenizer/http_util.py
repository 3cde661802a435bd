"""What both HTTP APIs of the tokenizer (native and OpenAI) share: server-sent events, and
the middleware that counts every answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from radixmesh.services.tokenizer import metrics

# The status nginx logs for a client that hung up before its answer was complete.
CLIENT_CLOSED = 499
SSE_DONE = b"data: [DONE]\n\n"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel what is still running (closing its generation, which aborts its request in
    the mesh) and wait for it."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def json_bytes(payload: Any) -> bytes:
    """An answer's JSON as UTF-8 (orjson: a streamed chunk's body in well under a microsecond
    where the standard library takes ten; a non-finite float is null)."""
    return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)


def json_answer(payload: Any) -> web.Response:
    """A whole answer as JSON."""
    return web.Response(body=json_bytes(payload), content_type="application/json")


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying JSON: a `data:` line, never a comment or keep-alive."""
    return b"data: " + json_bytes(payload) + b"\n\n"


def _endpoint(request: web.Request) -> str:
    # The route's pattern, not the raw path, keeps the label set small.
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


@web.middleware
async def metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Count every answer by endpoint and status code."""
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    finally:
        metrics.REQUESTS.labels(_endpoint(request), str(status)).inc()
