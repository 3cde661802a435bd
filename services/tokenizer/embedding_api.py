"""The embedding front doors of a tokenizer replica: OpenAI's POST /v1/embeddings, SGLang's
POST /encode and the rerank route of vLLM and Cohere (POST /v1/rerank). Each input becomes
a prefill-only request pooled as the served model pools (core.pooling); its engine answers
with the pooled vector as the request's finish, which is cut to the `dimensions` asked for
and normalized here; a reranker's requests return their answer tokens' logits instead,
which become each document's score. A server whose model generates refuses them, as an
embedding server refuses generation (build_request)."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
import uuid
from array import array
from collections.abc import Sequence
from contextlib import aclosing
from typing import Any

from aiohttp import web

from radixmesh.core.meta_info import meta_info
from radixmesh.core.pooling import Pooling, ranked, rerank_inputs
from radixmesh.core.request import FieldNames, GenerationRequest, RequestError, build_request
from radixmesh.services.tokenizer import native_api, openai_api
from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
    GenerationClient,
    GenerationError,
    model_limits,
)
from radixmesh.services.tokenizer.http_util import cancel_all, json_answer
from radixmesh.services.tokenizer.openai_protocol import (
    OpenAIError,
    parse_body,
    prompt_ids,
)
from radixmesh.services.tokenizer.request_trace import encode_traced

_ENCODINGS = ("float", "base64")


class EmbeddingRoutes:
    """The handlers, bound to one GenerationClient."""

    def __init__(self, client: GenerationClient) -> None:
        self.client = client

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/embeddings", self.openai)
        app.router.add_post("/encode", self.native)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)

    async def openai(self, http: web.Request) -> web.Response:
        """POST /v1/embeddings: `input` as a string, strings, token ids or lists of them;
        `dimensions`; `encoding_format` float or base64 (little-endian float32)."""
        client = self.client
        try:
            body = parse_body(await http.read())
            adapter = self._adapter(body)
            encoding = body.get("encoding_format") or "float"
            if encoding not in _ENCODINGS:
                raise OpenAIError(f"encoding_format must be float or base64, got {encoding!r}",
                                  "encoding_format")
            if body.get("user") is not None and not isinstance(body["user"], str):
                raise OpenAIError("user must be a string", "user")
            pooling, dimensions = embedding_setup(client, body.get("dimensions"))
            prompts = prompt_ids(body.get("input"), client.tokenizer, "input")
            rid = f"embd-{uuid.uuid4().hex}"
            requests = [embedding_request(client, f"{rid}-{i}", ids, pooling.kind,
                                          FieldNames(prompt="input"), adapter=adapter)
                        for i, (ids, _) in enumerate(prompts)]
        except (OpenAIError, RequestError) as exc:
            param = exc.param if isinstance(exc, OpenAIError) else exc.field
            return openai_api.error_response(str(exc), getattr(exc, "status", 400), param)
        try:
            chunks = await embed(client, requests)
        except GenerationError as exc:
            return openai_api.error_response(str(exc), exc.status, exc.param, exc.headers)
        data = []
        for i, chunk in enumerate(chunks):
            vector = pooling.finish(chunk.embedding or [], dimensions)
            data.append({"object": "embedding", "index": i,
                         "embedding": _base64(vector) if encoding == "base64" else vector})
        return json_answer({
            "object": "list", "data": data, "model": body.get("model") or client.model_name,
            "usage": _usage(chunks),
        })

    async def native(self, http: web.Request) -> web.Response:
        """POST /encode (SGLang): `text` or `input_ids`, one or a list; `rid`, `dimensions`,
        `cache_salt`, `lora_path`. One answer per prompt: embedding and meta_info."""
        started = time.monotonic()
        try:
            body = json.loads(await http.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return native_api.error_response(f"the body is not valid JSON: {exc}")
        try:
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            pooling, dimensions = embedding_setup(self.client, body.get("dimensions"))
            prompts, listed, field = self._native_prompts(body)
            rids = _rids(body.get("rid"), len(prompts))
            cache_salt = body.get("cache_salt")
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise RequestError("cache_salt must be a string", "cache_salt")
            lora = body.get("lora_path")
            requests = [embedding_request(self.client, rid, ids, pooling.kind,
                                          FieldNames(prompt=field), cache_salt, lora)
                        for rid, ids in zip(rids, prompts, strict=True)]
        except RequestError as exc:
            return native_api.error_response(str(exc))
        try:
            chunks = await embed(self.client, requests)
        except GenerationError as exc:
            return native_api.error_response(str(exc), exc.status, exc.headers)
        latency = time.monotonic() - started
        answers = [{
            "embedding": pooling.finish(chunk.embedding or [], dimensions),
            "meta_info": meta_info(request.rid, chunk.finish, chunk.prompt_tokens, 0,
                                   chunk.cached_tokens_details, latency),
        } for request, chunk in zip(requests, chunks, strict=True)]
        return json_answer(answers if listed else answers[0])

    async def rerank(self, http: web.Request) -> web.Response:
        """POST /v1/rerank (also /rerank, /v2/rerank), as vLLM and Cohere take it: `query`,
        `documents` (strings or {"text": ...}), `top_n`, `return_documents` (default true);
        the results best first with their input `index` and `relevance_score`."""
        client = self.client
        try:
            body = parse_body(await http.read())
            reranker = client.reranker
            if reranker is None:
                raise RequestError("this server's model is not a reranker: serve one with "
                                   "--rerank-tokens (e.g. yes,no)")
            adapter = self._adapter(body)
            query, top_n = body.get("query"), body.get("top_n")
            texts = rerank_inputs(query, body.get("documents"), top_n)
            keep = body.get("return_documents", True)
            if not isinstance(keep, bool):
                raise RequestError("return_documents must be a boolean", "return_documents")
            rid = f"rerank-{uuid.uuid4().hex}"
            requests = [embedding_request(
                client, f"{rid}-{i}", encode_traced(client.tokenizer, reranker.prompt(query, t),
                                                    rid),
                "score", FieldNames(prompt="documents"), adapter=adapter,
                score_ids=reranker.score_ids) for i, t in enumerate(texts)]
        except (OpenAIError, RequestError) as exc:
            param = exc.param if isinstance(exc, OpenAIError) else exc.field
            return openai_api.error_response(str(exc), getattr(exc, "status", 400), param)
        try:
            # The first document alone: the prompt they all begin with (instruction and
            # query) is then cached, and the router sends the others where it is.
            chunks = await embed(client, requests[:1])
            chunks += await embed(client, requests[1:]) if len(requests) > 1 else []
        except GenerationError as exc:
            return openai_api.error_response(str(exc), exc.status, exc.param, exc.headers)
        scores = [reranker.score(chunk.embedding or [0.0, 0.0]) for chunk in chunks]
        return json_answer({
            "id": rid, "model": body.get("model") or client.model_name,
            "results": ranked(scores, texts, top_n, keep), "usage": _usage(chunks),
        })

    def _adapter(self, body: dict[str, Any]) -> str | None:
        """The LoRA adapter the body's `model` names (None: the base model); OpenAIError
        for a model not served, or not a string."""
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise OpenAIError(f"model must be a string, got {model!r}", "model")
        return openai_api.served_model(self.client).adapter(model)

    def _native_prompts(self, body: dict[str, Any]) -> tuple[list[list[int]], bool, str]:
        """The prompts' ids, whether they came as a list, and the field they came in."""
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("give exactly one of text and input_ids")
        if text is not None:
            texts = text if isinstance(text, list) else [text]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a non-empty list of strings",
                                   "text")
            tokenizer = self.client.tokenizer
            return [encode_traced(tokenizer, t, "") for t in texts], isinstance(text, list), "text"
        listed = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        items = ids if listed else [ids]
        if not all(isinstance(item, list) for item in items):
            raise RequestError("input_ids must be a list of token ids or a list of such lists",
                               "input_ids")
        return [list(item) for item in items], listed, "input_ids"


