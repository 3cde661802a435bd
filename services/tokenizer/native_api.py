"""SGLang's native HTTP API: /generate, /get_model_info, /server_info, /health,
/health_generate, /flush_cache and /metrics, answered the way SGLang's own clients read them.

A /generate body is read into one GeneratePrompt per prompt (native_protocol.py); each
becomes a checked GenerationRequest, and its GenerationChunks build up its answer
(NativeOutput)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from functools import lru_cache
from typing import Any

from aiohttp import web

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.meta_info import (
    TokenText,
)
from radixmesh.core.model_info import model_info
from radixmesh.core.request import (
    FieldNames,
    GenerationRequest,
    RequestError,
    build_request,
    nth_sample,
)
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.mesh.service import health_handler, metrics_response
from radixmesh.services.tokenizer.chat_answer import parse_function_call, separate_reasoning
from radixmesh.services.tokenizer.client import MeshClient
from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
    GenerationError,
    model_limits,
)
from radixmesh.services.tokenizer.http_util import SSE_DONE, cancel_all, json_answer, sse_event
from radixmesh.services.tokenizer.native_protocol import (
    GenerateCall,
    GeneratePrompt,
    NativeOutput,
    parse_generate,
)
from radixmesh.services.tokenizer.request_trace import encode_traced

_Event = tuple[int, GenerationChunk | GenerationError]
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    503: "ServiceUnavailableError",
}


class NativeApi:
    """The handlers, bound to the mesh client and what describes this server."""

    def __init__(
        self,
        client: MeshClient,
        model_path: str,
        server_args: dict[str, Any],
        health_timeout_s: float = 20.0,
        incremental_streaming_output: bool = False,
    ) -> None:
        self.client = client
        self.model_path = model_path
        self.server_args = server_args
        self.health_timeout_s = health_timeout_s
        self.incremental = incremental_streaming_output

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
        router.add_post("/load_lora_adapter", self.load_lora_adapter)
        router.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        router.add_get("/metrics", metrics_response)
        router.add_post("/parse_function_call", _parse_route(parse_function_call))
        router.add_post("/separate_reasoning", _parse_route(separate_reasoning))

    # ---- /generate -----------------------------------------------------------------------

    async def generate(self, http: web.Request) -> web.StreamResponse:
        """Run one prompt or a batch; stream SSE events or answer once at the end."""
        started = time.monotonic()
        try:
            body = json.loads(await http.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the body is not valid JSON: {exc}")
        try:
            parsed = parse_generate(body)
            prompts = [self._prepare(item) for item in parsed.items]
        except ValueError as exc:
            return error_response(str(exc))
        token_text = self._token_text() if parsed.return_text_in_logprobs else None
        jobs: list[GenerationRequest] = []
        outputs: list[NativeOutput] = []
        for item, prompt in zip(parsed.items, prompts, strict=True):
            for k in range(parsed.n):
                job = prompt if parsed.n == 1 else nth_sample(prompt, f"{prompt.rid}_{k}", k)
                jobs.append(job)
                outputs.append(NativeOutput(replace(item, rid=job.rid), started, token_text,
                                            self.incremental))
        if parsed.n > 1:
            try:
                await self._cache_prompts(prompts)
            except GenerationError as exc:
                return error_response(str(exc), exc.status, exc.headers)
        if parsed.stream:
            return await self._stream(http, parsed, jobs, outputs)
        return await self._answer(parsed, jobs, outputs)

    def _prepare(self, item: GeneratePrompt) -> GenerationRequest:
        if item.input_ids is not None:
            ids, field = item.input_ids, "input_ids"
        else:
            ids, field = encode_traced(self.client.tokenizer, item.text or "", item.rid), "text"
        logprobs = LogprobRequest(item.return_logprob, item.top_logprobs_num,
                                  item.logprob_start_len)
        return build_request(model_limits(self.client), item.rid, ids, item.sampling, logprobs,
                             item.cache_salt, item.priority, FieldNames(prompt=field),
                             item.lora_path)

    async def _cache_prompts(self, prompts: list[GenerationRequest]) -> None:
        """Prefill each prompt once, generating nothing, before its samples start: they
        are separate requests, and started together each would compute the prompt itself;
        after this they find it in the prefix cache (the router sends them where it went)."""
        prefills = [
            replace(prompt, rid=f"{prompt.rid}_prefix", params=SamplingParams(max_new_tokens=0),
                    logprobs=LogprobRequest())
            for prompt in prompts
        ]
        tasks = [asyncio.create_task(self._collect(job, None)) for job in prefills]
        try:
            await asyncio.gather(*tasks)
        finally:
            await cancel_all(tasks)

    def _token_text(self) -> TokenText:
        decode = self.client.tokenizer.decode

        @lru_cache(maxsize=4096)
        def text(token_id: int) -> str:
            return decode([token_id], skip_special_tokens=False)

        return text

    async def _answer(
        self, parsed: GenerateCall, jobs: list[GenerationRequest], outputs: list[NativeOutput]
    ) -> web.Response:
        tasks = [asyncio.create_task(self._collect(job, out)) for job, out in zip(jobs, outputs,
                                                                                strict=True)]
        try:
            await asyncio.gather(*tasks)
        except GenerationError as exc:
            return error_response(str(exc), exc.status, exc.headers)
        finally:
            await cancel_all(tasks)
        bodies = [out.body() for out in outputs]
        return json_answer(bodies if parsed.listed else bodies[0])

    async def _collect(self, job: GenerationRequest, out: NativeOutput | None) -> None:
        async with aclosing(self.client.generate(job, stream=False)) as chunks:
            async for chunk in chunks:
                if out is not None:
                    out.add(chunk)

    async def _stream(
        self,
        http: web.Request,
        parsed: GenerateCall,
        jobs: list[GenerationRequest],
        outputs: list[NativeOutput],
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        running = len(jobs)
        async with aclosing(self._events(jobs)) as batches:
            async for batch in batches:
                events = []
                for index, event in batch:
                    if isinstance(event, GenerationError):
                        if response is None:  # nothing sent yet: a plain error answer
                            return error_response(str(event), event.status, event.headers)
                        events.append(sse_event(error_body(str(event), event.status)))
                        running = 0
                        break
                    outputs[index].add(event)
                    payload = outputs[index].event()
                    if parsed.listed:
                        payload["index"] = index
                    events.append(sse_event(payload))
                    if event.finish is not None:
                        running -= 1
                if response is None:
                    response = web.StreamResponse(headers=_SSE_HEADERS)
                    await response.prepare(http)
                if not running:
                    events.append(SSE_DONE)
                await response.write(b"".join(events))
                if not running:
                    break
        assert response is not None
        await response.write_eof()
        return response

    async def _events(self, jobs: list[GenerationRequest]) -> AsyncIterator[list[_Event]]:
        """The jobs' output as it comes: every chunk at hand each time (one per request and
        wake-up, see MeshClient), an error in place of a job's chunks when it fails."""
        if len(jobs) == 1:  # no fan-in: the request's chunks as they are
            try:
                async with aclosing(self.client.generate(jobs[0])) as chunks:
                    async for chunk in chunks:
                        yield [(0, chunk)]
            except GenerationError as exc:
                yield [(0, exc)]
            return
        events: asyncio.Queue[_Event] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(i, job, events)) for i, job in enumerate(jobs)]
        try:
            while True:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                yield batch
        finally:
            await cancel_all(tasks)

    async def _pump(
        self, index: int, job: GenerationRequest, events: asyncio.Queue[_Event]
    ) -> None:
        try:
            async with aclosing(self.client.generate(job)) as chunks:
                async for chunk in chunks:
                    events.put_nowait((index, chunk))
        except GenerationError as exc:
            events.put_nowait((index, exc))

    # ---- the rest ------------------------------------------------------------------------

    async def model_info(self, _: web.Request) -> web.Response:
        """What SGLang's frontend reads to pick a chat template, and the model's shape as
        the engines report it."""
        client = self.client
        return web.json_response(
            model_info(self.model_path, client.model_name, client.engines.model_shape,
                       client.tokenizer, client.lora_names, client.pooling is None)
        )

    async def server_info(self, _: web.Request) -> web.Response:
        """This replica's settings, with each engine's own state under internal_states."""
        client = self.client
        return web.json_response(
            {
                **self.server_args,
                "served_model_name": client.model_name,
                "context_length": client.context_length,
                **client.engines.model_shape,
                "lora_adapters": sorted(client.lora_names),
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
        finish: FinishReason | None = None
        try:
            async with asyncio.timeout(self.health_timeout_s):
                async with aclosing(client.generate(probe, stream=False)) as chunks:
                    async for chunk in chunks:
                        finish = chunk.finish
        except GenerationError as exc:
            return error_response(str(exc), exc.status)
        except TimeoutError:
            return error_response("no engine generated in time", 503)
        if finish is None or finish.kind is FinishKind.ABORT:
            said = finish.to_dict() if finish else None
            return error_response(f"the probe request failed: {said}", 503)
        return web.Response(text="")

    async def flush_cache(self, _: web.Request) -> web.Response:
        """Drop every engine's prefix cache."""
        if not self.client.engines.ids:
            return error_response("no engine is available", 503)
        if await self.client.flush_cache():
            return web.Response(text="Cache flushed.\n")
        return error_response("an engine did not flush its cache (requests still running?)")

    async def load_lora_adapter(self, http: web.Request) -> web.Response:
        """SGLang's {"lora_name", "lora_path"}: every engine serves that PEFT adapter."""
        return await self._change_lora(http, load=True)

    async def unload_lora_adapter(self, http: web.Request) -> web.Response:
        """SGLang's {"lora_name"}: no engine serves it any more (refused while in use)."""
        return await self._change_lora(http, load=False)

    async def _change_lora(self, http: web.Request, load: bool) -> web.Response:
        try:
            body = json.loads(await http.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the body is not valid JSON: {exc}")
        fields = ("lora_name", "lora_path") if load else ("lora_name",)
        if not isinstance(body, dict):
            return error_response("the body must be a JSON object")
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name]:
                return error_response(f"{name} must be a non-empty string")
        error = await self.client.change_lora(load, *(body[name] for name in fields))
        answer = {"success": not error, "error_message": error,
                  "loaded_adapters": sorted(self.client.lora_names)}
        return web.json_response(answer, status=400 if error else 200)


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """{"error": {"message", "type", "code"}} as the SGLang-native API answers."""
    kind = _ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(message: str, status: int = 400, headers: dict[str, str] | None = None
                   ) -> web.Response:
    """An error answer with `error_body`."""
    return web.json_response(error_body(message, status), status=status, headers=headers)


def _parse_route(parse: Callable[[Any], dict[str, Any]]
                 ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A route answering `parse(body)` (SGLang's /parse_function_call, /separate_reasoning)."""
    async def route(http: web.Request) -> web.Response:
        try:
            return web.json_response(parse(json.loads(await http.read())))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the body is not valid JSON: {exc}")
        except RequestError as exc:
            return error_response(str(exc))
    return route
