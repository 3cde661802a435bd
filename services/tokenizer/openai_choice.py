"""One choice of an OpenAI answer as its GenerationChunks arrive, and the usage they add to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError, TokenLogprob


def finish_reason(finish: dict[str, Any] | None) -> str | None:
    """OpenAI's finish_reason; a request the mesh aborted is an error, not a finish."""
    if finish is None:
        return None
    kind = finish.get("type")
    if kind in ("stop", "length"):
        return kind
    raise GenerationError(str(finish.get("message") or "the request was aborted"), 503)


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    offset: int = 0  # text offset of the next token, for completion logprobs
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_top_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)

    def add(self, chunk: GenerationChunk, keep: bool) -> None:
        """Take the next chunk of this choice; `keep` its text and logprobs for the end."""
        self.finish_reason = finish_reason(chunk.finish)
        self.prompt_tokens = chunk.prompt_tokens
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = chunk.cached_tokens
        if not keep:
            return
        self.text += chunk.text
        self.token_logprobs += chunk.output_token_logprobs
        self.top_logprobs += chunk.output_top_logprobs
        if chunk.input_token_logprobs:
            # The mesh sends the prompt's logprobs whole, on the last chunk.
            self.prompt_logprobs = list(chunk.input_token_logprobs)
            self.prompt_top_logprobs = list(chunk.input_top_logprobs)


def usage(choices: Sequence[Choice], n: int) -> dict[str, Any]:
    """Token counts of a whole answer whose choices are `n` per prompt, prompt-major."""
    # A prompt counts once however many samples it has, with the best cache hit among them:
    # cached tokens then never exceed prompt tokens.
    groups = [choices[start : start + n] for start in range(0, len(choices), n)]
    prompt_tokens = sum(group[0].prompt_tokens for group in groups)
    completion_tokens = sum(choice.completion_tokens for choice in choices)
    cached_tokens = sum(max(choice.cached_tokens for choice in group) for group in groups)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
