"""SGLang's native HTTP API: /generate, /get_model_info, /server_info, /health,
/health_generate, /flush_cache and /metrics, answered the way SGLang's own clients read them."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from functools import lru_cache
from typing import Any

from aiohttp import web

from radixmesh.core.sampling_params import SamplingParams
from radixmesh.mesh.service import health_handler, metrics_response
from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
    GenerationError,
    GenerationRequest,
)
from radixmesh.services.tokenizer.http_util import (
    SSE_DONE,
    SSE_HEADERS,
    error_body,
    error_response,
    sse_event,
)
from radixmesh.services.tokenizer.mesh_client import MeshClient
from radixmesh.services.tokenizer.native_request import NativeItem, NativeRequest, parse_generate
from radixmesh.services.tokenizer.native_response import NativeOutput, TokenText
from radixmesh.services.tokenizer.request_checks import build_request
from radixmesh.services.tokenizer.request_trace import encode_traced

_Event = tuple[int, GenerationChunk | GenerationError]


class NativeApi:
    """The handlers, bound to the mesh client and what describes this server."""

    def __init__(
        self,
        client: MeshClient,
        model_path: str,
        server_args: dict[str, Any],
        health_timeout_s: float = 20.0,
    ) -> None:
        self.client = client
        self.model_path = model_path
        self.server_args = server_args
        self.health_timeout_s = health_timeout_s

    def add_routes(self, app: web.Application) -> None:
        """Register every route of the native API on `app`."""
        router = app.router
        router.add_post("/generate", self.generate)
        router.add_get("/get_model_info", self.model_info)
        router.add_get("/server_info", self.server_info)
        router.add_get("/get_server_info", self.server_info)
        router.add_get("/health", health_handler(self._health))
        router.add_get("/health_generate", self.health_generate)
        router.add_route("GET", "/flush_cache", self.flush_cache)
        router.add_route("POST", "/flush_cache", self.flush_cache)
        router.add_get("/metrics", metrics_response)

    # ---- /generate ----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Run one prompt or a batch; stream SSE events or answer once at the end."""
        started = time.monotonic()
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the body is not valid JSON: {exc}")
        try:
            parsed = parse_generate(body)
            jobs = [self._prepare(item) for item in parsed.items]
        except ValueError as exc:
            return error_response(str(exc))
        token_text = self._token_text() if parsed.return_text_in_logprobs else None
        outputs = [NativeOutput(item, started, token_text) for item in parsed.items]
        if parsed.stream:
            return await self._stream(request, parsed, jobs, outputs)
        return await self._answer(parsed, jobs, outputs)

    def _prepare(self, item: NativeItem) -> GenerationRequest:
        if item.input_ids is not None:
            ids, field = item.input_ids, "input_ids"
        else:
            ids, field = encode_traced(self.client.tokenizer, item.text or "", item.rid), "text"
        logprobs = (item.return_logprob, item.logprob_start_len, item.top_logprobs_num)
        return build_request(self.client, item.rid, ids, item.sampling, logprobs,
                             item.cache_salt, item.priority, field)

    def _token_text(self) -> TokenText:
        decode = self.client.tokenizer.decode

        @lru_cache(maxsize=4096)
        def text(token_id: int) -> str:
            return decode([token_id], skip_special_tokens=False)

        return text

    async def _answer(
        self, parsed: NativeRequest, jobs: list[GenerationRequest], outputs: list[NativeOutput]
    ) -> web.Response:
        tasks = [asyncio.create_task(self._collect(job, out)) for job, out in zip(jobs, outputs,
                                                                                strict=True)]
        try:
            await asyncio.gather(*tasks)
        except GenerationError as exc:
            return error_response(str(exc), exc.status)
        finally:
            await _cancel(tasks)
        bodies = [out.body() for out in outputs]
        return web.json_response(bodies if parsed.batch else bodies[0])

    async def _collect(self, job: GenerationRequest, out: NativeOutput) -> None:
        async with aclosing(self.client.generate(job)) as chunks:
            async for chunk in chunks:
                out.add(chunk)

    async def _stream(
        self,
        request: web.Request,
        parsed: NativeRequest,
        jobs: list[GenerationRequest],
        outputs: list[NativeOutput],
    ) -> web.StreamResponse:
        events: asyncio.Queue[_Event] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, job, events)) for i, job in enumerate(jobs)]
        response: web.StreamResponse | None = None
        try:
            running = len(jobs)
            while running:
                index, event = await events.get()
                if isinstance(event, GenerationError):
                    if response is None:  # nothing sent yet: a plain error answer
                        return error_response(str(event), event.status)
                    await response.write(sse_event(error_body(str(event), event.status)))
                    break
                if response is None:
                    response = web.StreamResponse(headers=SSE_HEADERS)
                    await response.prepare(request)
                outputs[index].add(event)
                payload = outputs[index].body()
                if parsed.batch:
                    payload["index"] = index
                await response.write(sse_event(payload))
                if event.finish is not None:
                    running -= 1
            assert response is not None
            await response.write(SSE_DONE)
            await response.write_eof()
            return response
        finally:
            await _cancel(tasks)

    async def _pump(
        self, index: int, job: GenerationRequest, events: asyncio.Queue[_Event]
    ) -> None:
        try:
            async with aclosing(self.client.generate(job)) as chunks:
                async for chunk in chunks:
                    events.put_nowait((index, chunk))
        except GenerationError as exc:
            events.put_nowait((index, exc))

    # ---- the rest -----------------------------------------------------------------------

    async def model_info(self, _: web.Request) -> web.Response:
        """What SGLang's frontend reads to pick a chat template."""
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "served_model_name": self.client.model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
            }
        )

    async def server_info(self, _: web.Request) -> web.Response:
        """This replica's settings, with each engine's own state under internal_states."""
        client = self.client
        return web.json_response(
            {
                **self.server_args,
                "served_model_name": client.model_name,
                "context_length": client.context_length,
                "engines": client.engines.ids,
                "internal_states": await client.engine_infos(),
            },
            dumps=lambda obj: json.dumps(obj, default=str),
        )

    def _health(self) -> tuple[bool, dict[str, Any]]:
        engines = len(self.client.engines)
        return engines > 0, {"engines": engines}

    async def health_generate(self, _: web.Request) -> web.Response:
        """Healthy when an engine generates one token in time."""
        client = self.client
        probe = GenerationRequest(
            rid=f"health-{uuid.uuid4().hex}",
            input_ids=client.tokenizer.encode("ping")[:1] or [0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        finish: dict[str, Any] | None = None
        try:
            async with asyncio.timeout(self.health_timeout_s):
                async with aclosing(client.generate(probe)) as chunks:
                    async for chunk in chunks:
                        finish = chunk.finish
        except GenerationError as exc:
            return error_response(str(exc), exc.status)
        except TimeoutError:
            return error_response("no engine generated in time", 503)
        if finish is None or finish.get("type") == "abort":
            return error_response(f"the probe request failed: {finish}", 503)
        return web.Response(text="")

    async def flush_cache(self, _: web.Request) -> web.Response:
        """Drop every engine's prefix cache."""
        if not self.client.engines.ids:
            return error_response("no engine is available", 503)
        if await self.client.flush_cache():
            return web.Response(text="Cache flushed.\n")
        return error_response("an engine did not flush its cache (requests still running?)")


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel what is still running (closing its generation) and wait for it."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
