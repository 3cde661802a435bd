"""The request a front door builds: one prompt, tokenized and checked against the served
model, ready for an engine.

Every front door (SGLang's /generate, the OpenAI routes, gRPC Generate, the in-process
`Engine` and so the frontend language) builds it through `build_request`: the same bounds
and the same error text, naming each field as that door's clients write it (`FieldNames`).
A refused request raises RequestError (a ValueError) and costs the engine nothing."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from radixmesh.core import grammar
from radixmesh.core.sampling_params import GRAMMAR_KINDS, LogprobRequest, SamplingParams

# Alternatives per position a client may ask for; each costs a sort over the vocabulary.
MAX_TOP_LOGPROBS = 1024


class RequestError(ValueError):
    """A request refused before it runs; `field` names the offending field as the door's
    client wrote it, when there is one."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ModelLimits:
    """What requests are checked against: the served model and how it is served."""

    context_length: int  # 0 while unknown (no engine seen yet): lengths are left to the engine
    vocab_size: int
    grammar_backend: str = "xgrammar"  # "none": constraints are refused
    # False where the engine compiles each constraint and refuses a bad one itself (a front
    # door that loads no grammar library): only its form is checked here.
    compile_grammars: bool = True
    lora_names: frozenset[str] = frozenset()  # the LoRA adapters served
    embedding: bool = False  # an embedding model: prompts are pooled, never generated from


@dataclass(frozen=True)
class FieldNames:
    """How a door's clients name the fields that errors speak of (SGLang's names by
    default); `constraint`, when set, is where every grammar came from."""

    prompt: str = "input_ids"
    max_new_tokens: str = "max_new_tokens"
    min_new_tokens: str = "min_new_tokens"
    constraint: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, tokenized and validated, ready to route to an engine."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    logprobs: LogprobRequest = field(default_factory=LogprobRequest)
    cache_salt: str | None = None
    priority: int = 0
    lora_path: str | None = None  # the LoRA adapter it runs with; None: the base model
    # Embedding: its prompt pooled by this kind (core.pooling) instead of generated from,
    # and for kind "score" the tokens whose logits it returns.
    pooling: str = ""
    score_ids: tuple[int, ...] = ()


def cache_namespace(cache_salt: str | None, lora_path: str | None) -> str | None:
    """The prefix cache a request's prompt lives in: its cache_salt's, apart for each LoRA
    adapter (the same tokens under another adapter have other KV)."""
    if not lora_path:
        return cache_salt
    return f"{cache_salt or ''}\x00lora:{lora_path}"


def is_int(value: object) -> bool:
    """True for JSON integers (bool is an int subclass in Python, not in JSON)."""
    return isinstance(value, int) and not isinstance(value, bool)


def build_request(
    limits: ModelLimits,
    rid: str,
    input_ids: list[int],
    sampling: Mapping[str, Any] | None = None,
    logprobs: LogprobRequest | None = None,
    cache_salt: str | None = None,
    priority: int = 0,
    names: FieldNames = FieldNames(),
    lora_path: str | None = None,
    pooling: str = "",
    score_ids: tuple[int, ...] = (),
) -> GenerationRequest:
    """The one check of a request: its prompt ids, its sampling dict (SGLang's names; a
    missing max_new_tokens shrinks to what fits), the logprobs it wants and its length
    against the context; `pooling` makes it an embedding request (core.pooling), which only
    an embedding model serves, and serves only those. Raises RequestError naming the field as
    `names` says."""
    if limits.embedding and not pooling:
        raise RequestError("this server serves an embedding model: it embeds prompts "
                           "(/v1/embeddings, /encode) and does not generate")
    if pooling and not limits.embedding:
        raise RequestError("this server's model generates: serve it with --is-embedding to "
                           "embed prompts")
    _check_input_ids(input_ids, limits.vocab_size, names.prompt)
    # Every door carries it as a 32-bit integer (the mesh's wire form is int32).
    if not is_int(priority) or not -(2**31) <= priority < 2**31:
        raise RequestError(f"priority must be a 32-bit integer, got {priority!r}", "priority")
    if sampling is not None and not isinstance(sampling, Mapping):
        raise RequestError(
            f"sampling_params must be an object, got {type(sampling).__name__}",
            "sampling_params",
        )
    raw = dict(sampling or {})
    try:
        params = _sampling_params(raw, len(input_ids), limits)
    except ValueError as exc:
        raise _named(str(exc), names) from None
    if limits.context_length:
        _check_length(len(input_ids), params.max_new_tokens, limits.context_length, names)
    wanted = _logprob_request(logprobs or LogprobRequest(), len(input_ids))
    _check_lora(lora_path, limits.lora_names)
    return GenerationRequest(rid, list(input_ids), params, wanted, cache_salt, priority,
                             lora_path, pooling, score_ids)


