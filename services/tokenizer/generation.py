"""What the tokenizer's front doors (HTTP, gRPC) ask of the mesh, whatever the transport:
a validated, tokenized request in, a stream of output chunks back."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from radixmesh.core.request import LogprobRequest
from radixmesh.core.sampling_params import SamplingParams
from radixmesh.core.tokenizer import Tokenizer

# A token's logprob as SGLang reports it: (logprob or None, token id, token text or None).
TokenLogprob = tuple[float | None, int, str | None]


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt, tokenized and validated, ready to route to an engine."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    logprobs: LogprobRequest = field(default_factory=LogprobRequest)
    cache_salt: str | None = None
    priority: int = 0


@dataclass
class GenerationChunk:
    """What one request produced since its previous chunk; the last one has `finish`."""

    rid: str
    text: str  # new text, stop strings applied
    output_ids: list[int]  # new output token ids
    prompt_tokens: int
    completion_tokens: int  # output tokens so far, counting these
    cached_tokens: int
    # SGLang's finish_reason object ({"type": "stop", "matched": ...}), None while running.
    finish: dict[str, Any] | None = None
    # Logprobs of `output_ids` and their alternatives (when the request asked).
    output_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    # Prompt logprobs from logprob_start_len on, complete on the last chunk only.
    input_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)


class GenerationError(Exception):
    """A request the mesh could not serve; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 503) -> None:
        super().__init__(message)
        self.status = status


class GenerationClient(Protocol):
    """The mesh as the front doors see it."""

    tokenizer: Tokenizer
    model_name: str  # what /v1/models lists and the `model` field must name

    @property
    def context_length(self) -> int:
        """Longest prompt + output an engine accepts (0 until an engine is known)."""

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the served model."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Run a request; closing the iterator (or cancelling its task) early aborts it
        and its KV slots return to the pool. Raises GenerationError when no engine can
        take it."""


def check_length(prompt_tokens: int, max_new_tokens: int, context_length: int) -> None:
    """Raise ValueError when a prompt, or prompt plus the requested output, cannot fit."""
    if prompt_tokens >= context_length:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens; the model's context length is "
            f"{context_length}"
        )
    if prompt_tokens + max_new_tokens > context_length:
        raise ValueError(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
            f"the model's context length of {context_length}"
        )
