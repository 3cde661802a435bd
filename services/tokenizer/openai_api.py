"""The OpenAI-compatible HTTP routes: /v1/models, /v1/completions, /v1/chat/completions.

A request's n choices (times its prompts) run at once as separate generations, read as one
stream in arrival order (GenerationFanout); a client that hangs up aborts all of them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import aclosing
from types import TracebackType
from typing import Any

from aiohttp import web

from radixmesh.core.request import GenerationRequest
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
    GenerationClient,
    GenerationError,
)
from radixmesh.services.tokenizer.http_util import (
    CLIENT_CLOSED,
    SSE_DONE,
    cancel_all,
    json_answer,
    sse_event,
)
from radixmesh.services.tokenizer.openai_protocol import (
    OpenAIError,
    OpenAIRequest,
    ServedModel,
    error_body,
    parse_body,
    parse_chat,
    parse_completion,
)
from radixmesh.services.tokenizer.openai_responses import (
    ChatResponse,
    CompletionResponse,
    ResponseBuilder,
)
from radixmesh.services.tokenizer.request_trace import tokenize_span

log = logging.getLogger(__name__)

Parser = Callable[[dict[str, Any], Tokenizer, ServedModel, str], OpenAIRequest]

_SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
# How often a request checks that its client is still connected (see _watch_client).
_CLIENT_POLL_S = 0.2
# A queue item of the fanout: a request's index and its next chunk, its failure, or None once
# it ends.
_Item = tuple[int, GenerationChunk | BaseException | None]


def add_openai_routes(app: web.Application, client: GenerationClient,
                      tool_call_parser: str | None = None,
                      reasoning_parser: str | None = None) -> None:
    """Serve the OpenAI API on `app`, generating through `client`; chat answers are split by
    the parsers named (radixmesh.core.tool_parsers, radixmesh.core.reasoning)."""
    routes = OpenAIRoutes(client, tool_call_parser, reasoning_parser)
    app.router.add_get("/v1/models", routes.models)
    app.router.add_get("/v1/models/{model:.+}", routes.model)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)


def error_response(message: str, status: int = 400, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """An error answer in OpenAI's shape."""
    return web.json_response(error_body(message, status, param), status=status,
                             headers=headers)


