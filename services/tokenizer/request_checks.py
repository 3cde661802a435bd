"""Checks every front door applies to a tokenized prompt before it goes to an engine.

Each raises ValueError with a message that names the offending field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from radixmesh.core.request import LogprobRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.services.tokenizer.generation import (
    GenerationClient,
    GenerationRequest,
    check_length,
)

DEFAULT_MAX_NEW_TOKENS = SamplingParams.max_new_tokens
# Alternatives per position a client may ask for; each costs a sort over the vocabulary.
_MAX_TOP_LOGPROBS = 1024


def check_input_ids(input_ids: list[int], vocab_size: int, field: str = "input_ids") -> None:
    """A non-empty list of token ids inside the vocabulary."""
    if not input_ids:
        raise ValueError(f"{field}: the prompt is empty")
    for token_id in input_ids:
        if not (isinstance(token_id, int) and not isinstance(token_id, bool)):
            raise ValueError(f"{field} must hold integers, got {token_id!r}")
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"{field} entries must be in [0, {vocab_size}), got {token_id}")


def sampling_params(
    raw: dict[str, Any], prompt_tokens: int, context_length: int, vocab_size: int
) -> SamplingParams:
    """SamplingParams from a client's dict; a missing max_new_tokens shrinks to what fits."""
    params = SamplingParams.from_dict(raw)
    if "max_new_tokens" not in raw and context_length:
        room = max(context_length - prompt_tokens, 0)
        params = replace(params, max_new_tokens=min(DEFAULT_MAX_NEW_TOKENS, room),
                         min_new_tokens=min(params.min_new_tokens, room))
    return finish_checks(params, prompt_tokens, context_length, vocab_size)


def finish_checks(
    params: SamplingParams, prompt_tokens: int, context_length: int, vocab_size: int
) -> SamplingParams:
    """Checks that need the model: stop token ids in the vocabulary, the length limit."""
    params.validate(vocab_size)
    if params.top_k > vocab_size:
        raise ValueError(f"top_k must be <= the vocabulary size {vocab_size}, got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64), got {params.seed}")
    if context_length:
        check_length(prompt_tokens, params.max_new_tokens, context_length)
    return params


def logprob_request(
    return_logprob: bool, logprob_start_len: int, top_logprobs_num: int, prompt_tokens: int
) -> LogprobRequest:
    """Which logprobs to send back; a start past the prompt's end is refused."""
    if not 0 <= top_logprobs_num <= _MAX_TOP_LOGPROBS:
        raise ValueError(
            f"top_logprobs_num must be in [0, {_MAX_TOP_LOGPROBS}], got {top_logprobs_num}"
        )
    if logprob_start_len < -1:
        raise ValueError(f"logprob_start_len must be >= -1, got {logprob_start_len}")
    if logprob_start_len >= prompt_tokens:
        raise ValueError(
            f"logprob_start_len ({logprob_start_len}) must be less than the prompt length "
            f"({prompt_tokens})"
        )
    if not return_logprob:
        return LogprobRequest()
    return LogprobRequest(True, top_logprobs_num, logprob_start_len)


def build_request(
    client: GenerationClient,
    rid: str,
    input_ids: list[int],
    sampling: dict[str, Any],
    logprobs: tuple[bool, int, int] = (False, -1, 0),
    cache_salt: str | None = None,
    priority: int = 0,
    field: str = "input_ids",
) -> GenerationRequest:
    """A checked request from a prompt's ids, its sampling dict and (return_logprob,
    logprob_start_len, top_logprobs_num); `field` names where the prompt came from."""
    vocab, context = client.vocab_size, client.context_length
    check_input_ids(input_ids, vocab, field)
    params = sampling_params(sampling, len(input_ids), context, vocab)
    return_logprob, start, top = logprobs
    wanted = logprob_request(return_logprob, start, top, len(input_ids))
    return GenerationRequest(rid, input_ids, params, wanted, cache_salt, priority)
