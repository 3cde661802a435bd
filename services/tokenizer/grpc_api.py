"""The public gRPC port: the Generate service (Generate: the fields of /generate, streamed
back as deltas; Embed: one prompt's embedding, as /encode), the standard health service
and server reflection, so that generic clients (grpcurl, grpc_health_probe, load
balancers) need nothing but the port."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from radixmesh.core.finish import FinishReason
from radixmesh.core.meta_info import TokenLogprob
from radixmesh.core.request import FieldNames, GenerationRequest, build_request
from radixmesh.core.sampling_params import LogprobRequest
from radixmesh.proto import generate_pb2 as gpb
from radixmesh.proto import generate_pb2_grpc as ggrpc
from radixmesh.services.tokenizer import metrics
from radixmesh.services.tokenizer.embedding_api import embed, embedding_request, embedding_setup
from radixmesh.services.tokenizer.generation import (
    GenerationChunk,
    GenerationClient,
    GenerationError,
    model_limits,
)
from radixmesh.services.tokenizer.request_trace import encode_traced

SERVICE_NAME = gpb.DESCRIPTOR.services_by_name["Generate"].full_name
_METHOD = f"/{SERVICE_NAME}/Generate"
_EMBED = f"/{SERVICE_NAME}/Embed"
TRACED_RPCS = {_METHOD: _METHOD[1:], _EMBED: _EMBED[1:]}
_ENDPOINT = f"grpc:{_METHOD}"
_OPTIONAL_SAMPLING = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "seed", "skip_special_tokens",
    "spaces_between_special_tokens", "json_schema", "regex", "ebnf", "structural_tag",
)


def sampling_dict(p: gpb.ClientSamplingParams) -> dict[str, Any]:
    """The set fields of ClientSamplingParams as the dict /generate takes."""
    out: dict[str, Any] = {name: getattr(p, name) for name in _OPTIONAL_SAMPLING
                           if p.HasField(name)}
    if p.stop:
        out["stop"] = list(p.stop)
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.logit_bias:
        out["logit_bias"] = dict(p.logit_bias)
    out["ignore_eos"] = p.ignore_eos
    out["no_stop_trim"] = p.no_stop_trim
    return out


def _public_finish(finish: FinishReason) -> gpb.Finish:
    """A FinishReason as the public API's Finish message."""
    out = gpb.Finish(kind=finish.kind.value, message=finish.message or "")
    matched = finish.matched
    if isinstance(matched, str):
        out.text = matched
    elif isinstance(matched, int):
        out.token_id = matched
    return out


def _entries(logprobs: list[TokenLogprob]) -> list[gpb.TokenLogprobEntry]:
    return [
        gpb.TokenLogprobEntry(logprob=lp or 0.0, token_id=tid, has_logprob=lp is not None)
        for lp, tid, _ in logprobs
    ]


def response_from_chunk(chunk: GenerationChunk) -> gpb.GenerateResponse:
    """One GenerationChunk as one streamed GenerateResponse."""
    out = gpb.GenerateResponse(
        rid=chunk.rid,
        text=chunk.text,
        output_ids=chunk.output_ids,
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        cached_tokens=chunk.cached_tokens,
        cached_tokens_details=gpb.CachedTokensDetails(**chunk.cached_tokens_details.to_dict()),
        output_token_logprobs=_entries(chunk.output_token_logprobs),
        output_top_logprobs=[gpb.TopLogprobList(items=_entries(top))
                             for top in chunk.output_top_logprobs],
        input_token_logprobs=_entries(chunk.input_token_logprobs),
        input_top_logprobs=[gpb.TopLogprobList(items=_entries(top or []))
                            for top in chunk.input_top_logprobs],
    )
    if chunk.finish is not None:
        out.finish.CopyFrom(_public_finish(chunk.finish))
    return out


class _Outcome:
    """The status code an RPC ends with (an abort sets it before it raises)."""

    code = grpc.StatusCode.OK