def served_model(client: GenerationClient, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> ServedModel:
    """The model behind `client` as the OpenAI routes check requests against it."""
    vocab_size = client.vocab_size or client.tokenizer.vocab_size
    return ServedModel(client.model_name, client.context_length, vocab_size,
                       client.grammar_backend, tool_call_parser, reasoning_parser,
                       client.lora_names, client.pooling is not None)


class OpenAIRoutes:
    """The handlers, bound to one GenerationClient."""

    def __init__(self, client: GenerationClient, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.client = client
        self.created = int(time.time())
        self._parsers = (tool_call_parser, reasoning_parser)

    async def models(self, _: web.Request) -> web.Response:
        """GET /v1/models: the served model, then each LoRA adapter over it."""
        cards = [self._model_card(), *map(self._model_card, sorted(self.client.lora_names))]
        return web.json_response({"object": "list", "data": cards})

    async def model(self, http: web.Request) -> web.Response:
        """GET /v1/models/{model}: the served model, or a LoRA adapter over it."""
        name = http.match_info["model"]
        try:
            adapter = self._served_model().adapter(name)
        except OpenAIError as exc:
            return error_response(str(exc), 404, "model")
        return web.json_response(self._model_card(adapter))

    async def completions(self, http: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._serve(http, parse_completion, CompletionResponse, "cmpl")

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._serve(http, parse_chat, ChatResponse, "chatcmpl")

    def _model_card(self, adapter: str | None = None) -> dict[str, Any]:
        """The model's card, or (`adapter`) a LoRA adapter's, its base as its parent."""
        base = self.client.model_name
        card = {
            "id": adapter or base,
            "object": "model",
            "created": self.created,
            "owned_by": "radixmesh",
            "max_model_len": self.client.context_length or None,
        }
        return card if adapter is None else {**card, "parent": base, "root": base}

    def _served_model(self) -> ServedModel:
        return served_model(self.client, *self._parsers)

    async def _serve(
        self,
        http: web.Request,
        parse: Parser,
        builder_type: type[ResponseBuilder],
        id_prefix: str,
    ) -> web.StreamResponse:
        tokenizer = self.client.tokenizer
        try:
            body = parse_body(await http.read())
            with tokenize_span() as tokenized:
                parsed = parse(body, tokenizer, self._served_model(),
                               f"{id_prefix}-{uuid.uuid4().hex}")
                tokenized(parsed.requests)
        except OpenAIError as exc:
            return error_response(exc.message, exc.status, exc.param)
        except web.HTTPRequestEntityTooLarge as exc:
            return error_response(exc.text or "the request body is too large", exc.status)
        builder = builder_type(parsed, parsed.model or self.client.model_name, int(time.time()),
                               tokenizer)
        async with GenerationFanout(self.client, parsed.requests, parsed.stream) as fanout:
            watcher = asyncio.create_task(_watch_client(http, fanout))
            try:
                if parsed.stream:
                    return await _stream(http, fanout, builder)
                return await _complete(fanout, builder)
            except GenerationError as exc:
                # A constraint the engine refused came from response_format when there is one.
                param = "response_format" if exc.param and body.get("response_format") else (
                    exc.param)
                return error_response(str(exc), exc.status, param, exc.headers)
            except ClientGone:
                log.info("client of %s went away; its requests were aborted", parsed.id)
                return web.Response(status=CLIENT_CLOSED)
            except Exception:
                log.exception("request %s failed", parsed.id)
                return error_response("internal server error", 500)
            finally:
                watcher.cancel()


async def _complete(fanout: GenerationFanout, builder: ResponseBuilder) -> web.Response:
    async for index, chunk in fanout:
        builder.add(index, chunk)
    return json_answer(builder.response())


async def _stream(
    http: web.Request, fanout: GenerationFanout, builder: ResponseBuilder
) -> web.StreamResponse:
    # Wait for the first output before answering, so a request the mesh refuses at once
    # still gets a plain error with its status.
    first = await anext(fanout, None)
    head = builder.start_chunks() + (builder.delta_chunks(*first) if first else [])
    response = web.StreamResponse(headers=_SSE_HEADERS)
    await response.prepare(http)
    try:
        await response.write(_events(head))
        tail = await _relay(response, fanout, builder)
        await response.write(_events(tail) + SSE_DONE)
    except (ConnectionResetError, ClientGone):
        log.info("client of %s went away mid-stream; its requests were aborted", builder.request.id)
    return response


async def _relay(
    response: web.StreamResponse, fanout: GenerationFanout, builder: ResponseBuilder
) -> list[dict[str, Any]]:
    """Send chunks as they come; returns the events that end the stream."""
    try:
        async for index, chunk in fanout:
            await response.write(_events(builder.delta_chunks(index, chunk)))
    except (ConnectionResetError, ClientGone):
        raise
    except GenerationError as exc:
        return [error_body(str(exc), exc.status)]
    except Exception:
        # The headers are out: the error can only travel as an event.
        log.exception("stream of %s failed", builder.request.id)
        return [error_body("internal server error", 500)]
    return [builder.usage_chunk()] if builder.request.include_usage else []


def _events(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse_event(e) for e in events)


async def _watch_client(http: web.Request, fanout: GenerationFanout) -> None:
    """Tell the fanout when the client's connection closes."""
    # aiohttp cancels a handler whose client left only when the server enables handler
    # cancellation, and offers nothing to await otherwise, so the transport is polled; while
    # tokens flow, a failed write notices sooner.
    while http.transport is not None and not http.transport.is_closing():
        await asyncio.sleep(_CLIENT_POLL_S)
    fanout.client_gone()


# ---- n>1 and batches: several generations read as one ----------------------------------------


class ClientGone(Exception):
    """The HTTP client went away before its answer was complete."""


class GenerationFanout:
    """Runs requests concurrently and yields (index, chunk) as chunks arrive."""

    def __init__(self, client: GenerationClient, requests: Sequence[GenerationRequest],
                 stream: bool = True) -> None:
        self._client = client
        self._requests = list(requests)
        self._stream = stream
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = 0

    async def __aenter__(self) -> GenerationFanout:
        self._tasks = [
            asyncio.create_task(self._pump(index, request))
            for index, request in enumerate(self._requests)
        ]
        self._running = len(self._tasks)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await cancel_all(self._tasks)

    def client_gone(self) -> None:
        """Make the reader raise ClientGone at its next read."""
        self._queue.put_nowait((-1, ClientGone()))

    def __aiter__(self) -> GenerationFanout:
        return self

    async def __anext__(self) -> tuple[int, GenerationChunk]:
        while self._running:
            index, item = await self._queue.get()
            if item is None:
                self._running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    async def _pump(self, index: int, request: GenerationRequest) -> None:
        try:
            # Closing a stream that stopped early aborts its request in the mesh.
            async with aclosing(self._client.generate(request, self._stream)) as chunks:
                async for chunk in chunks:
                    self._queue.put_nowait((index, chunk))
        except Exception as exc:
            # The reader raises it; a cancellation (BaseException) just ends the pump.
            self._queue.put_nowait((index, exc))
        self._queue.put_nowait((index, None))
