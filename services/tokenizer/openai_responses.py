"""OpenAI response bodies and stream chunks, shaped from the mesh's GenerationChunks: each
choice as its chunks arrive, the usage they add up to, and logprobs in OpenAI's two shapes
(the legacy completion one and the chat one)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from radixmesh.core.finish import FinishKind, FinishReason
from radixmesh.core.meta_info import TokenLogprob
from radixmesh.core.tokenizer import Tokenizer
from radixmesh.services.tokenizer.chat_answer import AnswerParts
from radixmesh.services.tokenizer.generation import GenerationChunk, GenerationError
from radixmesh.services.tokenizer.openai_protocol import OpenAIRequest

Json = dict[str, Any]
# OpenAI's stand-in for a logprob JSON cannot carry (-inf).
_FLOOR = -9999.0


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
                logprobs = _join_completion_logprobs(prompt, logprobs)
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

    def __init__(
        self, request: OpenAIRequest, model: str, created: int, tokenizer: Tokenizer
    ) -> None:
        super().__init__(request, model, created, tokenizer)
        call_id = f"call_{request.id.split('-', 1)[-1]}"
        self.parts = [AnswerParts(request.answer, f"{call_id}_{i}")
                      for i in range(len(self.choices))]

    def _choice(self, index: int, choice: Choice) -> Json:
        parts = self.parts[index]
        return {
            "index": index,
            "message": parts.message(choice.text),
            "logprobs": self._logprobs(choice.token_logprobs, choice.top_logprobs),
            "finish_reason": self._reason(parts, choice.finish_reason),
        }

    def delta_chunks(self, index: int, chunk: GenerationChunk) -> list[Json]:
        """With parsers on, the answer's text goes through them: reasoning, content and
        tool calls come as their own deltas (a call's name first, then its arguments as they
        are written); a forced call comes whole once its arguments are complete."""
        parts = self.parts[index]
        if parts.plain:
            return super().delta_chunks(index, chunk)
        choice = self.choices[index]
        choice.add(chunk, keep=False)
        deltas = parts.feed(chunk.text)
        if choice.finish_reason is not None:
            deltas += parts.finish()
        logprobs = self._logprobs(chunk.output_token_logprobs, chunk.output_top_logprobs)
        if logprobs is not None and chunk.output_ids and not deltas:
            deltas = [{"content": ""}]  # the logprobs of text still held back
        out = []
        for k, delta in enumerate(deltas):
            out.append(self.chunk([{"index": index, "delta": delta,
                                    "logprobs": logprobs if k == 0 else None,
                                    "finish_reason": None}]))
        if choice.finish_reason is not None:
            out.append(self.chunk([self._finish(index, self._reason(parts,
                                                                    choice.finish_reason))]))
        return out

    @staticmethod
    def _reason(parts: AnswerParts, reason: str | None) -> str | None:
        """OpenAI's finish reason: an answer that ended by calling tools ends with tool_calls."""
        return "tool_calls" if parts.called and reason == "stop" else reason

    def _delta(self, index: int, choice: Choice, chunk: GenerationChunk) -> Json:
        return {
            "index": index,
            "delta": {"content": chunk.text},
            "logprobs": self._logprobs(chunk.output_token_logprobs, chunk.output_top_logprobs),
            "finish_reason": None,
        }

    def _finish(self, index: int, reason: str) -> Json:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}


# ---- one choice as its chunks arrive, and the usage they add up to ---------------------------


def finish_reason(finish: FinishReason | None) -> str | None:
    """OpenAI's finish_reason; a request the mesh aborted is an error, not a finish."""
    if finish is None:
        return None
    if finish.kind is not FinishKind.ABORT:
        return finish.kind.value
    raise GenerationError(finish.message or "the request was aborted", 503)


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


# ---- logprobs --------------------------------------------------------------------------------


def _finite(logprob: float | None) -> float:
    return logprob if logprob is not None and math.isfinite(logprob) else _FLOOR


def _token_text(tokenizer: Tokenizer, entry: TokenLogprob) -> str:
    """The text of a logprob entry's token, special tokens included."""
    _, token_id, text = entry
    return text if text is not None else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[TokenLogprob],
    tops: Sequence[Sequence[TokenLogprob] | None],
    offset: int,
) -> dict[str, list[Any]]:
    """The completion shape, with text offsets counted from `offset`."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for k, entry in enumerate(tokens):
        text = _token_text(tokenizer, entry)
        # A prompt's first token has no logprob, nor alternatives.
        logprob = None if entry[0] is None else _finite(entry[0])
        top: dict[str, float] | None = None
        if logprob is not None:
            alternatives = (tops[k] if k < len(tops) else None) or ()
            top = {_token_text(tokenizer, alt): _finite(alt[0]) for alt in alternatives}
            # OpenAI always lists the sampled token among the alternatives.
            top.setdefault(text, logprob)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _join_completion_logprobs(
    first: dict[str, list[Any]], second: dict[str, list[Any]]
) -> dict[str, list[Any]]:
    """Two completion-shape logprobs one after the other (an echoed prompt, then the output)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(
    tokenizer: Tokenizer,
    tokens: Sequence[TokenLogprob],
    tops: Sequence[Sequence[TokenLogprob]],
) -> list[dict[str, Any]]:
    """The chat shape: one entry per token with its bytes and its top alternatives."""
    content = []
    for k, entry in enumerate(tokens):
        alternatives = tops[k] if k < len(tops) else ()
        content.append(
            {
                **_chat_token(tokenizer, entry),
                "top_logprobs": [_chat_token(tokenizer, alt) for alt in alternatives],
            }
        )
    return content


def _chat_token(tokenizer: Tokenizer, entry: TokenLogprob) -> dict[str, Any]:
    text = _token_text(tokenizer, entry)
    return {"token": text, "logprob": _finite(entry[0]), "bytes": list(text.encode("utf-8"))}
