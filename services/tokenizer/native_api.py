"""SGLang's native HTTP API: /generate, /get_model_info, /server_info, /health,
/health_generate, /flush_cache and /metrics, answered the way SGLang's own clients read them.

A /generate body is read into one GeneratePrompt per prompt (fields SGLang knows but this server
does not implement are accepted only with a value that changes nothing); each item becomes a
checked GenerationRequest, and its GenerationChunks build up its answer. Like SGLang, every
answer (and every streamed event) carries the text and output ids so far, not just the new
part; its clients slice off what they already have."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from aiohttp import web

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.meta_info import (
    CachedTokens,
    LogprobLists,
    Speculated,
    TokenLogprob,
    TokenText,
    meta_info,
)
from radixmesh.core.model_info import model_info
from radixmesh.core.request import (
    FieldNames,
    GenerationRequest,
    RequestError,
    build_request,
    is_int,
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
from radixmesh.services.tokenizer.http_util import SSE_DONE, json_answer, sse_event
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
        router.add_post("/parse_function_call", _parse_route(parse_function_call))
        router.add_post("/separate_reasoning", _parse_route(separate_reasoning))

    # ---- /generate -----------------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Run one prompt or a batch; stream SSE events or answer once at the end."""
        started = time.monotonic()
        try:
            body = json.loads(await request.read())
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
                outputs.append(NativeOutput(replace(item, rid=job.rid), started, token_text))
        if parsed.n > 1:
            try:
                await self._cache_prompts(prompts)
            except GenerationError as exc:
                return error_response(str(exc), exc.status, exc.headers)
        if parsed.stream:
            return await self._stream(request, parsed, jobs, outputs)
        return await self._answer(parsed, jobs, outputs)

    def _prepare(self, item: GeneratePrompt) -> GenerationRequest:
        if item.input_ids is not None:
            ids, field = item.input_ids, "input_ids"
        else:
            ids, field = encode_traced(self.client.tokenizer, item.text or "", item.rid), "text"
        logprobs = LogprobRequest(item.return_logprob, item.top_logprobs_num,
                                  item.logprob_start_len)
        return build_request(model_limits(self.client), item.rid, ids, item.sampling, logprobs,
                             item.cache_salt, item.priority, FieldNames(prompt=field))

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
            await _cancel(tasks)

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
            await _cancel(tasks)
        bodies = [out.body() for out in outputs]
        return json_answer(bodies if parsed.listed else bodies[0])

    async def _collect(self, job: GenerationRequest, out: NativeOutput | None) -> None:
        async with aclosing(self.client.generate(job)) as chunks:
            async for chunk in chunks:
                if out is not None:
                    out.add(chunk)

    async def _stream(
        self,
        request: web.Request,
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
                    payload = outputs[index].body()
                    if parsed.listed:
                        payload["index"] = index
                    events.append(sse_event(payload))
                    if event.finish is not None:
                        running -= 1
                if response is None:
                    response = web.StreamResponse(headers=_SSE_HEADERS)
                    await response.prepare(request)
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

    # ---- the rest ------------------------------------------------------------------------

    async def model_info(self, _: web.Request) -> web.Response:
        """What SGLang's frontend reads to pick a chat template, and the model's shape as
        the engines report it."""
        client = self.client
        return web.json_response(
            model_info(self.model_path, client.model_name, client.engines.model_shape,
                       client.tokenizer)
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
                async with aclosing(client.generate(probe)) as chunks:
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


async def _cancel(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel what is still running (closing its generation) and wait for it."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


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
    async def route(request: web.Request) -> web.Response:
        try:
            return web.json_response(parse(json.loads(await request.read())))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(f"the body is not valid JSON: {exc}")
        except RequestError as exc:
            return error_response(str(exc))
    return route


# ---- the /generate body ----------------------------------------------------------------------


def _empty(value: object) -> bool:
    return value is None or value in ("", [], {}, False)


# Top-level fields SGLang clients may send, and the values that ask for nothing.
_NEUTRAL_FIELDS: dict[str, Callable[[Any], bool]] = {
    "lora_path": _empty,
    "image_data": _empty,
    "video_data": _empty,
    "audio_data": _empty,
    "modalities": _empty,
    "input_embeds": _empty,
    "session_params": _empty,
    "custom_logit_processor": _empty,
    "return_hidden_states": _empty,
    "token_ids_logprob": _empty,
    "bootstrap_host": _empty,
    "bootstrap_port": _empty,
    "bootstrap_room": _empty,
    "data_parallel_rank": _empty,
    "log_metrics": lambda v: isinstance(v, bool),
}
# Sampling parameters of SGLang not implemented here: only their neutral values pass.
_NEUTRAL_SAMPLING: dict[str, Callable[[Any], bool]] = {
    "stop_regex": _empty,
    "custom_params": _empty,
}
MAX_N = 128  # samples per prompt (sampling_params.n), as the OpenAI routes allow
_PER_ITEM = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
             "rid", "cache_salt", "priority")
_FIELDS = {"text", "input_ids", "stream", "return_text_in_logprobs", *_PER_ITEM}


@dataclass(frozen=True)
class GeneratePrompt:
    """One prompt of a /generate call, not yet tokenized or checked against the model."""

    text: str | None
    input_ids: list[int] | None
    sampling: dict[str, Any]
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    rid: str
    cache_salt: str | None
    priority: int


@dataclass(frozen=True)
class GenerateCall:
    """A whole /generate call: one prompt or a batch of them."""

    items: list[GeneratePrompt]
    batch: bool
    stream: bool
    return_text_in_logprobs: bool
    n: int = 1  # samples of each prompt

    @property
    def listed(self) -> bool:
        """Whether the answer is a list (and stream events carry an index): a batch, or
        n samples of one prompt, as SGLang answers."""
        return self.batch or self.n > 1


def parse_generate(body: Any) -> GenerateCall:
    """Read a decoded JSON body; raises ValueError naming the first bad field."""
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in _FIELDS:
            continue
        neutral = _NEUTRAL_FIELDS.get(key)
        if neutral is None:
            raise ValueError(f"unknown field {key!r}")
        if not neutral(value):
            raise ValueError(f"{key} is not supported by this server")
    prompts, batch = _prompts(body.get("text"), body.get("input_ids"))
    n = len(prompts)
    per_item = {key: _spread(body, key, n, batch) for key in _PER_ITEM}
    items = []
    samples = set()
    for i, (text, ids) in enumerate(prompts):
        raw = {key: values[i] for key, values in per_item.items()}
        sampling = _sampling(raw["sampling_params"])
        samples.add(_n(sampling.pop("n", None)))
        items.append(
            GeneratePrompt(
                text=text,
                input_ids=ids,
                sampling=sampling,
                return_logprob=_bool(raw["return_logprob"], "return_logprob"),
                logprob_start_len=_int(raw["logprob_start_len"], "logprob_start_len", -1),
                top_logprobs_num=_int(raw["top_logprobs_num"], "top_logprobs_num", 0),
                rid=_str(raw["rid"], "rid") or uuid.uuid4().hex,
                cache_salt=_str(raw["cache_salt"], "cache_salt"),
                priority=_int(raw["priority"], "priority", 0),
            )
        )
    rids = [item.rid for item in items]
    if len(set(rids)) != len(rids):
        raise ValueError("rid: the ids of a batch must differ")
    if len(samples) > 1:
        raise ValueError("sampling_params.n must be the same for every prompt of a batch")
    return GenerateCall(
        items=items,
        batch=batch,
        stream=_bool(body.get("stream"), "stream"),
        return_text_in_logprobs=_bool(body.get("return_text_in_logprobs"),
                                      "return_text_in_logprobs"),
        n=samples.pop(),
    )


def _n(value: Any) -> int:
    if value is None:
        return 1
    if not is_int(value) or not 1 <= value <= MAX_N:
        raise ValueError(f"sampling_params.n must be an integer in [1, {MAX_N}], got {value!r}")
    return value


def _prompts(text: Any, input_ids: Any) -> tuple[list[tuple[str | None, list[int] | None]], bool]:
    """[(text, ids)] per prompt, and whether the call was a batch."""
    if text is not None and input_ids is not None:
        raise ValueError("give either text or input_ids, not both")
    if text is not None:
        if isinstance(text, str):
            return [(text, None)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [(t, None) for t in text], True
        raise ValueError("text must be a string or a non-empty list of strings")
    if input_ids is not None:
        if isinstance(input_ids, list) and input_ids and all(
            isinstance(ids, list) for ids in input_ids
        ):
            return [(None, _ids(ids)) for ids in input_ids], True
        return [(None, _ids(input_ids))], False
    raise ValueError("text or input_ids is required")


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise ValueError("input_ids must be a list of integers or a non-empty list of such lists")
    return value


def _spread(body: dict[str, Any], key: str, n: int, batch: bool) -> list[Any]:
    """A per-prompt field: one value for all prompts, or (in a batch) one per prompt."""
    value = body.get(key)
    # A list of values per prompt; stop lists and the like live inside sampling_params.
    if batch and isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{key} has {len(value)} entries for {n} prompts")
        return value
    if batch and key == "rid" and value is not None:
        raise ValueError("rid must be a list with one id per prompt in a batch")
    return [value] * n


def _sampling(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"sampling_params must be an object, got {type(value).__name__}")
    out = {}
    for key, item in value.items():
        neutral = _NEUTRAL_SAMPLING.get(key)
        if neutral is not None:
            if not neutral(item):
                raise ValueError(f"sampling_params.{key} is not supported by this server")
        elif item is not None:  # null means the default, as SGLang's clients send it
            out[key] = item
    return out


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean, got {value!r}")
    return value


def _int(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{name} must fit in 32 bits, got {value}")
    return value


def _str(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {value!r}")
    return value or None


# ---- one prompt's answer ---------------------------------------------------------------------


class NativeOutput:
    """Accumulates one request's chunks; `body()` is its answer so far."""

    def __init__(self, item: GeneratePrompt, started: float, token_text: TokenText | None) -> None:
        self.item = item
        self.started = started
        self._token_text = token_text
        self.text = ""
        self.output_ids: list[int] = []
        self.last: GenerationChunk | None = None
        self._output_logprobs: list[TokenLogprob] = []
        self._output_top: list[list[TokenLogprob]] = []

    def add(self, chunk: GenerationChunk) -> None:
        """Take the next chunk of this request."""
        self.text += chunk.text
        self.output_ids += chunk.output_ids
        self._output_logprobs += chunk.output_token_logprobs
        self._output_top += chunk.output_top_logprobs
        self.last = chunk

    def body(self) -> dict[str, Any]:
        """{"text", "output_ids", "meta_info"} as SGLang answers."""
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self._meta()}

    def _meta(self) -> dict[str, Any]:
        last = self.last
        logprobs: LogprobLists | None = None
        if self.item.return_logprob:
            # The prompt's logprobs come whole with the last chunk.
            final = last if last is not None and last.finish is not None else None
            tops = self.item.top_logprobs_num > 0
            logprobs = LogprobLists(
                input_token=final.input_token_logprobs if final else [],
                output_token=self._output_logprobs,
                input_top=(final.input_top_logprobs if final else []) if tops else None,
                output_top=self._output_top if tops else None,
            )
        return meta_info(
            self.item.rid,
            last.finish if last else None,
            last.prompt_tokens if last else 0,
            last.completion_tokens if last else 0,
            last.cached_tokens_details if last else CachedTokens(),
            e2e_latency=time.monotonic() - self.started,
            logprobs=logprobs,
            token_text=self._token_text,
            spec=Speculated(last.spec_verify_ct, last.spec_accepted_tokens) if last else None,
            disaggregated=last.disaggregated if last else None,
        )
