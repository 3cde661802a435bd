"""OpenAI /v1/completions and /v1/chat/completions requests, checked and turned into the
GenerationRequests the mesh runs (one per prompt and sample, prompt-major)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from jinja2 import TemplateError

from radixmesh.core.request import LogprobRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationRequest, check_length
from radixmesh.services.tokenizer.openai_chat import chat_messages
from radixmesh.services.tokenizer.openai_errors import OpenAIError
from radixmesh.services.tokenizer.openai_fields import (
    get_bool,
    get_int,
    get_object,
    get_str,
    is_int,
)
from radixmesh.services.tokenizer.openai_sampling import sampling_params

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128
MAX_TOP_LOGPROBS = 20
# OpenAI/SGLang fields this server cannot honour: refused when set, never silently dropped.
_UNSUPPORTED = ("logit_bias", "regex", "json_schema", "ebnf")
_COMPLETION_UNSUPPORTED = (*_UNSUPPORTED, "suffix")
_CHAT_UNSUPPORTED = (*_UNSUPPORTED, "tools", "functions")
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token id lists"


class ServedModel(NamedTuple):
    """The model behind the API, as requests are checked against it."""

    name: str
    context_length: int  # 0 while no engine is known: lengths are then left to the mesh
    vocab_size: int


@dataclass(frozen=True)
class OpenAIRequest:
    """A checked request: what to run and how to shape the answer."""

    id: str
    requests: list[GenerationRequest]  # one per choice, in choice-index order
    n: int
    stream: bool
    include_usage: bool
    top_logprobs: int | None  # alternatives per token; None when logprobs are not wanted
    echo: list[str] = dataclasses.field(default_factory=list)  # per prompt, when echoing


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


def parse_completion(
    body: dict[str, Any], tokenizer: Tokenizer, model: ServedModel, request_id: str
) -> OpenAIRequest:
    """Check a /v1/completions request and build its GenerationRequests."""
    _check_common(body, model, _COMPLETION_UNSUPPORTED)
    stream, include_usage = _stream_options(body)
    echo = get_bool(body, "echo")
    top_logprobs = get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if echo and stream and top_logprobs is not None:
        raise OpenAIError("echo with logprobs is not supported when streaming", "echo")
    n = _n(body)
    best_of = get_int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise OpenAIError("best_of other than n is not supported", "best_of")
    max_tokens = get_int(body, "max_tokens", minimum=0)
    max_tokens = COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    params = sampling_params(body, max_tokens, "max_tokens", model.vocab_size)
    prompts = _completion_prompts(body.get("prompt"), tokenizer, model.vocab_size)
    for ids, _ in prompts:
        _check_length(len(ids), max_tokens, model, "prompt", "max_tokens")
    # Echoed prompts with logprobs need the prompt's own logprobs, from its first token.
    logprobs = _logprob_request(top_logprobs, prompt_logprobs=echo)
    inputs = [(ids, params) for ids, _ in prompts]
    return OpenAIRequest(
        id=request_id,
        requests=_generation_requests(body, request_id, inputs, n, logprobs),
        n=n,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
        echo=[_prompt_text(tokenizer, ids, text) for ids, text in prompts] if echo else [],
    )


def parse_chat(
    body: dict[str, Any], tokenizer: Tokenizer, model: ServedModel, request_id: str
) -> OpenAIRequest:
    """Check a /v1/chat/completions request, render its chat template, build its requests."""
    _check_common(body, model, _CHAT_UNSUPPORTED)
    _check_response_format(body)
    stream, include_usage = _stream_options(body)
    want_logprobs = get_bool(body, "logprobs")
    top_logprobs = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not want_logprobs:
        raise OpenAIError("top_logprobs requires logprobs to be true", "top_logprobs")
    n = _n(body)
    messages = chat_messages(body.get("messages"))
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except (ValueError, TemplateError) as exc:
        raise OpenAIError(f"the chat template rejected the messages: {exc}", "messages") from None
    # The template already wrote the special tokens the model expects.
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    max_param = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        max_param = "max_completion_tokens"
    max_tokens = get_int(body, max_param, minimum=0)
    if max_tokens is None:
        max_tokens = _room_left(len(ids), model)
    _check_length(len(ids), max_tokens, model, "messages", max_param)
    params = sampling_params(body, max_tokens, max_param, model.vocab_size)
    top = (top_logprobs or 0) if want_logprobs else None
    return OpenAIRequest(
        id=request_id,
        requests=_generation_requests(body, request_id, [(ids, params)], n, _logprob_request(top)),
        n=n,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top,
    )


def _check_common(body: dict[str, Any], model: ServedModel, unsupported: tuple[str, ...]) -> None:
    name = get_str(body, "model")
    if name is not None and name != model.name:
        raise OpenAIError(
            f"the model {name!r} does not exist; this server serves {model.name!r}", "model"
        )
    get_str(body, "user")
    for field in unsupported:
        if body.get(field) not in (None, "", [], {}):
            raise OpenAIError(f"{field} is not supported by this server", field)


def _check_response_format(body: dict[str, Any]) -> None:
    kind = get_object(body, "response_format").get("type", "text")
    if kind != "text":
        raise OpenAIError(
            f"response_format {kind!r} is not supported by this server", "response_format"
        )


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether to stream, and whether to end the stream with a usage chunk."""
    stream = get_bool(body, "stream")
    options = get_object(body, "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise OpenAIError(
            f"stream_options.include_usage must be a boolean, got {include_usage!r}",
            "stream_options.include_usage",
        )
    return stream, stream and bool(include_usage)


