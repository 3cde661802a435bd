"""OpenAI /v1/completions and /v1/chat/completions requests: read, checked and turned into
the GenerationRequests the mesh runs (one per prompt and sample, prompt-major), and the error
format OpenAI clients expect when a request is refused.

Optional fields set to null read as absent, as OpenAI treats them; a bad field raises
OpenAIError naming it."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

from jinja2 import TemplateError

from radixmesh.core.request import (
    FieldNames,
    GenerationRequest,
    ModelLimits,
    RequestError,
    build_request,
    is_int,
    nth_sample,
)
from radixmesh.core.sampling_params import LogprobRequest, SamplingParams
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.chat_answer import AnswerShape, chat_messages, chat_setup

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128
MAX_TOP_LOGPROBS = 20
# OpenAI/SGLang fields this server cannot honour: refused when set, never silently dropped.
_COMPLETION_UNSUPPORTED = ("suffix",)
_CHAT_UNSUPPORTED = ("functions",)
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token id lists"
# OpenAI's newer "developer" role is its name for the system prompt; a "tool" message carries
# a tool's result back.
# SGLang's sampling fields, accepted as they are (SamplingParams checks them).
_PASSTHROUGH = (
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "logit_bias",  # OpenAI's own field; SamplingParams reads its string keys
    "regex",  # SGLang's extra constraint fields; response_format gives json_schema
    "ebnf",
    "structural_tag",
    "stop_token_ids",
    "sampling_seed",  # SGLang's name of seed
)
# OpenAI's error `type` by HTTP status; any other 4xx is an invalid request, 5xx a server error.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


# ---- errors ----------------------------------------------------------------------------------


class OpenAIError(Exception):
    """A request the API refuses; `param` names the offending field when there is one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


