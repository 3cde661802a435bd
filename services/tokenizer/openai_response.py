"""OpenAI response bodies and stream chunks, shaped from the mesh's GenerationChunks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.generation import GenerationChunk, TokenLogprob
from radixmesh.services.tokenizer.openai_choice import Choice, usage
from radixmesh.services.tokenizer.openai_logprobs import (
    chat_logprobs,
    completion_logprobs,
    join_completion_logprobs,
)
from radixmesh.services.tokenizer.openai_protocol import OpenAIRequest

Json = dict[str, Any]


class ResponseBuilder(ABC):
    """Shapes one request's answer: a whole response, or stream chunks as chunks arrive."""

    response_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(
        self, request: OpenAIRequest, model: str, created: int, tokenizer: Tokenizer
    ) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.choices = [Choice() for _ in request.requests]
        self._created, self._model = created, model

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Take a chunk of choice `index` for the whole response."""
        self.choices[index].add(chunk, keep=True)

    def response(self) -> Json:
        """The whole (non-streamed) response."""
        return {
            **self._envelope(self.response_object),
            "choices": [self._choice(i, choice) for i, choice in enumerate(self.choices)],
            "usage": usage(self.choices, self.request.n),
        }

    def start_chunks(self) -> list[Json]:
        """The chunks a stream opens with, before any output."""
        return []

    def delta_chunks(self, index: int, chunk: GenerationChunk) -> list[Json]:
        """The stream chunks for a chunk of choice `index`: its delta, then its finish."""
        choice = self.choices[index]
        choice.add(chunk, keep=False)
        wants_logprobs = self.request.top_logprobs is not None
        out = []
        if chunk.text or (wants_logprobs and chunk.output_ids):
            out.append(self.chunk([self._delta(index, choice, chunk)]))
        if choice.finish_reason is not None:
            out.append(self.chunk([self._finish(index, choice.finish_reason)]))
        return out

    def usage_chunk(self) -> Json:
        """The last chunk of a stream that asked for usage."""
        return {**self.chunk([]), "usage": usage(self.choices, self.request.n)}

    def chunk(self, choices: list[Json]) -> Json:
        """A stream chunk around some choices."""
        out = {**self._envelope(self.chunk_object), "choices": choices}
        if self.request.include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries usage
        return out

    def _envelope(self, kind: str) -> Json:
        return {
            "id": self.request.id,
            "object": kind,
            "created": self._created,
            "model": self._model,
        }

    @abstractmethod
    def _choice(self, index: int, choice: Choice) -> Json:
        """A finished choice in the whole response."""

    @abstractmethod
    def _delta(self, index: int, choice: Choice, chunk: GenerationChunk) -> Json:
        """A choice's new output in a stream chunk."""

    @abstractmethod
    def _finish(self, index: int, reason: str) -> Json:
        """A choice's finish in a stream chunk."""


class CompletionResponse(ResponseBuilder):
    """/v1/completions: text choices, legacy logprobs, optional echo of the prompt."""

    response_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(
        self, request: OpenAIRequest, model: str, created: int, tokenizer: Tokenizer
    ) -> None:
        super().__init__(request, model, created, tokenizer)
        for index, choice in enumerate(self.choices):
            choice.offset = len(self._echo(index))

    def start_chunks(self) -> list[Json]:
        if not self.request.echo:
            return []
        return [
            self.chunk(
                [{"index": i, "text": self._echo(i), "logprobs": None, "finish_reason": None}]
            )
            for i in range(len(self.choices))
        ]

    def _echo(self, index: int) -> str:
        echo = self.request.echo
        return echo[index // self.request.n] if echo else ""

    def _choice(self, index: int, choice: Choice) -> Json:
        logprobs = None
        if self.request.top_logprobs is not None:
            logprobs = completion_logprobs(
                self.tokenizer, choice.token_logprobs, choice.top_logprobs, choice.offset
            )
            if self.request.echo:
                prompt = completion_logprobs(
                    self.tokenizer, choice.prompt_logprobs, choice.prompt_top_logprobs, 0
                )
                logprobs = join_completion_logprobs(prompt, logprobs)
        return {
            "index": index,
            "text": self._echo(index) + choice.text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
        }

    def _delta(self, index: int, choice: Choice, chunk: GenerationChunk) -> Json:
        logprobs = None
        if self.request.top_logprobs is not None:
            logprobs = completion_logprobs(
                self.tokenizer,
                chunk.output_token_logprobs,
                chunk.output_top_logprobs,
                choice.offset,
            )
            choice.offset += sum(len(token) for token in logprobs["tokens"])
        return {"index": index, "text": chunk.text, "logprobs": logprobs, "finish_reason": None}

    def _finish(self, index: int, reason: str) -> Json:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": reason}


class ChatResponse(ResponseBuilder):
    """/v1/chat/completions: assistant messages, chat logprobs, role-first streams."""

    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def start_chunks(self) -> list[Json]:
        delta = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
            for i in range(len(self.choices))
        ]

    def _logprobs(
        self, tokens: Sequence[TokenLogprob], tops: Sequence[Sequence[TokenLogprob]]
    ) -> Json | None:
        if self.request.top_logprobs is None:
            return None
        return {"content": chat_logprobs(self.tokenizer, tokens, tops), "refusal": None}

    def _choice(self, index: int, choice: Choice) -> Json:
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._logprobs(choice.token_logprobs, choice.top_logprobs),
            "finish_reason": choice.finish_reason,
        }

    def _delta(self, index: int, choice: Choice, chunk: GenerationChunk) -> Json:
        return {
            "index": index,
            "delta": {"content": chunk.text},
            "logprobs": self._logprobs(chunk.output_token_logprobs, chunk.output_top_logprobs),
            "finish_reason": None,
        }

    def _finish(self, index: int, reason: str) -> Json:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}