@contextlib.contextmanager
def _counted(endpoint: str) -> Iterator[_Outcome]:
    """Count the RPC under the status code it ended with: its abort's, CANCELLED, INTERNAL
    for anything unexpected, else OK."""
    outcome = _Outcome()
    try:
        yield outcome
    except asyncio.CancelledError:
        outcome.code = grpc.StatusCode.CANCELLED
        raise
    except Exception:
        if outcome.code is grpc.StatusCode.OK:
            outcome.code = grpc.StatusCode.INTERNAL
        raise
    finally:
        metrics.REQUESTS.labels(endpoint, outcome.code.name).inc()


def _refusal(exc: Exception) -> grpc.StatusCode:
    """A refused request's status: what it asked is wrong, or no engine could serve it."""
    if isinstance(exc, GenerationError) and exc.status != 400:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INVALID_ARGUMENT


class GenerateService(ggrpc.GenerateServicer):
    """Serves Generate from a GenerationClient; a cancelled call aborts its request."""

    def __init__(self, client: GenerationClient) -> None:
        self.client = client

    async def Generate(  # noqa: N802 - the RPC's name
        self, request: gpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gpb.GenerateResponse]:
        """Validate, run on an engine, stream each chunk back."""
        with _counted(_ENDPOINT) as outcome:
            try:
                job = self._prepare(request)
                async with aclosing(self.client.generate(job)) as chunks:
                    async for chunk in chunks:
                        yield response_from_chunk(chunk)
            except (ValueError, GenerationError) as exc:
                outcome.code = _refusal(exc)
                await context.abort(outcome.code, str(exc))

    async def Embed(  # noqa: N802 - the RPC's name
        self, request: gpb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> gpb.EmbedResponse:
        """One prompt's embedding, as /encode gives it."""
        with _counted(f"grpc:{_EMBED}") as outcome:
            rid = request.rid or uuid.uuid4().hex
            try:
                pooling, dimensions = embedding_setup(self.client, request.dimensions or None)
                ids, field = self._prompt(request, rid)
                job = embedding_request(self.client, rid, ids, pooling.kind,
                                        FieldNames(prompt=field), request.cache_salt or None,
                                        request.lora_path or None)
                (chunk,) = await embed(self.client, [job])
            except (ValueError, GenerationError) as exc:
                outcome.code = _refusal(exc)
                await context.abort(outcome.code, str(exc))
            return gpb.EmbedResponse(
                rid=rid, embedding=pooling.finish(chunk.embedding or [], dimensions),
                prompt_tokens=chunk.prompt_tokens, cached_tokens=chunk.cached_tokens,
                cached_tokens_details=gpb.CachedTokensDetails(
                    **chunk.cached_tokens_details.to_dict()),
            )

    def _prompt(self, request: gpb.GenerateRequest | gpb.EmbedRequest, rid: str
                ) -> tuple[list[int], str]:
        """The prompt's ids and the field it came in."""
        which = request.WhichOneof("prompt")
        if which == "text":
            return encode_traced(self.client.tokenizer, request.text, rid), "text"
        if which == "input_ids":
            return list(request.input_ids.ids), "input_ids"
        raise ValueError("text or input_ids is required")

    def _prepare(self, request: gpb.GenerateRequest) -> GenerationRequest:
        rid = request.rid or uuid.uuid4().hex
        ids, field = self._prompt(request, rid)
        # Unset means "none" unless logprobs were asked for, where it means "from the start".
        start = request.logprob_start_len if request.return_logprob else -1
        return build_request(
            model_limits(self.client),
            rid,
            ids,
            sampling_dict(request.sampling_params),
            LogprobRequest(request.return_logprob, request.top_logprobs_num, start),
            request.cache_salt or None,
            request.priority,
            FieldNames(prompt=field),
            request.lora_path or None,
        )


class PublicPort:
    """Generate, health and reflection on one gRPC server. Health answers for the server
    ("") and for Generate: SERVING from `serving()` on, NOT_SERVING from `stopping()` on."""

    def __init__(self, server: grpc.aio.Server, client: GenerationClient) -> None:
        self._health = health.aio.HealthServicer()
        ggrpc.add_GenerateServicer_to_server(GenerateService(client), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )

    async def serving(self) -> None:
        """The tokenizer serves (call it before the server starts, so no check sees less)."""
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stopping(self) -> None:
        """The tokenizer began to stop: NOT_SERVING for every service, and for good."""
        await self._health.enter_graceful_shutdown()