def _error_type(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer (also the payload of an error event in a stream)."""
    kind = _error_type(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


# ---- requests --------------------------------------------------------------------------------


class ServedModel(NamedTuple):
    """The model behind the API, as requests are checked against it and answers read."""

    name: str
    context_length: int  # 0 while no engine is known: lengths are then left to the mesh
    vocab_size: int
    grammar_backend: str = "xgrammar"  # "none": constraints are refused
    tool_call_parser: str | None = None  # how the model writes tool calls; None: unparsed
    reasoning_parser: str | None = None  # how the model marks its thinking; None: unparsed
    lora_names: frozenset[str] = frozenset()  # LoRA adapters a request's model may name
    embedding: bool = False  # an embedding model: /v1/embeddings only

    @property
    def limits(self) -> ModelLimits:
        return ModelLimits(self.context_length, self.vocab_size, self.grammar_backend,
                           compile_grammars=False, lora_names=self.lora_names,
                           embedding=self.embedding)

    def adapter(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names ("NAME" or "BASE:NAME"), None for the
        base model; OpenAIError for a model not served."""
        if name is None or name == self.name:
            return None
        base, colon, adapter = name.rpartition(":")
        if name in self.lora_names:
            return name
        if colon and base == self.name and adapter in self.lora_names:
            return adapter
        served = repr(self.name)
        if self.lora_names:
            served += f" and its LoRA adapters {', '.join(sorted(self.lora_names))}"
        raise OpenAIError(f"the model {name!r} does not exist; this server serves {served}",
                          "model")


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
    answer: AnswerShape = AnswerShape()  # chat: how the answer splits into message fields
    model: str = ""  # what the answers name as their model (the request's); empty: the base


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
    stream, include_usage, adapter = _check_common(body, model, _COMPLETION_UNSUPPORTED)
    echo = _get_bool(body, "echo")
    top_logprobs = _get_int(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    if echo and stream and top_logprobs is not None:
        raise OpenAIError("echo with logprobs is not supported when streaming", "echo")
    n = _n(body)
    best_of = _get_int(body, "best_of", 1, MAX_N)
    if best_of is not None and best_of != n:
        raise OpenAIError("best_of other than n is not supported", "best_of")
    max_tokens = _get_int(body, "max_tokens", minimum=0)
    max_tokens = COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    sampling = _sampling_fields(body, max_tokens)
    prompts = prompt_ids(body.get("prompt"), tokenizer)
    # Echoed prompts with logprobs need the prompt's own logprobs, from its first token.
    logprobs = _logprob_request(top_logprobs, prompt_logprobs=echo)
    names = _names(body, "prompt", "max_tokens")
    built = [_build(body, model, adapter, request_id, ids, sampling, logprobs, names)
             for ids, _ in prompts]
    return OpenAIRequest(
        id=request_id,
        requests=_samples(request_id, built, n),
        n=n,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top_logprobs,
        echo=[_prompt_text(tokenizer, ids, text) for ids, text in prompts] if echo else [],
        model=_get_str(body, "model") or "",
    )


def parse_chat(
    body: dict[str, Any], tokenizer: Tokenizer, model: ServedModel, request_id: str
) -> OpenAIRequest:
    """Check a /v1/chat/completions request, render its chat template, build its requests."""
    stream, include_usage, adapter = _check_common(body, model, _CHAT_UNSUPPORTED)
    want_logprobs = _get_bool(body, "logprobs")
    top_logprobs = _get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs and not want_logprobs:
        raise OpenAIError("top_logprobs requires logprobs to be true", "top_logprobs")
    n = _n(body)
    try:
        messages = chat_messages(body.get("messages"))
        setup = chat_setup(body, model.tool_call_parser, model.reasoning_parser)
    except RequestError as exc:
        raise OpenAIError(str(exc), exc.field) from None
    try:
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **setup.template_kwargs
        )
    except (ValueError, TemplateError) as exc:
        raise OpenAIError(f"the chat template rejected the messages: {exc}", "messages") from None
    # The template already wrote the special tokens the model expects.
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    max_param = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        max_param = "max_completion_tokens"
    max_tokens = _get_int(body, max_param, minimum=0)
    if max_tokens is None:
        max_tokens = _room_left(len(ids), model)
    top = (top_logprobs or 0) if want_logprobs else None
    names = _names(body, "messages", max_param)
    built = _build(body, model, adapter, request_id, ids, _sampling_fields(body, max_tokens),
                   _logprob_request(top), names)
    return OpenAIRequest(
        id=request_id,
        requests=_samples(request_id, [built], n),
        n=n,
        stream=stream,
        include_usage=include_usage,
        top_logprobs=top,
        answer=setup.shape,
        model=_get_str(body, "model") or "",
    )


def _check_common(body: dict[str, Any], model: ServedModel, unsupported: tuple[str, ...]
                  ) -> tuple[bool, bool, str | None]:
    """The fields both routes share: model, user, those refused, response_format; returns
    whether to stream, whether to end the stream with a usage chunk, and the LoRA adapter
    `model` names (None: the base model)."""
    adapter = model.adapter(_get_str(body, "model"))
    _get_str(body, "user")
    for field in unsupported:
        if body.get(field) not in (None, "", [], {}):
            raise OpenAIError(f"{field} is not supported by this server", field)
    _check_response_format(body)
    return (*_stream_options(body), adapter)


def _check_response_format(body: dict[str, Any]) -> None:
    """response_format as a type SGLang's fields understand: json_object and json_schema
    become a json_schema constraint (written back into the body for _sampling_params)."""
    form = _get_object(body, "response_format")
    kind = form.get("type", "text")
    if kind == "text":
        return
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = form.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise OpenAIError(
                "response_format.json_schema must be an object with a name", "response_format"
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise OpenAIError("response_format.json_schema.schema must be an object",
                              "response_format")
    else:
        raise OpenAIError(
            f"response_format type must be text, json_object or json_schema, got {kind!r}",
            "response_format",
        )
    if body.get("json_schema") is not None:
        raise OpenAIError("give response_format or json_schema, not both", "response_format")
    body["json_schema"] = json.dumps(schema)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """Whether to stream, and whether to end the stream with a usage chunk."""
    stream = _get_bool(body, "stream")
    options = _get_object(body, "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise OpenAIError(
            f"stream_options.include_usage must be a boolean, got {include_usage!r}",
            "stream_options.include_usage",
        )
    return stream, stream and bool(include_usage)


def _n(body: dict[str, Any]) -> int:
    n = _get_int(body, "n", 1, MAX_N)
    return 1 if n is None else n


def _room_left(prompt_tokens: int, model: ServedModel) -> int:
    """The default chat output budget: whatever the context has left."""
    if not model.context_length:
        return SamplingParams.max_new_tokens
    return max(model.context_length - prompt_tokens, 0)


def prompt_ids(prompt: Any, tokenizer: Tokenizer, field: str = "prompt"
               ) -> list[tuple[list[int], str | None]]:
    """Each prompt's token ids, with its text when it came as text (build_request checks
    them against the vocabulary)."""
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt)
    ):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise OpenAIError(f"{field} must be {_PROMPT_SHAPES}, got {prompt!r}", field)
    prompts: list[tuple[list[int], str | None]] = []
    for item in items:
        if isinstance(item, str):
            prompts.append((tokenizer.encode(item), item))
        elif isinstance(item, list) and all(is_int(t) for t in item):
            prompts.append((list(item), None))
        else:
            raise OpenAIError(f"{field} must be {_PROMPT_SHAPES}, got {item!r}", field)
        if not prompts[-1][0]:
            raise OpenAIError(f"{field} must not be empty", field)
    return prompts


