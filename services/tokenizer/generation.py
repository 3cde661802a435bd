"""What the tokenizer's front doors (HTTP, gRPC) ask of the mesh and get back: the
GenerationClient they call (MeshClient, or a fake in tests), the GenerationChunks a request's
output arrives in, and GenerationError for a request the mesh cannot serve."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from radixmesh.core.finish import FinishReason
from radixmesh.core.meta_info import CachedTokens, Disaggregated, TokenLogprob
from radixmesh.core.pooling import Pooling, Reranker
from radixmesh.core.request import GenerationRequest, ModelLimits
from radixmesh.core.tokenizer import Tokenizer


@dataclass
class GenerationChunk:
    """What one request produced since its previous chunk; the last one has `finish`."""

    rid: str
    text: str  # new text, stop strings applied
    output_ids: list[int]  # new output token ids
    prompt_tokens: int
    completion_tokens: int  # output tokens so far, counting these
    cached_tokens: int  # prompt tokens found in a prefix cache, all tiers
    finish: FinishReason | None = None  # None while running
    # Logprobs of `output_ids` and their alternatives (when the request asked).
    output_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    # Prompt logprobs from logprob_start_len on, complete on the last chunk only.
    input_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    # The parts of cached_tokens loaded back from the host and storage tiers.
    cached_host_tokens: int = 0
    cached_storage_tokens: int = 0
    # Speculative decoding so far: verify steps and the draft tokens they accepted.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # Prefill/decode disaggregation: the engines and the KV transfer (None: one engine).
    disaggregated: Disaggregated | None = None
    # Embedding: the prompt's pooled final hidden state, as the engine computed it
    # (normalized by the front door), with the finish.
    embedding: list[float] | None = None

    def merge(self, later: GenerationChunk) -> None:
        """Take in the request's next chunk: one chunk for both, as if they came as one."""
        self.text += later.text
        self.output_ids += later.output_ids
        self.output_token_logprobs += later.output_token_logprobs
        self.output_top_logprobs += later.output_top_logprobs
        self.prompt_tokens, self.completion_tokens = later.prompt_tokens, later.completion_tokens
        self.cached_tokens = later.cached_tokens
        self.cached_host_tokens = later.cached_host_tokens
        self.cached_storage_tokens = later.cached_storage_tokens
        self.spec_verify_ct = later.spec_verify_ct
        self.spec_accepted_tokens = later.spec_accepted_tokens
        self.finish = later.finish
        self.input_token_logprobs = later.input_token_logprobs
        self.input_top_logprobs = later.input_top_logprobs
        self.disaggregated = later.disaggregated or self.disaggregated
        self.embedding = later.embedding or self.embedding

    @property
    def cached_tokens_details(self) -> CachedTokens:
        """cached_tokens by tier: the rest of the hit was on the device."""
        return CachedTokens.split(
            self.cached_tokens, self.cached_host_tokens, self.cached_storage_tokens
        )


class GenerationError(Exception):
    """A request the mesh could not serve (or refused: an engine that could not compile its
    constraint); `status` is the HTTP status to answer with, and `retry_after` the seconds a
    client should wait before trying again (overload)."""

    def __init__(self, message: str, status: int = 503, retry_after: int | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        self.param = param  # the request's field at fault, when it is one

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers of its answer."""
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}


class GenerationClient(Protocol):
    """The mesh as the front doors see it (MeshClient, or a fake in tests)."""

    tokenizer: Tokenizer
    model_name: str  # what /v1/models lists and the `model` field must name
    grammar_backend: str  # the grammar_backend setting; "none": constraints are refused
    pooling: Pooling | None  # an embedding model's; None: the model generates
    reranker: Reranker | None  # a reranker's answer tokens and prompt; None: not one

    @property
    def context_length(self) -> int:
        """Longest prompt + output an engine accepts (0 until an engine is known)."""

    @property
    def vocab_size(self) -> int:
        """Vocabulary size of the served model."""

    @property
    def lora_names(self) -> frozenset[str]:
        """The LoRA adapters served, by name."""

    @property
    def hidden_size(self) -> int:
        """The model's hidden size (0 while unknown)."""


    def generate(self, request: GenerationRequest, stream: bool = True
                 ) -> AsyncIterator[GenerationChunk]:
        """Run a request; closing the iterator (or cancelling its task) early aborts it
        and its KV slots return to the pool. Raises GenerationError when no engine can
        take it. Without `stream` the caller waits for the whole answer, so output may come
        in fewer, larger chunks."""


def model_limits(client: GenerationClient) -> ModelLimits:
    """What the client's requests are checked against (build_request)."""
    return ModelLimits(client.context_length, client.vocab_size, client.grammar_backend,
                       compile_grammars=False, lora_names=client.lora_names,
                       embedding=client.pooling is not None)