def _n(body: dict[str, Any]) -> int:
    n = get_int(body, "n", 1, MAX_N)
    return 1 if n is None else n


def _room_left(prompt_tokens: int, model: ServedModel) -> int:
    """The default chat output budget: whatever the context has left."""
    if not model.context_length:
        return SamplingParams.max_new_tokens
    return max(model.context_length - prompt_tokens, 0)


def _check_length(
    prompt_tokens: int, max_tokens: int, model: ServedModel, prompt_param: str, max_param: str
) -> None:
    if not model.context_length:
        return
    try:
        check_length(prompt_tokens, max_tokens, model.context_length)
    except ValueError as exc:
        too_long = prompt_tokens >= model.context_length
        message = str(exc).replace("max_new_tokens", max_param)
        raise OpenAIError(message, prompt_param if too_long else max_param) from None


def _completion_prompts(
    prompt: Any, tokenizer: Tokenizer, vocab_size: int
) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids, with its text when it came as text."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)
    ):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise OpenAIError(f"prompt must be {_PROMPT_SHAPES}, got {prompt!r}", "prompt")
    limit = vocab_size or tokenizer.vocab_size
    prompts: list[tuple[list[int], str | None]] = []
    for item in items:
        if isinstance(item, str):
            prompts.append((tokenizer.encode(item), item))
        elif isinstance(item, list) and all(is_int(t) for t in item):
            if any(not 0 <= t < limit for t in item):
                raise OpenAIError(f"prompt token ids must be in [0, {limit})", "prompt")
            prompts.append((list(item), None))
        else:
            raise OpenAIError(f"prompt must be {_PROMPT_SHAPES}, got {item!r}", "prompt")
        if not prompts[-1][0]:
            raise OpenAIError("prompt must not be empty", "prompt")
    return prompts


def _prompt_text(tokenizer: Tokenizer, ids: list[int], text: str | None) -> str:
    return text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)


def _logprob_request(top_logprobs: int | None, prompt_logprobs: bool = False) -> LogprobRequest:
    if top_logprobs is None:
        return LogprobRequest()
    return LogprobRequest(True, top_logprobs, 0 if prompt_logprobs else -1)


def _generation_requests(
    body: dict[str, Any],
    request_id: str,
    inputs: list[tuple[list[int], SamplingParams]],
    n: int,
    logprobs: LogprobRequest,
) -> list[GenerationRequest]:
    cache_salt = get_str(body, "cache_salt")
    priority = get_int(body, "priority") or 0
    requests = []
    for ids, params in inputs:
        for sample in range(n):
            # One seed for all n samples would make them identical; each takes the next one.
            seeded = params
            if params.seed is not None and sample:
                seeded = dataclasses.replace(params, seed=params.seed + sample)
            requests.append(
                GenerationRequest(
                    rid=f"{request_id}-{len(requests)}",
                    input_ids=ids,
                    params=seeded,
                    logprobs=logprobs,
                    cache_salt=cache_salt,
                    priority=priority,
                )
            )
    return requests
