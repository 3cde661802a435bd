"""What every HTTP handler of the tokenizer shares: error bodies, request metrics, SSE."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from radixmesh.services.tokenizer import metrics

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    503: "ServiceUnavailableError",
}

# The status nginx logs for a client that hung up before its answer was complete.
_CLIENT_CLOSED = 499

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """{"error": {"message", "type", "code"}} as the SGLang-native API answers."""
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(message: str, status: int = 400) -> web.Response:
    """An error answer with `error_body`."""
    return web.json_response(error_body(message, status), status=status)


def sse_event(payload: Any) -> bytes:
    """One server-sent event carrying JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


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
        status = _CLIENT_CLOSED
        raise
    finally:
        metrics.REQUESTS.labels(_endpoint(request), str(status)).inc()