def embedding_setup(client: GenerationClient, dimensions: object) -> tuple[Pooling, int | None]:
    """The served model's pooling and a request's checked `dimensions`; RequestError where
    the model generates."""
    pooling = client.pooling
    if pooling is None:
        raise RequestError("this server's model generates: serve it with --is-embedding to "
                           "embed prompts")
    # Until an engine says how wide the model is, any positive width passes here.
    return pooling, pooling.check_dimensions(dimensions, client.hidden_size or 2**31 - 1)


def embedding_request(client: GenerationClient, rid: str, ids: list[int], pooling: str,
                      names: FieldNames, cache_salt: str | None = None, adapter: Any = None,
                      score_ids: tuple[int, ...] = ()) -> GenerationRequest:
    """A checked prefill-only request pooled by `pooling` (build_request refuses an adapter
    that is not served, by name)."""
    return build_request(model_limits(client), rid, ids, {"max_new_tokens": 0}, None,
                         cache_salt, 0, names, adapter, pooling, score_ids)


async def embed(client: GenerationClient, requests: Sequence[GenerationRequest]
                ) -> list[GenerationChunk]:
    """Run embedding requests at once; each one's last chunk, with its vector."""

    async def one(request: GenerationRequest) -> GenerationChunk:
        last = None
        async with aclosing(client.generate(request)) as chunks:
            async for chunk in chunks:
                last = chunk
        if last is None or last.embedding is None:
            message = last.finish.message if last and last.finish else ""
            raise GenerationError(message or "the engine returned no embedding", 503)
        return last

    tasks = [asyncio.create_task(one(r)) for r in requests]
    try:
        return await asyncio.gather(*tasks)
    finally:
        await cancel_all(tasks)


def _usage(chunks: list[GenerationChunk]) -> dict[str, Any]:
    """The prompt tokens the requests took, and how many of them were found cached."""
    used = sum(c.prompt_tokens for c in chunks)
    cached = sum(c.cached_tokens for c in chunks)
    return {"prompt_tokens": used, "total_tokens": used,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _base64(vector: list[float]) -> str:
    """OpenAI's base64 embedding: the float32 values, little-endian."""
    values = array("f", vector)
    if sys.byteorder == "big":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode()


def _rids(rid: object, count: int) -> list[str]:
    """One request id per prompt: the body's (one, or a list as long as the prompts) or new."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    rids = rid if isinstance(rid, list) else [rid]
    if len(rids) != count or not all(isinstance(r, str) and r for r in rids):
        raise RequestError("rid must be a string, or a list of one string per prompt", "rid")
    return rids