def _prompt_text(tokenizer: Tokenizer, ids: list[int], text: str | None) -> str:
    return text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)


def _logprob_request(top_logprobs: int | None, prompt_logprobs: bool = False) -> LogprobRequest:
    if top_logprobs is None:
        return LogprobRequest()
    return LogprobRequest(True, top_logprobs, 0 if prompt_logprobs else -1)


def _names(body: dict[str, Any], prompt: str, max_param: str) -> FieldNames:
    """The fields errors name, as OpenAI's clients wrote them."""
    constraint = "response_format" if body.get("response_format") else None
    return FieldNames(prompt, max_param, "min_tokens", constraint)


def _build(
    body: dict[str, Any],
    model: ServedModel,
    adapter: str | None,
    request_id: str,
    ids: list[int],
    sampling: dict[str, Any],
    logprobs: LogprobRequest,
    names: FieldNames,
) -> GenerationRequest:
    """One prompt's request, through the check every front door shares."""
    cache_salt = _get_str(body, "cache_salt")
    priority = _get_int(body, "priority") or 0
    try:
        return build_request(model.limits, request_id, ids, sampling, logprobs, cache_salt,
                             priority, names, adapter)
    except RequestError as exc:
        raise OpenAIError(str(exc), exc.field) from None


def _samples(request_id: str, prompts: list[GenerationRequest], n: int
             ) -> list[GenerationRequest]:
    """n samples of each prompt, prompt-major, each with its own id."""
    requests = []
    for prompt in prompts:
        for sample in range(n):
            requests.append(nth_sample(prompt, f"{request_id}-{len(requests)}", sample))
    return requests


# ---- sampling fields (OpenAI's and SGLang's extras) ------------------------------------------


def _sampling_fields(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The sampling fields of a request (OpenAI's and SGLang's), by SGLang's names."""
    fields: dict[str, Any] = {"max_new_tokens": max_tokens}
    optional = {
        "temperature": _get_number(body, "temperature", 0, 2),
        "top_p": _get_number(body, "top_p", 0, 1),
        "presence_penalty": _get_number(body, "presence_penalty", -2, 2),
        "frequency_penalty": _get_number(body, "frequency_penalty", -2, 2),
        "min_new_tokens": _get_int(body, "min_tokens", minimum=0),
        "seed": _get_int(body, "seed"),
        "stop": body.get("stop"),
        **{name: body.get(name) for name in _PASSTHROUGH},
        "json_schema": body.get("json_schema"),
    }
    fields.update({name: value for name, value in optional.items() if value is not None})
    return fields


# ---- typed reads of a request body's optional fields -----------------------------------------


def _check_range(name: str, value: float, minimum: float | None, maximum: float | None) -> None:
    if minimum is not None and maximum is not None and not minimum <= value <= maximum:
        raise OpenAIError(f"{name} must be between {minimum} and {maximum}, got {value}", name)
    if minimum is not None and value < minimum:
        raise OpenAIError(f"{name} must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise OpenAIError(f"{name} must be <= {maximum}, got {value}", name)


def _get_int(
    body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    """An optional integer field within [minimum, maximum]."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise OpenAIError(f"{name} must be an integer, got {value!r}", name)
    _check_range(name, value, minimum, maximum)
    return value


def _get_number(
    body: dict[str, Any], name: str, minimum: float | None = None, maximum: float | None = None
) -> float | None:
    """An optional finite number field within [minimum, maximum], as a float."""
    value = body.get(name)
    if value is None:
        return None
    if not (is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise OpenAIError(f"{name} must be a number, got {value!r}", name)
    _check_range(name, value, minimum, maximum)
    return float(value)


def _get_bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """An optional boolean field."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{name} must be a boolean, got {value!r}", name)
    return value


def _get_str(body: dict[str, Any], name: str) -> str | None:
    """An optional string field."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(f"{name} must be a string, got {value!r}", name)
    return value


def _get_object(body: dict[str, Any], name: str) -> dict[str, Any]:
    """An optional JSON object field; absent reads as {}."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise OpenAIError(f"{name} must be an object, got {value!r}", name)
    return value