def _check_lora(lora_path: object, served: frozenset[str]) -> None:
    """An adapter the engine serves, or None."""
    if lora_path is None:
        return
    if not isinstance(lora_path, str):
        raise RequestError(f"lora_path must be an adapter's name, got {lora_path!r}",
                           "lora_path")
    if lora_path not in served:
        listed = f"served: {', '.join(sorted(served))}" if served else "this server serves none"
        raise RequestError(f"lora_path: unknown LoRA adapter {lora_path!r}; {listed}",
                           "lora_path")


def nth_sample(request: GenerationRequest, rid: str, index: int) -> GenerationRequest:
    """Sample `index` of a prompt that asks for n (OpenAI's n, /generate's
    sampling_params.n), under its own id. Samples without a seed draw their own; with one,
    each takes the next seed, since one seed for all n would make them identical."""
    params = request.params
    if params.seed is not None and index:
        params = replace(params, seed=params.seed + index)
    return replace(request, rid=rid, params=params)


def _check_input_ids(input_ids: list[int], vocab_size: int, name: str) -> None:
    """A non-empty list of token ids inside the vocabulary."""
    if not input_ids:
        raise RequestError(f"{name}: the prompt is empty", name)
    for token_id in input_ids:
        if not is_int(token_id):
            raise RequestError(f"{name} must hold integers, got {token_id!r}", name)
        if not 0 <= token_id < vocab_size:
            raise RequestError(
                f"{name} entries must be in [0, {vocab_size}), got {token_id}", name
            )


def _check_length(prompt_tokens: int, max_new_tokens: int, context_length: int,
                  names: FieldNames) -> None:
    """Refuse a prompt, or prompt plus the requested output, that cannot fit."""
    if prompt_tokens >= context_length:
        raise RequestError(
            f"the prompt has {prompt_tokens} tokens; the model's context length is "
            f"{context_length}",
            names.prompt,
        )
    if prompt_tokens + max_new_tokens > context_length:
        raise RequestError(
            f"prompt ({prompt_tokens} tokens) + {names.max_new_tokens} ({max_new_tokens}) "
            f"exceeds the model's context length of {context_length}",
            names.max_new_tokens,
        )


def _sampling_params(raw: dict[str, Any], prompt_tokens: int, limits: ModelLimits
                     ) -> SamplingParams:
    params = SamplingParams.from_dict(raw)
    if "max_new_tokens" not in raw and limits.context_length:
        room = max(limits.context_length - prompt_tokens, 0)
        params = replace(params, max_new_tokens=min(SamplingParams.max_new_tokens, room),
                         min_new_tokens=min(params.min_new_tokens, room))
    # What needs the model: stop token ids in the vocabulary, top_k, the grammar backend.
    vocab = limits.vocab_size
    params.validate(vocab)
    if params.top_k > vocab:
        raise ValueError(f"top_k must be <= the vocabulary size {vocab}, got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {params.seed}")
    grammar.check(params.grammar, limits.grammar_backend, limits.compile_grammars)
    return params


def _named(message: str, names: FieldNames) -> RequestError:
    """A sampling error (whose message starts with the field) in the door's own words."""
    constraint = next((kind for kind in GRAMMAR_KINDS if kind in message), None)
    if constraint is not None:
        return RequestError(message, names.constraint or constraint)
    for ours, theirs in (("max_new_tokens", names.max_new_tokens),
                         ("min_new_tokens", names.min_new_tokens)):
        message = message.replace(ours, theirs)
    return RequestError(message, message.split(" ", 1)[0])


def _logprob_request(wanted: LogprobRequest, prompt_tokens: int) -> LogprobRequest:
    """Which logprobs to send back; a start past the prompt's end is refused."""
    top, start = wanted.top_logprobs_num, wanted.logprob_start_len
    if not is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
            "top_logprobs_num",
        )
    if not is_int(start) or start < -1:
        raise RequestError(f"logprob_start_len must be >= -1, got {start!r}",
                           "logprob_start_len")
    if start >= prompt_tokens:
        raise RequestError(
            f"logprob_start_len ({start}) must be less than the prompt length "
            f"({prompt_tokens})",
            "logprob_start_len",
        )
    return wanted if wanted.return_logprob else LogprobRequest()
